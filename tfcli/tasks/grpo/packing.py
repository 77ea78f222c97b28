"""A rollout's completions of one prompt in one row after it (grpo.share_prompt), the prompt read once.

Rows of prompt + completion (loss.rows_of) read each prompt G times, and each row is padded to the
batch's longest completion. Here each prompt's completions follow it in one row (two or more rows when
one would cost more than separate rows: attention grows with the row), each completion meeting the
prompt and itself only (blocks.replies_to_one_prompt), and the per-token log-probabilities are put
back in the rows_of layout, so that advantages, the loss and the metrics read what they read before.
A completion starts its segment of the row with the prompt's last token (which predicts its first
token), so every segment predicts its own tokens in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ...data import IGNORE


class Packer:
    """Lays out a rollout micro-batch's rows: `cost(tokens)` estimates what a row of that many tokens
    costs to read (more than linear: attention), `window` the longest row a model's sliding window
    reads as it would the replies alone (0: no window)."""

    def __init__(self, cost: Callable[[int], float], window: int = 0):
        self.cost, self.window = cost, window

    def __call__(self, prompts: list[list[int]], completions: list[list[int]], rows: dict[str, Tensor], pad: int):
        """rows: loss.rows_of's input_ids and targets (R, T). -> the packed read (packed_ids, packed_targets,
        shared_prompt, unpack) to add to them, or None where no row would hold two completions."""
        layout = self.layout(prompts, completions, rows["targets"])
        if not layout or max(len(replies) for _, replies in layout) < 2:
            return None
        width = max(len(prompts[first]) - 1 + sum(len(completions[r]) for r in replies) for first, replies in layout)
        most = max(len(replies) for _, replies in layout)
        ids = torch.full((len(layout), width), pad, dtype=torch.long)
        targets = torch.full((len(layout), width), IGNORE, dtype=torch.long)
        starts = torch.full((len(layout), most), width, dtype=torch.long)
        unpack = torch.zeros(rows["targets"].shape, dtype=torch.long)
        for b, (first, replies) in enumerate(layout):
            prompt = prompts[first]
            at = len(prompt) - 1
            ids[b, :at] = torch.tensor(prompt[:-1], dtype=torch.long)
            for k, r in enumerate(replies):
                c = completions[r]
                starts[b, k] = at
                ids[b, at : at + len(c)] = torch.tensor(prompt[-1:] + c[:-1], dtype=torch.long)
                span = slice(len(prompt) - 1, len(prompt) - 1 + len(c))  # where rows_of predicts c
                targets[b, at : at + len(c)] = rows["targets"][r, span]
                unpack[r, span] = b * width + torch.arange(at, at + len(c))
                at += len(c)
        return {"packed_ids": ids, "packed_targets": targets, "shared_prompt": starts, "unpack": unpack}

    def layout(self, prompts: list[list[int]], completions: list[list[int]], targets: Tensor) -> list:
        """[(a row's first completion, the completions it holds)]: consecutive completions of the same
        prompt share a row while adding one costs less than a row of its own. Completions with nothing
        to train (masked, empty) are left out: their log-probabilities are never read."""
        trained = (targets != IGNORE).any(1).tolist()
        out: list[tuple[int, list[int]]] = []
        length = 0
        for r, (p, c) in enumerate(zip(prompts, completions)):
            if not trained[r]:
                continue
            same = out and prompts[out[-1][0]] == p
            grown = length + len(c)
            alone = len(p) + len(c)
            cheaper = self.cost(grown) - self.cost(length) <= self.cost(alone)
            if same and cheaper and (not self.window or grown <= self.window):
                out[-1][1].append(r)
                length = grown
            else:
                out.append((r, [r]))
                length = alone - 1  # the prompt less its last token, then the completion
        return out


def packed_logprobs(batch: dict[str, Tensor], packed: Tensor) -> Tensor:
    """The packed read's (B, Tp) per-token values -> the rows_of layout (R, T), 0 where nothing is trained."""
    logical = packed.reshape(-1)[batch["unpack"]]
    return torch.where(batch["targets"] != IGNORE, logical, torch.zeros_like(logical))
