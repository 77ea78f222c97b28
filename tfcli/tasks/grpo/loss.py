"""Group-relative advantages and the clipped surrogate loss, as TRL's GRPOTrainer computes them."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ...data import IGNORE
from ...objectives.losses import lm_head, token_logprobs
from .config import EPS, GRPOConfig
from .packing import Packer, packed_logprobs


def nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """The unbiased standard deviation of the non-NaN values (NaN for fewer than two): TRL's nanstd."""
    x = x if dim is not None else x.reshape(-1)
    dim = dim if dim is not None else 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, math.nan))
    return variance.sqrt().squeeze(dim)


def advantages(
    per_reward: Tensor, weights: Tensor, groups: int, scale: str, pooled_std=None
) -> tuple[Tensor, Tensor, Tensor]:
    """per_reward (N, F) with NaN where a reward did not apply; N = prompts x G, each prompt's G rows
    together -> (advantages (N,), total rewards (N,), whether each row's std is zero (N,)), as TRL's
    sum_then_normalize: a row no reward scored gets NaN reward and advantage 0. pooled_std(rewards)
    gives the batch's deviation across processes (scale batch)."""
    unscorable = torch.isnan(per_reward).all(1)
    rewards = (per_reward * weights[None]).nansum(1)
    rewards[unscorable] = math.nan
    grouped = rewards.view(-1, groups)  # (prompts, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(groups)
    if scale == "batch":
        std = (pooled_std or nanstd)(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(groups)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + EPS)
    return torch.nan_to_num(adv, nan=0.0), rewards, torch.isclose(std, torch.zeros_like(std))


def rloo_advantages(
    per_reward: Tensor, weights: Tensor, groups: int, kl: Tensor | None, beta: float, normalize: bool, pooled=None
) -> tuple[Tensor, Tensor, Tensor]:
    """RLOO's advantages, as TRL's RLOOTrainer computes them: the total reward less beta x each
    sequence's KL (`kl` (N,), the sampling model's log-ratio to the reference summed over the
    completion; None without a reference), less the mean of the other scorable completions of its
    prompt (the leave-one-out baseline); with `normalize`, standardised over the batch. Returns as
    `advantages` does (advantages, total rewards without the KL, zero-std flags)."""
    unscorable = torch.isnan(per_reward).all(1)
    rewards = (per_reward * weights[None]).nansum(1)
    rewards[unscorable] = math.nan
    total = rewards.clone()
    if kl is not None:
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, groups)  # (prompts, G)
    count = (~torch.isnan(grouped)).sum(1, keepdim=True)
    baseline = (torch.nansum(grouped, 1, keepdim=True) - grouped) / (count - 1)
    adv = rewards - baseline.reshape(-1)
    if normalize:
        adv = (adv - torch.nanmean(adv)) / ((pooled or nanstd)(adv) + EPS)
    std = nanstd(grouped, dim=1).repeat_interleave(groups)
    return torch.nan_to_num(adv, nan=0.0), total, torch.isclose(std, torch.zeros_like(std))


class GRPOLoss:
    """The clipped surrogate (and the KL term) of one rollout micro-batch: rows of prompt + completion,
    `targets` IGNORE except at the completion's tokens -> (loss, TRL's metrics)."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg

    def __call__(self, model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]):
        cfg = self.cfg
        logp = completion_logprobs(model, batch, cfg.temperature)  # (R, T)
        mask = (batch["targets"] != IGNORE).float()  # (R, T)
        if cfg.loss_type == "rloo":
            return self.rloo(logp, mask, batch)
        old = batch.get("old_logps", logp.detach())
        ratio = torch.exp(logp - old)
        adv = batch["advantages"][:, None]  # (R, 1)
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.upper) * adv)
        metrics: dict[str, Tensor] = {}
        tokens = mask.sum().clamp(min=1.0)
        if cfg.beta > 0:
            delta = batch["ref_logps"] - logp
            kl = torch.exp(delta) - delta - 1
            if cfg.use_bias_correction_kl:  # times the ratio: the unbiased reverse-KL gradient, even where r is 1
                kl = kl * ratio
            per_token = per_token + cfg.beta * kl
            metrics["kl"] = (kl.detach() * mask).sum() / tokens
        if cfg.loss_type == "grpo":
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif cfg.loss_type == "dr_grpo":
            loss = (per_token * mask).sum() / (per_token.size(0) * cfg.max_completion_length)
        else:  # dapo
            loss = (per_token * mask).sum() / tokens
        low = ((ratio < 1 - cfg.epsilon) & (adv < 0)).float()
        high = ((ratio > 1 + cfg.upper) & (adv > 0)).float()
        metrics.update(
            {
                "clip_ratio/low_mean": (low * mask).sum() / tokens,
                "clip_ratio/high_mean": (high * mask).sum() / tokens,
                "clip_ratio/region_mean": (((low + high) > 0).float() * mask).sum() / tokens,
            }
        )
        return loss, {"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}

    def rloo(self, logp: Tensor, mask: Tensor, batch: dict[str, Tensor]):
        """RLOO's loss (TRL's RLOOTrainer): the clipped surrogate of each completion's whole-sequence
        ratio, averaged over the completions; its KL is in the advantages, not here."""
        cfg = self.cfg
        logps = (logp * mask).sum(1)  # (R,)
        old = (batch["old_logps"] * mask).sum(1) if "old_logps" in batch else logps.detach()
        ratio, adv = torch.exp(logps - old), batch["advantages"]
        loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.upper) * adv).mean()
        low = ((ratio < 1 - cfg.epsilon) & (adv < 0)).float()
        high = ((ratio > 1 + cfg.upper) & (adv > 0)).float()
        clipped = {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean()}
        clipped["clip_ratio/region_mean"] = ((low + high) > 0).float().mean()
        return loss, {"loss": loss.detach(), **{k: v.detach() for k, v in clipped.items()}}

    def weight(self, batch: dict[str, Tensor]) -> Tensor:
        """What a micro-batch's loss averages over (Job.loss_weight): completion tokens (dapo) or rows."""
        if self.cfg.loss_type == "dapo":
            return (batch["targets"] != IGNORE).sum()
        return torch.tensor(batch["input_ids"].size(0), device=batch["input_ids"].device)


def completion_logprobs(model: nn.Module, batch: dict[str, Tensor], temperature: float) -> Tensor:
    """(R, T) log pi of each completion token (of logits / temperature), 0 elsewhere; read from the
    packed rows where the rollout has them (packing.py: each prompt once)."""
    if "packed_ids" in batch:
        hidden = model(batch["packed_ids"], shared_prompt=batch["shared_prompt"])  # (B, Tp, D)
        head = lm_head(model, hidden)
        packed = token_logprobs(head.hidden, head.weight, batch["packed_targets"], head.softcap, temperature)
        return packed_logprobs(batch, packed)
    hidden = model(batch["input_ids"])  # (R, T, D)
    head = lm_head(model, hidden)
    return token_logprobs(head.hidden, head.weight, batch["targets"], head.softcap, temperature)


def rows_of(
    prompts: list[list[int]],
    completions: list[list[int]],
    masked: list[bool],
    pad: int,
    trained: list[list[bool]] | None = None,
    packer: Packer | None = None,
) -> dict[str, Tensor]:
    """Rows of prompt + completion, right-padded: input_ids (R, T) and targets (R, T) holding each
    completion token at the position before it (IGNORE elsewhere, everywhere in a masked row, and at
    the tokens `trained` says the model read rather than wrote: a tool's result between its turns);
    with `packer`, also the read that takes each prompt once for its completions (packing.py)."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    targets = torch.full((len(prompts), width), IGNORE, dtype=torch.long)
    for r, (p, c, skip) in enumerate(zip(prompts, completions, masked)):
        ids[r, : len(p) + len(c)] = torch.tensor(p + c)
        if c and not skip:
            wanted = torch.tensor(c)
            if trained is not None:
                wanted[~torch.tensor(trained[r], dtype=torch.bool)] = IGNORE
            targets[r, len(p) - 1 : len(p) + len(c) - 1] = wanted
    rows = {"input_ids": ids, "targets": targets}
    if packer is not None:
        rows.update(packer(prompts, completions, rows, pad) or {})
    return rows
