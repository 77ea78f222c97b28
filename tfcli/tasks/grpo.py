"""Online reinforcement learning with verifiable rewards: GRPO (`tfcli finetune grpo`; Shao et al. 2024),
as TRL's GRPOTrainer defines it (trl/trainer/grpo_trainer.py, grpo_config.py).

    tfcli finetune grpo --from MODEL --data prompts.jsonl --reward final-number
    tfcli finetune grpo --from MODEL --data gsm8k/ --set grpo.preset=gsm8k --train lora
    tfcli eval grpo --checkpoint RUN --data test.jsonl --limit 200

Each step draws train.batch_size prompts; the model samples grpo.num_generations (G) completions of
each (grpo.temperature, top_p, top_k; at most max_completion_length tokens, ending at the end-of-turn
token, which is trained); the rewards (tasks/rewards.py) score them; a completion's advantage is its
reward less its group's mean, over the group's standard deviation + 1e-4 (scale_rewards group; batch:
the whole batch's deviation; none: unscaled). The loss, token by token t of completion i, is

    -min(r A_i, clip(r, 1 - epsilon, 1 + epsilon_high) A_i) + beta (exp(ref - logp) - (ref - logp) - 1)

with r = exp(logp - logp_old): 1 (with its gradient) unless grpo.num_iterations > 1 trains several
steps on one rollout, and the k3 KL estimate against the frozen reference only when beta > 0 (TRL's
default is 0), times r as TRL's use_bias_correction_kl (default on) has it. loss_type normalises it: grpo (each completion's mean, then their mean), dapo (the mean
over every completion token of the global batch, TRL's default), dr_grpo (the sum over completions x
max_completion_length). Log-probabilities are of logits / temperature, as TRL computes them. Metrics
are named as TRL names them. Completions run to the right of their prompt in one right-padded row
(positions as in generation; no attention mask needed: padding only follows).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from ..adapters import method
from ..data import IGNORE
from ..data.chat import ChatTemplate, check_messages, stop_ids
from ..data.labelled import TextSpec, raw_splits
from ..data.sampler import Draw, Source
from ..display import console, phase
from ..engine.backbone import from_run
from ..engine.checkpoint import run_dir_of
from ..engine.perf import training_flops_multiplier
from ..errors import UserError
from ..generate import generate_batch
from ..models import kinds
from ..objectives.losses import token_logprobs
from ..plugin import EvalOptions, Job, Plugin
from ..recipe import require
from . import rewards as rewarding
from .presets import PRESETS
from .reference import reference_mode, reference_of, starting_model
from .sft import read_splits, report_rows, summary_line, template_for

EPS = 1e-4  # TRL's: advantages are divided by std + EPS


@dataclass(frozen=True)
class GRPOConfig:
    """The `grpo:` recipe section (TRL's GRPOConfig names, and its defaults where a CPU allows them)."""

    reward: str = field(
        default="",
        metadata={
            "help": "--reward: final-number, exact, contains, regex:P, length:N, file.py:fn; weights as :W",
            "path": "code",
        },
    )
    preset: str = field(
        default="", metadata={"help": "gsm8k: GSM8K's fields and splits, and final-number as the default reward"}
    )
    prompt_field: str = field(
        default="", metadata={"help": 'the column holding the prompt text ("": the preset\'s, else prompt)'}
    )
    answer_field: str = field(
        default="",
        metadata={"help": 'what final-number, exact and contains compare with ("": the preset\'s, else answer)'},
    )
    messages_field: str = field(
        default="messages", metadata={"help": "a row's conversation so far (ending with the user's turn)"}
    )
    system: str = field(default="", metadata={"help": "a system message before every prompt"})
    chat_template: str = field(
        default="",
        metadata={
            "help": '"": the model\'s own (none: the prompt text as it is) | none | chatml | FILE.jinja',
            "path": "path",
        },
    )
    num_generations: int = field(default=8, metadata={"help": "G: completions sampled per prompt"})
    max_completion_length: int = field(default=256, metadata={"help": "tokens (TRL: 512)"})
    temperature: float = field(
        default=1.0,
        metadata={"help": "sampling temperature of the completions (log-probabilities are of logits / temperature)"},
    )
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling of the completions (1: off)"})
    top_k: int = field(default=0, metadata={"help": "0: all"})
    beta: float = field(default=0.0, metadata={"help": "the KL term's weight (0: no reference model)"})
    reference: Literal["auto", "copy", "base"] = field(
        default="auto", metadata={"help": "with beta > 0; auto: base for lora/qlora/ia3, else copy"}
    )
    use_bias_correction_kl: bool = field(
        default=True, metadata={"help": "the KL term times the ratio (TRL's default, DeepSeek-V3.2)"}
    )
    epsilon: float = field(default=0.2, metadata={"help": "clipping of the ratio, below"})
    epsilon_high: float = field(default=0.0, metadata={"help": "and above (0: epsilon; DAPO: 0.28)"})
    num_iterations: int = field(
        default=1, metadata={"help": "steps trained on each rollout (mu; > 1 makes the ratio and its clipping matter)"}
    )
    scale_rewards: Literal["group", "batch", "none"] = field(
        default="group",
        metadata={
            "help": "advantages over the group's reward deviation (group), the batch's (batch), or unscaled (none)"
        },
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = field(
        default="dapo",
        metadata={
            "help": "grpo: each completion's mean then their mean; dapo: the mean over every completion token; dr_grpo: over completions x max_completion_length"
        },
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "completions cut at the length limit are left out of the loss"}
    )
    eval_prompts: int = field(
        default=64, metadata={"resumable": True, "help": "held-out prompts answered (greedy) at each evaluation"}
    )
    generate_batch: int = field(
        default=64, metadata={"resumable": True, "help": "rows generated together at an evaluation"}
    )
    show: int = field(default=2, metadata={"resumable": True, "help": "completions printed at each evaluation"})

    def __post_init__(self):
        require(
            self.num_generations >= 2,
            "grpo.num_generations",
            ">= 2 (advantages compare a prompt's completions)",
            self.num_generations,
        )
        require(self.max_completion_length >= 1, "grpo.max_completion_length", ">= 1", self.max_completion_length)
        require(self.temperature > 0, "grpo.temperature", "> 0 (completions are sampled)", self.temperature)
        require(0 < self.top_p <= 1, "grpo.top_p", "in (0, 1]", self.top_p)
        require(self.top_k >= 0, "grpo.top_k", ">= 0", self.top_k)
        require(self.beta >= 0, "grpo.beta", ">= 0", self.beta)
        require(0 <= self.epsilon < 1, "grpo.epsilon", "in [0, 1)", self.epsilon)
        require(self.epsilon_high >= 0, "grpo.epsilon_high", ">= 0", self.epsilon_high)
        require(self.num_iterations >= 1, "grpo.num_iterations", ">= 1", self.num_iterations)
        require(not self.preset or self.preset == "gsm8k", "grpo.preset", "gsm8k or empty", self.preset)
        require(self.eval_prompts >= 0, "grpo.eval_prompts", ">= 0", self.eval_prompts)
        require(self.generate_batch >= 1, "grpo.generate_batch", ">= 1", self.generate_batch)

    @property
    def upper(self) -> float:
        return self.epsilon_high or self.epsilon


def fields_of(cfg: GRPOConfig) -> tuple[str, str]:
    """(prompt column, answer column): the recipe's, else the preset's, else prompt and answer."""
    p = PRESETS.get(cfg.preset)
    return cfg.prompt_field or (p.prompt_field if p else "prompt"), cfg.answer_field or (
        p.response_field if p else "answer"
    )


def reward_spec(cfg: GRPOConfig) -> str:
    return cfg.reward or ("final-number" if cfg.preset == "gsm8k" else "")


def data_spec(cfg: GRPOConfig) -> TextSpec:
    p = PRESETS.get(cfg.preset)
    return (
        TextSpec("grpo", ())
        if p is None
        else TextSpec(cfg.preset, (), splits=p.splits, hub=p.hub, hub_splits=p.hub_splits)
    )


# --- prompts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # what generation starts from (the chat template's rendering, generation prompt included)
    asked: str | list  # the prompt as rewards receive it: its text, or its messages
    row: dict  # the row's columns (what rewards read)
    number: int  # the row's position in its split (1-based), for messages about it


@dataclass
class Prompts:
    examples: list[Prompt]
    skipped: Counter = field(default_factory=Counter)


class PromptBuilder:
    """Rows -> prompts: a `messages` conversation ending with the user's turn, or a `prompt` text (the
    user's message, as SFT reads it; with no template, the text as it is, as TRL feeds a plain prompt),
    rendered with the generation prompt; rows too long to leave room for a completion are skipped."""

    def __init__(self, tokenizer, template: ChatTemplate | None, cfg: GRPOConfig, longest: int):
        self.tok, self.template, self.cfg, self.longest = tokenizer, template, cfg, longest
        self.prompt_field = fields_of(cfg)[0]

    def build_all(self, rows: list) -> Prompts:
        out = Prompts([])
        for number, row in enumerate(rows, 1):
            built = self.example(row, number) if isinstance(row, dict) else "skip:not a row of fields"
            if isinstance(built, str):
                out.skipped[built[len("skip:") :]] += 1
            else:
                out.examples.append(built)
        return out

    def example(self, row: dict, number: int) -> Prompt | str:
        cfg = self.cfg
        system = [{"role": "system", "content": cfg.system}] if cfg.system else []
        if isinstance(row.get(cfg.messages_field), list):
            messages = row[cfg.messages_field]
            try:
                check_messages(messages)
            except UserError:
                return "skip:a message without role and text content"
            if not messages or messages[-1]["role"] != "user":
                return "skip:messages not ending with the user's turn"
            if self.template is None:
                return "skip:a conversation needs a chat template (grpo.chat_template)"
            asked: str | list = [{"role": m["role"], "content": m["content"]} for m in messages]
            ids = self.template.render(self.tok, system + asked, add_generation_prompt=True).ids
        elif isinstance(row.get(self.prompt_field), str) and row[self.prompt_field].strip():
            asked = row[self.prompt_field]
            ids = (
                self.template.render(
                    self.tok, system + [{"role": "user", "content": asked}], add_generation_prompt=True
                ).ids
                if self.template is not None
                else self.tok.encode(asked)
            )
        else:
            return f"skip:no {self.prompt_field!r} text or {cfg.messages_field!r} list"
        if not ids:
            return "skip:empty prompt"
        if len(ids) > self.longest:
            return "skip:prompt longer than data.seq_len - grpo.max_completion_length"
        return Prompt(list(ids), asked, row, number)


class PromptBatches(Source):
    """Batches of prompt indices (the rollout looks the prompts up) and a sampling seed of the draw's
    own: the same prompts of the same epoch sample the same completions, so a resumed run does too."""

    def __init__(self, prompts: list[Prompt]):
        self.prompts = prompts
        self.lengths = np.array([len(p.ids) for p in prompts])

    def epoch_size(self, epoch: int) -> int:
        return len(self.prompts)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        seed = int(np.random.default_rng(draw.keys[0].tolist()).integers(2**62))
        return {"index": torch.from_numpy(draw.indices.astype(np.int64)), "seed": torch.tensor([seed])}


# --- advantages and the loss ---------------------------------------------------------------------


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


class GRPOLoss:
    """The clipped surrogate (and the KL term) of one rollout micro-batch: rows of prompt + completion,
    `targets` IGNORE except at the completion's tokens -> (loss, TRL's metrics)."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg

    def __call__(self, model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]):
        cfg = self.cfg
        logp = completion_logprobs(model, batch, cfg.temperature)  # (R, T)
        mask = (batch["targets"] != IGNORE).float()  # (R, T)
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

    def weight(self, batch: dict[str, Tensor]) -> Tensor:
        """What a micro-batch's loss averages over (Job.loss_weight): completion tokens (dapo) or rows."""
        if self.cfg.loss_type == "dapo":
            return (batch["targets"] != IGNORE).sum()
        return torch.tensor(batch["input_ids"].size(0), device=batch["input_ids"].device)


def completion_logprobs(model: nn.Module, batch: dict[str, Tensor], temperature: float) -> Tensor:
    """(R, T) log pi of each completion token (of logits / temperature), 0 elsewhere."""
    hidden = model(batch["input_ids"])  # (R, T, D)
    return token_logprobs(hidden / temperature, model.lm_head_weight, batch["targets"])


def rows_of(prompts: list[list[int]], completions: list[list[int]], masked: list[bool], pad: int) -> dict[str, Tensor]:
    """Rows of prompt + completion, right-padded: input_ids (R, T) and targets (R, T) holding each
    completion token at the position before it (IGNORE elsewhere, and everywhere in a masked row)."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    targets = torch.full((len(prompts), width), IGNORE, dtype=torch.long)
    for r, (p, c, skip) in enumerate(zip(prompts, completions, masked)):
        ids[r, : len(p) + len(c)] = torch.tensor(p + c)
        if c and not skip:
            targets[r, len(p) - 1 : len(p) + len(c) - 1] = torch.tensor(c)
    return {"input_ids": ids, "targets": targets}


# --- rollouts ------------------------------------------------------------------------------------


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


# --- the plug-in ---------------------------------------------------------------------------------


class GRPO(Plugin):
    key = "grpo"
    kind = "task"
    model_kinds = (kinds.DECODER,)
    recipe_pattern = "grpo-{family}-mini"
    Config = GRPOConfig
    describe = "GRPO (online RL, verifiable rewards)"

    def title(self, recipe, backbone) -> str:
        cfg = recipe.settings
        return (
            f"grpo ({cfg.preset or 'own prompts'}, reward {reward_spec(cfg)}, G {cfg.num_generations}, {cfg.loss_type})"
        )

    def tokenizer_texts(self, recipe):
        """A fresh model's tokenizer learns from the training rows' prompts and answers."""
        cfg, d = recipe.settings, recipe.data
        rows = next(
            iter(raw_splits(data_spec(cfg), d.source, d.val_source, d.val_fraction, recipe.train.seed).values())
        )[0]
        prompt, answer = fields_of(cfg)
        for row in rows:
            yield from (row[k] for k in (prompt, answer) if isinstance(row.get(k), str))
            yield from (
                m["content"]
                for m in row.get(cfg.messages_field) or []
                if isinstance(m, dict) and isinstance(m.get("content"), str)
            )

    def agreed(self, mine: bool) -> bool:
        """Whether every process's rows have stopped: FSDP's processes run every forward pass together."""
        if not self.rt.strategy.lockstep or not self.rt.distributed:
            return mine
        return self.rt.mean({"done": float(mine)})["done"] >= 1.0

    def prompts(self, recipe, backbone, data: str | None = None, need_train: bool = True, say: bool = True):
        """Every split's prompts (the training split first), each split's skipped rows named (say)."""
        cfg = recipe.settings
        room = min(recipe.data.seq_len, backbone.cfg.max_seq_len) - cfg.max_completion_length
        if room < 1:
            raise UserError(
                f"grpo.max_completion_length {cfg.max_completion_length} leaves no room for a prompt in "
                f"data.seq_len {min(recipe.data.seq_len, backbone.cfg.max_seq_len)} (prompt + completion); "
                f"raise data.seq_len or lower grpo.max_completion_length"
            )
        build = PromptBuilder(backbone.tokenizer, template_for(cfg.chat_template, backbone), cfg, room)
        describe = lambda split, built, where: summary_line(
            f"grpo {split}", len(built.examples), "prompts", built.skipped, where
        )
        return read_splits(
            recipe,
            data_spec(cfg),
            build,
            data,
            need_train,
            describe if say and self.rt.is_main and not self.quiet else None,
        )

    def rewards(self, recipe, prompts: list[Prompt]) -> list:
        """The run's rewards, tried on its first rows with an empty completion before anything is
        created: a missing column, a function that raises or miscounts stops here, in one line."""
        cfg = recipe.settings
        rewards = rewarding.parse(reward_spec(cfg), fields_of(cfg)[1], self.named_code)
        for r in rewards:
            if r.reads and prompts and r.reads not in prompts[0].row:
                raise UserError(
                    f"reward {r.name} compares completions with each row's {r.reads!r} column, which the rows do "
                    f"not have (grpo.answer_field names it)"
                )
        sample = prompts[:2]
        rewarding.scored(
            rewards,
            rewarding.Completions(
                [p.asked for p in sample],
                [""] * len(sample),
                [[] for _ in sample],
                [p.row for p in sample],
                cfg.max_completion_length,
            ),
            lambda i: f"training row {sample[i].number} (an empty completion, tried before training)",
        )
        return rewards

    def scorable(self, prompts: list[Prompt], rewards: list, split: str) -> list[Prompt]:
        """The prompts some reward can score: a row no reward can ever reward (final-number of an answer
        with no final number) would train on a group of zeros; they are dropped, counted in a note."""
        kept = [p for p in prompts if not all(r.scores_nothing_of(p.row) for r in rewards)]
        if len(kept) < len(prompts):
            field = next(r.reads for r in rewards if r.reads)
            why = f"{len(prompts) - len(kept)} of {len(prompts)} rows skipped: no reward can score them (their {field!r} has no final number or is empty)"
            if not kept:
                raise UserError(f"grpo {split}: {why}; check grpo.answer_field and the rows")
            if self.rt.is_main and not self.quiet:
                console.print(f"[yellow]note:[/] grpo {split}: {why}")
        return kept

    def reference(self, recipe) -> str:
        """grpo.reference resolved; "none" without the KL term (beta 0), which reads no reference."""
        return reference_mode(recipe) if recipe.settings.beta > 0 else "none"

    def frozen_copies(self, recipe) -> int:
        return int(self.reference(recipe) == "copy")

    def setup(self, recipe, backbone) -> Job:
        ft, cfg = recipe.finetune, recipe.settings
        if not method(ft.train).backbone_trains:
            raise UserError(
                "grpo trains the model's completions: there is no classifier head (--train all, lora, qlora, ia3 or bitfit)"
            )
        splits = self.prompts(recipe, backbone)
        (train_split, train), *held_out = splits.items()
        if not train.examples:
            reasons = ", ".join(f"{n} {why}" for why, n in train.skipped.most_common(3)) or "no rows"
            raise UserError(f"grpo {train_split}: no usable prompt ({reasons})")
        rewards = self.rewards(recipe, train.examples)
        train.examples = self.scorable(train.examples, rewards, train_split)
        held = next((self.scorable(p.examples, rewards, s) for s, p in held_out if p.examples), [])
        mode = self.reference(recipe)
        frozen = {"reference": starting_model(self.run_dir, recipe, backbone)} if mode == "copy" else {}
        self.tokenizer = backbone.tokenizer
        template = template_for(cfg.chat_template, backbone)
        stops = stop_ids(backbone.tokenizer) if template is not None else {backbone.tokenizer.eos_id}
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        loss = GRPOLoss(cfg)
        rollouts = Rollouts(self, cfg, train.examples, rewards, stops, pad, mode, frozen)
        self.held = (held, rollouts)
        prompt_len = int(np.mean([len(p.ids) for p in train.examples[:500]]))
        full = backbone.model.flops_per_token(prompt_len + cfg.max_completion_length // 2)
        extra = 2.0 * ((cfg.num_iterations > 1) + (cfg.beta > 0)) + 2.0  # old and reference passes, sampling
        return Job(
            heads=nn.ModuleDict(),
            loss=loss,
            train=PromptBatches(train.examples),
            val=None,
            flops_per_item=full * (training_flops_multiplier(ft.train) + extra) / 6.0,
            count_items=lambda b: int(b["input_ids"].numel()),
            evaluate=self.evaluation(recipe) if held and cfg.eval_prompts else None,
            best_key="reward" if held and cfg.eval_prompts else "",
            held_out=bool(held),
            examples=len(train.examples),
            loss_weight=loss.weight,
            frozen=frozen,
            rollout=rollouts,
            reuse=cfg.num_iterations,
            plan_batch=lambda b: planned_rollout(b, cfg, recipe.data.seq_len, backbone.cfg.max_seq_len, pad),
            curve="reward",
            shown=(
                "reward",
                "reward_std",
                "frac_reward_zero_std",
                "completions/mean_length",
                "completions/clipped_ratio",
                "kl",
                "clip_ratio/region_mean",
                "loss",
                "grad_norm",
            ),
        )

    def evaluation(self, recipe):
        """Job.evaluate: the mean reward of greedy completions of the first grpo.eval_prompts held-out
        prompts; they are written to samples/eval-NNN.jsonl and the first grpo.show printed."""

        def evaluate(module: nn.Module, run_dir: Path) -> dict[str, float]:
            held, rollouts = self.held
            prompts = held[: recipe.settings.eval_prompts]  # through the module's forward, as sampling (FSDP)
            metrics, lines = module(None, lambda model, heads, _: self.answered(model, rollouts, prompts))
            if self.rt.is_main:
                folder = Path(run_dir) / "samples"
                folder.mkdir(exist_ok=True)
                path = folder / f"eval-{len(list(folder.glob('eval-*.jsonl'))) + 1:03d}.jsonl"
                path.write_text("".join(json.dumps(line) + "\n" for line in lines))
                self.show(lines[: recipe.settings.show])
            return metrics

        return evaluate

    @torch.no_grad()
    def answered(
        self, model: nn.Module, rollouts: Rollouts, prompts: list[Prompt], alone: bool = False
    ) -> tuple[dict[str, float], list[dict]]:
        """Greedy completions of this process's share of `prompts` (equal shares), scored: (metrics pooled
        over the processes, this process's lines). `alone`: all of them here (the final report runs on
        rank 0 after the processes have parted)."""
        cfg, rt = rollouts.cfg, self.rt
        shared = rt.distributed and not alone
        share = len(prompts) // rt.world_size * rt.world_size if shared else len(prompts)
        mine = prompts[:share][rt.rank :: rt.world_size] if shared else prompts
        was = model.training
        model.eval()
        completions: list[list[int]] = []
        try:
            with phase("answering held-out prompts", len(mine), "prompts") as advance:
                for s in range(0, len(mine), cfg.generate_batch):
                    group = mine[s : s + cfg.generate_batch]
                    completions += generate_batch(
                        model,
                        [p.ids for p in group],
                        max_new_tokens=cfg.max_completion_length,
                        stop_ids=rollouts.stops,
                        temperature=0.0,
                        pad_id=rollouts.pad,
                        keep_stop=True,
                        finished=self.agreed if shared else bool,
                    )
                    advance(len(group))
        finally:
            model.train(was)
        per_reward = rollouts.score(mine, completions, "held-out") if mine else torch.zeros(0, len(rollouts.rewards))
        total = (per_reward * rollouts.weights[None]).nansum(1)
        sums = {"reward": float(total.sum())}
        for i, name in enumerate(rollouts.names):
            sums[f"rewards/{name}/mean"] = float(torch.nan_to_num(per_reward[:, i]).sum())
        sums["completions/mean_length"] = float(sum(len(c) for c in completions))
        sums["completions/clipped_ratio"] = float(sum(not (c and c[-1] in rollouts.stops) for c in completions))
        metrics = rt.pooled_mean(sums, len(mine)) if shared else {k: v / max(1, len(mine)) for k, v in sums.items()}
        tok = self.tokenizer
        lines = [
            {
                "row": p.number,
                "prompt": p.asked,
                "completion": tok.decode(c[:-1] if c and c[-1] in rollouts.stops else c),
                "reward": round(float(t), 6),
                **{
                    f"rewards/{n}": (None if math.isnan(v) else round(float(v), 6))
                    for n, v in zip(rollouts.names, r.tolist())
                },
            }
            for p, c, t, r in zip(mine, completions, total, per_reward)
        ]
        return metrics, lines

    def show(self, lines: list[dict]) -> None:
        if self.quiet:
            return
        for line in lines:
            prompt = line["prompt"] if isinstance(line["prompt"], str) else line["prompt"][-1]["content"]
            console.print(
                f"[dim]prompt:[/] {_clip(prompt)}\n[dim]completion (reward {line['reward']:g}):[/] {_clip(line['completion'], 400)}",
                highlight=False,
                markup=True,
            )

    def report(self, recipe, run_dir: Path) -> dict[str, Any]:
        """The best checkpoint's mean reward on the first report_rows(recipe) held-out prompts: printed,
        eval.json, and its completions in samples.jsonl."""
        held, rollouts = self.held
        backbone = from_run(run_dir, device=str(self.rt.device))
        n = report_rows(recipe)
        metrics, lines = self.answered(backbone.model, rollouts, held[:n], alone=True)
        results = {"held_out": {**metrics, "n": min(n, len(held))}}
        if self.rt.is_main:
            (Path(run_dir) / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
            (Path(run_dir) / "eval.json").write_text(
                json.dumps({"checkpoint": str(backbone.checkpoint), **results}, indent=1)
            )
            self.say(results)
            if not self.quiet:
                console.print(f"completions: {Path(run_dir) / 'samples.jsonl'}")
        return results

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        """`tfcli eval grpo`: the mean reward of greedy completions of the held-out prompts (the first
        --limit N of each split), written beside the run (or --out) with their completions."""
        splits = self.prompts(recipe, backbone, options.data, need_train=False, say=not options.quiet)
        held = {
            s: p.examples[: options.limit or None] for i, (s, p) in enumerate(splits.items()) if i > 0 and p.examples
        }
        if not held:
            raise UserError("grpo: no held-out prompts to evaluate on (give --data with prompts to hold out)")
        rewards = rewarding.parse(reward_spec(recipe.settings), fields_of(recipe.settings)[1], options.named_code)
        template = template_for(recipe.settings.chat_template, backbone)
        stops = stop_ids(backbone.tokenizer) if template is not None else {backbone.tokenizer.eos_id}
        self.tokenizer = backbone.tokenizer
        rollouts = Rollouts(
            self, recipe.settings, [], rewards, stops, type(backbone.model).pad_id(backbone.tokenizer), "none", {}
        )
        results, lines = {}, []
        for split, prompts in held.items():
            metrics, answered = self.answered(backbone.model, rollouts, prompts, alone=True)
            results[split] = {**metrics, "n": len(prompts)}
            lines += [{"split": split, **line} for line in answered]
        run = run_dir_of(Path(backbone.checkpoint)) if backbone.recipe is not None else Path(".")
        name = (
            "eval-grpo"
            + (f"-{Path(options.data).stem}" if options.data else "")
            + (f"-limit{options.limit}" if options.limit else "")
        )
        out = options.report_path(run / f"{name}.json")
        stem = out.stem.replace("eval-", "samples-", 1) if out.stem.startswith("eval-") else f"{out.stem}-samples"
        samples = out.with_name(f"{stem}.jsonl")
        out.write_text(
            json.dumps(
                {
                    "checkpoint": str(backbone.checkpoint),
                    "data": options.data,
                    "reward": reward_spec(recipe.settings),
                    **results,
                },
                indent=1,
            )
        )
        samples.write_text("".join(json.dumps(line) + "\n" for line in lines))
        self.say(results)
        if not self.quiet:
            console.print(f"report: {out}\ncompletions: {samples}")
        return results

    def say(self, results: dict[str, dict]) -> None:
        if self.quiet:
            return
        for split, m in results.items():
            parts = ", ".join(f"{k.split('/')[1]} {v:.4f}" for k, v in m.items() if k.startswith("rewards/"))
            console.print(
                f"grpo {split} ({m['n']} prompts, greedy): mean reward {m['reward']:.4f} ({parts}); completions "
                f"{m['completions/mean_length']:.1f} tokens, {100 * m['completions/clipped_ratio']:.1f}% cut at the limit",
                highlight=False,
            )

    def hints(self, run_dir) -> list[str]:
        return [
            f"evaluate it:  tfcli eval --checkpoint {run_dir} --limit 100",
            f"chat with it: tfcli chat --checkpoint {run_dir}",
            f"export it:    tfcli export --checkpoint {run_dir} --hf {Path(run_dir).name}-hf",
        ]


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


def _clip(text: str, n: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."
