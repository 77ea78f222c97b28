"""A step's rollouts: G completions sampled of each prompt, scored by the rewards, with the advantages
and log-probabilities the loss reads; and the rollout the memory plan runs on."""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ...data import IGNORE
from ...display import console
from ...generate import generate_batch
from .. import rewards as rewarding
from ..reference import reference_of
from .config import GRPOConfig
from .loss import advantages, completion_logprobs, nanstd, rows_of
from .prompts import Prompt

if TYPE_CHECKING:
    from .plugin import GRPO


class Rollouts:
    """Job.rollout: a step's prompt batches -> rollout micro-batches (G sampled completions of every
    prompt, their advantages, and the log-probabilities the loss compares with) and the step's reward
    metrics. Generation runs in eval mode, without gradients, with the draw's own seed."""

    def __init__(self, plugin: GRPO, cfg: GRPOConfig, prompts: list[Prompt], rewards, stops, pad, mode, frozen):
        self.plugin, self.cfg, self.prompts, self.rewards = plugin, cfg, prompts, rewards
        self.stops, self.pad, self.mode, self.frozen = stops, pad, mode, frozen
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
        sampled = [self.sample(model, [p.ids for p in group], int(b["seed"])) for b, group in zip(batches, asked)]
        flat_prompts = [p for group in asked for p in group]
        flat = [c for group in sampled for c in group]
        per_reward = self.score(flat_prompts, flat, "training")
        adv, total, zero_std = advantages(
            per_reward, self.weights, cfg.num_generations, cfg.scale_rewards, lambda r: pooled_nanstd(r, rt)
        )
        stopped = [bool(c) and c[-1] in self.stops for c in flat]
        metrics = self.metrics(per_reward, total, zero_std, flat, stopped)
        out, start = [], 0
        for group, completions in zip(asked, sampled):
            n = len(group)
            masked = [cfg.mask_truncated_completions and not s for s in stopped[start : start + n]]
            rows = {k: v.to(device) for k, v in rows_of([p.ids for p in group], completions, masked, self.pad).items()}
            rows["advantages"] = adv[start : start + n].to(device)
            if cfg.num_iterations > 1:  # the model as it sampled: what later steps' ratios compare with
                with torch.no_grad():
                    rows["old_logps"] = completion_logprobs(model, rows, cfg.temperature)
            if cfg.beta > 0:
                rows["ref_logps"] = reference_of(
                    model, self.mode, self.frozen, lambda m, rows=rows: completion_logprobs(m, rows, cfg.temperature)
                )
            out.append(rows)
            start += n
        metrics["rollout_s"] = torch.tensor(
            time.perf_counter() - started
        )  # sampling, rewards, old and reference passes
        return out, {k: v.to(device) for k, v in metrics.items()}

    @torch.no_grad()
    def sample(self, model: nn.Module, prompts: list[list[int]], seed: int) -> list[list[int]]:
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
                finished=self.plugin.agreed,
            )
        finally:
            model.train(was)

    def score(self, prompts: list[Prompt], completions: list[list[int]], split: str) -> Tensor:
        """(N, F) every reward of every completion."""
        tok = self.plugin.tokenizer
        texts = [tok.decode(c[:-1] if c and c[-1] in self.stops else c) for c in completions]
        asked = rewarding.Completions(
            [p.asked for p in prompts], texts, completions, [p.row for p in prompts], self.cfg.max_completion_length
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


def planned_rollout(batch: dict, cfg: GRPOConfig, seq_len: int, context: int, pad: int) -> dict[str, Tensor]:
    """What the memory plan runs the loss on: a drawn batch's G rollouts at the longest rows the recipe
    allows (prompt + max_completion_length tokens), nothing sampled."""
    rows, width = batch["index"].numel() * cfg.num_generations, min(seq_len, context)
    device = batch["index"].device
    targets = torch.full((rows, width), IGNORE, dtype=torch.long, device=device)
    targets[:, width - 1 - cfg.max_completion_length : width - 1] = pad
    out = {
        "input_ids": torch.full((rows, width), pad, dtype=torch.long, device=device),
        "targets": targets,
        "advantages": torch.zeros(rows, device=device),
    }
    if cfg.num_iterations > 1:
        out["old_logps"] = torch.zeros(rows, width, device=device)
    if cfg.beta > 0:
        out["ref_logps"] = torch.zeros(rows, width, device=device)
    return out
