"""A step's rollouts: G completions sampled of each prompt, scored by the rewards, with the advantages
and log-probabilities the loss reads; and the rollout the memory plan runs on."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ...data import IGNORE
from ...display import console
from ...generate import generate_batch
from .. import rewards as rewarding
from ..reference import reference_of
from .config import GRPOConfig
from .loss import advantages, completion_logprobs, nanstd, rloo_advantages, rows_of
from .packing import Packer
from .prompts import Prompt
from .turns import Conversation, ToolUse, tool_metrics

if TYPE_CHECKING:
    from .plugin import GRPO


class Rollouts:
    """Job.rollout: a step's prompt batches -> rollout micro-batches (G sampled completions of every
    prompt, their advantages, and the log-probabilities the loss compares with) and the step's reward
    metrics. Generation runs in eval mode, without gradients, with the draw's own seed."""

    def __init__(
        self,
        plugin: GRPO,
        cfg: GRPOConfig,
        prompts: list[Prompt],
        rewards,
        stops,
        pad,
        mode,
        frozen,
        tooling=None,
        packer: Packer | None = None,
    ):
        self.plugin, self.cfg, self.prompts, self.rewards = plugin, cfg, prompts, rewards
        self.packer = packer  # each prompt read once for its completions (grpo.share_prompt)
        self.stops, self.pad, self.mode, self.frozen = stops, pad, mode, frozen
        self.tooling: ToolUse | None = tooling
        self.weights = torch.tensor([r.weight for r in rewards])
        self.names = reward_names(rewards)
        self.nans: Counter = Counter()  # NaNs each reward returned (taken as None), said once

    def __call__(self, module: nn.Module, batches: list[dict]) -> tuple[list[dict], dict[str, Tensor]]:
        # through the module's own forward: under FSDP its root's parameters are gathered for all of it
        return module(batches, lambda model, heads, drawn: self.rollout(model, drawn))

    def rollout(self, model: nn.Module, batches: list[dict]) -> tuple[list[dict], dict[str, Tensor]]:
        cfg, rt = self.cfg, self.plugin.rt
        device, started = batches[0]["index"].device, time.perf_counter()
        asked = [[self.prompts[i] for i in b["index"].tolist() for _ in range(cfg.num_generations)] for b in batches]
        done = [self.complete(model, group, int(b["seed"]), cfg.temperature) for b, group in zip(batches, asked)]
        flat_prompts = [p for group in asked for p in group]
        flat_done = Completed.joined(done)
        flat = flat_done.ids
        per_reward = self.score(flat_prompts, flat, "training", flat_done.conversations)
        stopped = [bool(c) and c[-1] in self.stops for c in flat]
        rloo = cfg.loss_type == "rloo"
        out, start = [], 0
        for group, completed in zip(asked, done):
            n = len(group)
            masked = [cfg.mask_truncated_completions and not s for s in stopped[start : start + n]]
            built = rows_of(completed.prompt_ids, completed.ids, masked, self.pad, completed.sampled, self.packer)
            rows = {k: v.to(device) for k, v in built.items()}
            if cfg.reads_old:  # the model as it sampled
                with torch.no_grad():
                    rows["old_logps"] = completion_logprobs(model, rows, cfg.temperature)
            if cfg.beta > 0:
                rows["ref_logps"] = reference_of(
                    model, self.mode, self.frozen, lambda m, rows=rows: completion_logprobs(m, rows, cfg.temperature)
                )
            out.append(rows)
            start += n
        kl = sequence_kl(out) if rloo and cfg.beta > 0 else None  # (N,), RLOO's reward penalty
        if rloo:
            adv, total, zero_std = rloo_advantages(
                per_reward, self.weights, cfg.num_generations, None if kl is None else kl[0].cpu(), cfg.beta,
                cfg.normalize_advantages, lambda r: pooled_nanstd(r, rt),
            )  # fmt: skip
        else:
            adv, total, zero_std = advantages(
                per_reward, self.weights, cfg.num_generations, cfg.scale_rewards, lambda r: pooled_nanstd(r, rt)
            )
        start = 0
        for rows in out:
            n = rows["input_ids"].size(0)
            rows["advantages"] = adv[start : start + n].to(device)
            start += n
        metrics = self.metrics(per_reward, total, zero_std, flat_done.written, stopped)
        if kl is not None:  # the per-token KL of the batch (TRL's RLOO "kl")
            metrics["kl"] = kl[1]
        if flat_done.conversations is not None:
            metrics.update({k: torch.tensor(v) for k, v in tool_metrics(flat_done.conversations).items()})
        metrics["rollout_s"] = torch.tensor(
            time.perf_counter() - started
        )  # sampling, rewards, old and reference passes
        return out, {k: v.to(device) for k, v in metrics.items()}

    def complete(
        self, model: nn.Module, prompts: list[Prompt], seed: int | None, temperature: float, finished=None
    ) -> Completed:
        """The prompts' completions: sampled in one turn, or with tools, turn after turn."""
        if self.tooling is None:
            if temperature > 0:
                ids = self.sample(model, [p.ids for p in prompts], seed, finished)
            else:
                ids = self.greedy(model, [p.ids for p in prompts], finished)
            return Completed([p.ids for p in prompts], ids, None, None)
        cfg, was = self.cfg, model.training
        prompt_ids, conversations = self.tooling.start(prompts)
        sampling = dict(temperature=temperature, top_k=cfg.top_k, top_p=cfg.top_p) if temperature > 0 else {}
        model.eval()
        try:
            with torch.no_grad():
                turns = self.tooling.turns.run(
                    model,
                    prompt_ids,
                    conversations,
                    max_new_tokens=cfg.max_completion_length,
                    sampling=sampling,
                    seed=seed,
                    pad_id=self.pad,
                    finished=finished or self.plugin.agreed,
                )
        finally:
            model.train(was)
        return Completed(prompt_ids, turns.ids, turns.sampled, turns.conversations)

    @torch.no_grad()
    def greedy(self, model: nn.Module, prompts: list[list[int]], finished=None) -> list[list[int]]:
        return generate_batch(
            model,
            prompts,
            max_new_tokens=self.cfg.max_completion_length,
            stop_ids=self.stops,
            temperature=0.0,
            pad_id=self.pad,
            keep_stop=True,
            finished=finished or bool,
        )

    @torch.no_grad()
    def sample(self, model: nn.Module, prompts: list[list[int]], seed: int, finished=None) -> list[list[int]]:
        """Completions sampled with the run's settings; `finished` (default: the processes agree) as
        generate_batch's: an evaluation on rank 0 alone stops by itself."""
        cfg, was = self.cfg, model.training
        model.eval()
        try:
            return generate_batch(
                model,
                prompts,
                max_new_tokens=cfg.max_completion_length,
                stop_ids=self.stops,
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                seed=seed,
                pad_id=self.pad,
                keep_stop=True,
                finished=finished or self.plugin.agreed,
            )
        finally:
            model.train(was)

    def score(self, prompts: list[Prompt], completions: list[list[int]], split: str, conversations=None) -> Tensor:
        """(N, F) every reward of every completion (with tools, of its last turn's text)."""
        texts = self.texts(completions, conversations)
        asked = rewarding.Completions(
            [p.asked for p in prompts],
            texts,
            completions,
            [p.row for p in prompts],
            self.cfg.max_completion_length,
            conversations,
        )
        where = lambda i: f"{split} row {prompts[i].number} (completion {texts[i][:40]!r})"
        before = sum(self.nans.values())
        scored = rewarding.scored(self.rewards, asked, where, self.nans)
        if before == 0 < sum(self.nans.values()) and self.plugin.rt.is_main and not self.plugin.quiet:
            spec, count = next((k, n) for k, n in self.nans.items() if n)
            name = dict(zip((r.name for r in self.rewards), self.names))[spec]
            console.print(
                f"[yellow]note:[/] reward {name} returned NaN for {count} of {len(texts)} {split} completions; "
                f"NaN is taken as None (the reward does not apply to them), here and from now on"
            )
        return scored

    def texts(self, completions: list[list[int]], conversations=None) -> list[str]:
        """What rewards read of each completion: its text (its end-of-turn token left out), or with
        tools the model's last turn (tool results are not the model's words)."""
        if conversations is not None:
            return [c.answer for c in conversations]
        tok = self.plugin.tokenizer
        return [tok.decode(c[:-1] if c and c[-1] in self.stops else c) for c in completions]

    def metrics(self, per_reward, total, zero_std, completions, stopped) -> dict[str, Tensor]:
        """TRL's rollout metrics (finite: a statistic of nothing is 0)."""
        lengths = torch.tensor([float(len(c)) for c in completions])
        ended = lengths[torch.tensor(stopped)] if any(stopped) else torch.zeros(1)
        out = {
            "reward": torch.nanmean(total),
            "reward_std": nanstd(total),
            "frac_reward_zero_std": zero_std.float().mean(),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": 1.0 - torch.tensor(stopped).float().mean(),
            "completions/mean_terminated_length": ended.mean(),
        }
        for i, name in enumerate(self.names):
            out[f"rewards/{name}/mean"] = torch.nanmean(per_reward[:, i])
            out[f"rewards/{name}/std"] = nanstd(per_reward[:, i])
        return {k: torch.nan_to_num(torch.as_tensor(v, dtype=torch.float32), nan=0.0) for k, v in out.items()}


@dataclass(frozen=True)
class Completed:
    """Completions of some prompts: the prompt ids each continued (an environment may have added to
    them), the ids after them, which ids the model sampled (None: all), and with tools each rollout's
    conversation."""

    prompt_ids: list[list[int]]
    ids: list[list[int]]
    sampled: list[list[bool]] | None
    conversations: list[Conversation] | None

    @property
    def written(self) -> list[list[int]]:
        """The ids the model wrote (TRL counts only those in completion lengths)."""
        if self.sampled is None:
            return self.ids
        return [[i for i, s in zip(ids, kept) if s] for ids, kept in zip(self.ids, self.sampled)]

    @staticmethod
    def joined(parts: list[Completed]) -> Completed:
        tools = parts[0].conversations is not None
        return Completed(
            [p for c in parts for p in c.prompt_ids],
            [i for c in parts for i in c.ids],
            [s for c in parts for s in c.sampled] if tools else None,
            [v for c in parts for v in c.conversations] if tools else None,
        )


def sequence_kl(rows: list[dict]) -> tuple[Tensor, Tensor]:
    """RLOO's KL (TRL's, after Ahmadian et al.): the sampling model's log-ratio to the reference, each
    completion's summed over its tokens (N,), and the batch's per token (a scalar)."""
    per_row, total, tokens = [], 0.0, 0.0
    for r in rows:
        mask = (r["targets"] != IGNORE).float()
        diff = (r["old_logps"] - r["ref_logps"]) * mask
        per_row.append(diff.sum(1))
        total, tokens = total + diff.sum(), tokens + mask.sum()
    return torch.cat(per_row), total / max(float(tokens), 1.0)


def reward_names(rewards: list) -> list[str]:
    """How metrics name each reward: its built-in name or the user's function's, numbered when repeated."""
    seen: Counter = Counter()
    out = []
    for r in rewards:
        base = r.name.rsplit(":", 1)[1] if ".py:" in r.name else r.name.split(":")[0]  # fn of file.py:fn, else regex...
        seen[base] += 1
        out.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return out


def pooled_nanstd(rewards: Tensor, rt) -> Tensor:
    """The batch's reward deviation over every process (TRL gathers the rewards): two passes of sums."""
    if not rt.distributed:
        return nanstd(rewards)
    valid = ~torch.isnan(rewards)
    n, total = rt.sum_tensor(valid.sum().float()), rt.sum_tensor(torch.nansum(rewards))
    mean = total / n.clamp(min=1)
    squares = rt.sum_tensor(torch.nansum((rewards - mean) ** 2))
    return torch.where(n > 1, (squares / (n - 1).clamp(min=1)).sqrt(), torch.tensor(math.nan))


def planned_rollout(
    batch: dict, cfg: GRPOConfig, seq_len: int, context: int, pad: int, packer: Packer | None = None
) -> dict[str, Tensor]:
    """What the memory plan runs the loss on: a drawn batch's G rollouts at the longest rows the recipe
    allows (prompt + max_completion_length tokens), nothing sampled, laid out as the rollouts are."""
    prompts, width = batch["index"].numel(), min(seq_len, context)
    completion = min(cfg.max_completion_length, width - 1)
    asked = [[pad] * (width - completion - 1) + [i] for i in range(prompts) for _ in range(cfg.num_generations)]
    completions = [[pad] * completion for _ in asked]
    out = rows_of(asked, completions, [False] * len(asked), pad, packer=packer)
    device, rows = batch["index"].device, len(asked)
    out = {k: v.to(device) for k, v in out.items()}
    out["advantages"] = torch.zeros(rows, device=device)
    if cfg.reads_old:
        out["old_logps"] = torch.zeros(rows, width, device=device)
    if cfg.beta > 0:
        out["ref_logps"] = torch.zeros(rows, width, device=device)
    return out
