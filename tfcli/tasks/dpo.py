"""Preference tuning with DPO (`tfcli finetune dpo`, Rafailov et al. 2023): a decoder learns to make the
replies people preferred more likely, relative to a frozen reference, than the ones they did not.

    tfcli finetune dpo --from MODEL --data pairs.jsonl --train lora        # reference: the base, adapters off
    tfcli eval dpo --checkpoint RUN --data pairs.jsonl [--reference MODEL]

log pi(y|x) is summed over the reply's tokens and its end token (prompt and padding left out; only
those positions reach the LM head); h = beta [(log pi - log ref)(chosen) - (log pi - log ref)(rejected)];
the sigmoid loss is -log sigmoid(h), with label smoothing eps -(1-eps) log sigmoid(h) - eps log sigmoid(-h)
(conservative DPO); IPO (Azar et al.) is (h'/beta... as TRL computes it: the log-ratios averaged over
the reply's tokens, (d - 1/(2 beta))^2. Metrics are named as TRL names them.

The reference (dpo.reference): `copy`, a frozen copy of the starting model in the Job; `base`, the
model itself with its adapters switched off (LoRA, IA3: no second copy; the default for them);
`precompute`, one pass before training writes the reference log-probabilities of every pair to the run
directory (reference_logps.json), so training holds one model and a resumed run reads them back.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import adapters
from ..data import IGNORE
from ..data.sampler import sequential_batches
from ..display import console, phase
from ..engine.backbone import base_model, for_inference, from_run, recorded
from ..engine.evaluate import held_out_metrics
from ..engine.perf import training_flops_multiplier
from ..engine.trainer import ObjectiveModule
from ..errors import UserError
from ..objectives.losses import TokenStats, lm_head, sequence_logprobs, token_logprobs
from ..plugin import EvalOptions, Job
from ..recipe import require
from .pairs import PairConfig, PairTask
from .reference import reference_mode, reference_of, starting_model
from .reply_batches import PairBatches, count_tokens, hidden_states, pair_count, shared_length

REFERENCE_FILE = "reference_logps.json"
# TRL's DPO losses of one pair each (DPOConfig.loss_type), as TRL 1.16 computes them; sigmoid keeps
# conservative DPO's label smoothing, which TRL's sigmoid has dropped
LOSSES = (
    "sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
    "apo_down", "discopop", "sigmoid_norm", "aot", "aot_unpaired", "sft", "cpo", "simpo", "orpo",
)  # fmt: skip
# the losses without a reference model: TRL's CPOTrainer (sigmoid, simpo) and ORPOTrainer
REFERENCE_FREE = ("cpo", "simpo", "orpo")  # each alone: dpo.loss names one of them or DPO losses


@dataclass(frozen=True)
class DPOConfig(PairConfig):
    """The `dpo:` recipe section (a pair task's fields, and these)."""

    beta: float = field(default=0.1, metadata={"help": "how far the model may move from the reference (higher: less)"})
    loss: str = field(
        default="sigmoid",
        metadata={
            "help": "sigmoid (DPO), ipo, another of TRL's DPO losses, or several summed (sigmoid,sft); "
            "without a reference: cpo, simpo, orpo (docs/guides/dpo.md)"
        },
    )
    loss_weights: tuple[float, ...] = field(
        default=(), metadata={"help": "one weight per loss of dpo.loss (TRL's loss_weights; empty: 1 each)"}
    )
    label_smoothing: float = field(
        default=0.0,
        metadata={
            "help": "the share of preference labels taken as flipped (sigmoid: conservative DPO; robust; exo_pair)"
        },
    )
    discopop_tau: float = field(default=0.05, metadata={"help": "discopop: the temperature of its blend"})
    cpo_alpha: float = field(
        default=1.0,
        metadata={"help": "cpo, simpo: the weight of the chosen reply's NLL (TRL's CPOConfig; SimPO as published: 0)"},
    )
    simpo_gamma: float = field(default=0.5, metadata={"help": "simpo: the target reward margin"})
    alpha: float = field(
        default=0.0,
        metadata={
            "help": "cpo, simpo: AlphaPO's reward shape, (1 - p^-alpha)/alpha of the reply's probability "
            "(0: its log-probability; AlphaPO: simpo with cpo_alpha 0)"
        },
    )
    reference: Literal["auto", "copy", "base", "precompute"] = field(
        default="auto", metadata={"help": "auto: base for lora/qlora/ia3, else copy"}
    )

    def __post_init__(self):
        super().__post_init__()
        for name in self.losses:
            require(name in LOSSES, "dpo.loss", f"one or more of {', '.join(LOSSES)}", self.loss)
        if len(self.losses) > 1:
            free = [n for n in self.losses if n in REFERENCE_FREE]
            require(not free, "dpo.loss", "DPO losses only when several are summed (not cpo, simpo, orpo)", self.loss)
        require(
            not self.loss_weights or len(self.loss_weights) == len(self.losses),
            "dpo.loss_weights",
            f"one weight per loss of dpo.loss ({len(self.losses)})",
            list(self.loss_weights),
        )
        require(self.beta > 0, "dpo.beta", "> 0", self.beta)
        require(0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", "in [0, 0.5)", self.label_smoothing)
        if "exo_pair" in self.losses:
            require(self.label_smoothing > 0, "dpo.label_smoothing", "> 0 for exo_pair (its log eps)", 0.0)
        require(self.discopop_tau > 0, "dpo.discopop_tau", "> 0", self.discopop_tau)
        require(self.cpo_alpha >= 0, "dpo.cpo_alpha", ">= 0", self.cpo_alpha)
        if self.alpha:
            require(self.loss in ("cpo", "simpo"), "dpo.alpha", "0 unless dpo.loss is cpo or simpo", self.alpha)

    @property
    def losses(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.loss.split(",") if n.strip())

    def weighted(self) -> list[tuple[str, float]]:
        """(loss, weight) for each loss dpo.loss sums."""
        return list(zip(self.losses, self.loss_weights or [1.0] * len(self.losses)))


def logps(model: nn.Module, batch: dict[str, Tensor], stats: dict[str, Tensor] | None = None) -> Tensor:
    """(2B,) each reply's summed log-probability of its trained tokens (the reply and its end token),
    the chosen first: from a row per pair (the prompt read once, reply_batches.PairBatches) or per reply.
    With `other_targets` (ORPO), (3B,): then the chosen sequences' other tokens (prompt, template).
    A `stats` dict receives TRL's DPO token metrics (token_metrics), from the same pass."""
    head = lm_head(model, hidden_states(model, batch))  # (rows, T, D)
    out, per_token = [], []
    for t in reply_targets(batch):
        if stats is None:
            out.append(sequence_logprobs(head.hidden, head.weight, t, head.softcap))
        else:
            token, st = token_logprobs(head.hidden, head.weight, t, head.softcap, stats=True)
            out.append(token.sum(1))
            per_token.append((t != IGNORE, st))
    if stats is not None:
        stats.update(token_metrics(per_token))
    if "other_targets" in batch:
        pairs = int(pair_count(batch))
        out.append(sequence_logprobs(head.hidden, head.weight, batch["other_targets"], head.softcap)[:pairs])
    return torch.cat(out)


def token_metrics(per_token: list[tuple[Tensor, TokenStats]]) -> dict[str, Tensor]:
    """TRL's DPO token metrics from each reply tensor's trained positions and their TokenStats (the
    chosen replies' tensor, then the rejected ones'; or one whose rows are the chosen then the rejected):
    the entropy over every trained token, the logits' mean over the chosen and the rejected replies'
    tokens, and the share of the chosen replies' tokens that are the model's argmax."""
    if len(per_token) == 1:  # a row per reply: the first half of the rows are the chosen replies
        ((mask, st),) = per_token
        per_token = [(m, TokenStats(*parts)) for m, *parts in zip(mask.chunk(2), *(x.chunk(2) for x in st))]
    (chosen, c), (rejected, r) = per_token
    mean = lambda x, m: (x * m).sum() / m.sum().clamp(min=1)  # noqa: E731
    return {
        "entropy": ((c.entropy * chosen).sum() + (r.entropy * rejected).sum())
        / (chosen.sum() + rejected.sum()).clamp(min=1),
        "logits/chosen": mean(c.mean_logit, chosen),
        "logits/rejected": mean(r.mean_logit, rejected),
        "mean_token_accuracy": mean(c.is_top1, chosen),
    }


def reply_targets(batch: dict[str, Tensor]) -> list[Tensor]:
    """The batch's targets (rows, T): the chosen replies' then the rejected ones' when a row holds a
    pair, else one tensor whose rows are the chosen replies then the rejected ones."""
    return [batch["targets"]] + ([batch["rejected_targets"]] if "rejected_targets" in batch else [])


def longest_rows(width: int):
    """The memory plan's batch of pair rows: as wide as the data's longest pair makes one (its prompt
    once, both replies), where a row per reply is planned at data.seq_len; the pairs are all in memory,
    so no batch can be wider."""
    from ..engine.memory import widened

    return lambda batch: widened(batch, width)


def reply_lengths(batch: dict[str, Tensor]) -> Tensor:
    """(2B,) each reply's trained tokens, the chosen first."""
    return torch.cat([(t != IGNORE).sum(1) for t in reply_targets(batch)])


def dpo_loss(policy: Tensor, reference: Tensor, lengths: Tensor, cfg: DPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """policy, reference, lengths (2B,): chosen rows first -> (mean loss, TRL's metrics)."""
    pc, pr = policy.chunk(2)
    qc, qr = reference.chunk(2)
    chosen, rejected = pc - qc, pr - qr  # log-ratios (B,)
    loss = sum(w * batch_loss(name, cfg, policy, reference, lengths) for name, w in cfg.weighted())
    rc, rr = cfg.beta * chosen.detach(), cfg.beta * rejected.detach()
    return loss, {
        "loss": loss.detach(),
        "rewards/chosen": rc.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/accuracies": (rc > rr).float().mean(),
        "rewards/margins": (rc - rr).mean(),
        "logps/chosen": pc.detach().mean(),
        "logps/rejected": pr.detach().mean(),
    }


def reference_free_loss(
    policy: Tensor, lengths: Tensor, cfg: DPOConfig, others: Tensor | None = None, other_counts: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """CPO, SimPO, AlphaPO (TRL's CPOTrainer) and ORPO (its ORPOTrainer), as TRL computes them from the
    policy alone: policy, lengths (2B,) summed log-probabilities and trained tokens, the chosen first; `others`,
    `other_counts` (B,) those of the chosen sequences' other tokens (ORPO's NLL reads the whole sequence).
    SimPO and ORPO average the log-probabilities over the reply's tokens; cpo sums them."""
    (sc, sr), (lc, lr) = policy.chunk(2), lengths.chunk(2)
    beta, eps = cfg.beta, cfg.label_smoothing
    pc, pr = (sc / lc.clamp(min=1), sr / lr.clamp(min=1)) if cfg.loss in ("simpo", "orpo") else (sc, sr)
    uc, ur = pc, pr  # the rewards' units: the log-probabilities, or AlphaPO's shape of them
    if cfg.loss == "orpo":  # the odds ratio of the chosen reply over the rejected one, on top of the NLL
        log_odds = (pc - pr) - (log1mexp(pc) - log1mexp(pr))
        ratio = F.logsigmoid(log_odds)
        nll = -(sc.sum() + others.sum()) / (lc.sum() + other_counts.sum()).clamp(min=1)
        loss = nll - beta * ratio.mean()
        extra = {"log_odds_ratio": ratio.detach().mean(), "log_odds_chosen": log_odds.detach().mean()}
    else:
        if cfg.alpha:  # AlphaPO (Gupta et al. 2025): the reward (1 - p^-alpha) / alpha, p = exp(log p)
            uc, ur = -torch.expm1(-cfg.alpha * pc) / cfg.alpha, -torch.expm1(-cfg.alpha * pr) / cfg.alpha
        h = uc - ur - (cfg.simpo_gamma / beta if cfg.loss == "simpo" else 0.0)
        per_pair = -F.logsigmoid(beta * h) * (1 - eps) - F.logsigmoid(-beta * h) * eps
        nll = -sc.sum() / lc.sum().clamp(min=1) if cfg.cpo_alpha else sc.new_zeros(())
        loss, extra = per_pair.mean() + cfg.cpo_alpha * nll, {}
    rc, rr = beta * uc.detach(), beta * ur.detach()
    return loss, {
        "loss": loss.detach(),
        "rewards/chosen": rc.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/accuracies": (rc > rr).float().mean(),
        "rewards/margins": (rc - rr).mean(),
        "logps/chosen": pc.detach().mean(),
        "logps/rejected": pr.detach().mean(),
        "nll_loss": nll.detach(),
        **extra,
    }


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (branching at -ln 2, as TRL does)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def batch_loss(name: str, cfg: DPOConfig, policy: Tensor, reference: Tensor, lengths: Tensor) -> Tensor:
    """One of dpo.loss's terms, a scalar, from the policy's and the reference's log-probabilities and
    the replies' trained tokens (2B, the chosen first): the mean of pair_loss; sft, the chosen replies'
    NLL per token; AOT's, which sorts the batch's margins."""
    (pc, pr), (qc, qr) = policy.chunk(2), reference.chunk(2)
    if name == "sft":
        return -pc.sum() / lengths.chunk(2)[0].sum().clamp(min=1)
    if name in ("aot", "aot_unpaired"):  # AOT (Melnyk et al.): the sorted margins, paired or not
        a, b = (pc - pr, qc - qr) if name == "aot" else (pc - qc, pr - qr)
        delta = torch.sort(a, dim=0).values - torch.sort(b, dim=0).values
        eps = cfg.label_smoothing
        return (-F.logsigmoid(cfg.beta * delta) * (1 - eps) - F.logsigmoid(-cfg.beta * delta) * eps).mean()
    return pair_loss(name, cfg, pc - qc, pr - qr, lengths).mean()


def pair_loss(name: str, cfg: DPOConfig, chosen: Tensor, rejected: Tensor, lengths: Tensor) -> Tensor:
    """(B,) each pair's loss `name` from its log-ratios log pi - log ref (chosen, rejected) and its
    replies' trained tokens (`lengths`, chosen first). Those that average over the reply's tokens
    (ipo, sigmoid_norm) do so as TRL does; the others read the summed log-ratios."""
    beta, eps = cfg.beta, cfg.label_smoothing
    h = beta * (chosen - rejected)
    if name in ("ipo", "sigmoid_norm"):
        lc, lr = lengths.chunk(2)
        d = chosen / lc.clamp(min=1) - rejected / lr.clamp(min=1)  # averaged over the reply's tokens
        return (d - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * d)
    if name == "sigmoid":  # with label smoothing: conservative DPO
        return -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
    if name == "hinge":
        return torch.relu(1 - h)
    if name == "robust":  # an unbiased estimate under eps flipped labels (Chowdhury et al.)
        return (-(1 - eps) * F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)
    if name == "exo_pair":  # EXO: KL from the model's pair distribution to [(1 - eps), eps]
        return torch.sigmoid(h) * (F.logsigmoid(h) - math.log1p(-eps)) + torch.sigmoid(-h) * (
            F.logsigmoid(-h) - math.log(eps)
        )
    rc, rr = beta * chosen, beta * rejected
    if name == "nca_pair":
        return -F.logsigmoid(rc) - 0.5 * F.logsigmoid(-rc) - 0.5 * F.logsigmoid(-rr)
    if name == "bco_pair":
        return -F.logsigmoid(rc) - F.logsigmoid(-rr)
    if name == "sppo_hard":  # SPPO with hard win probabilities: 1 for the chosen, 0 for the rejected
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    if name == "apo_zero":  # APO: raise the chosen, lower the rejected
        return 1 - torch.sigmoid(rc) + torch.sigmoid(rr)
    if name == "apo_down":  # APO: lower both, the rejected more
        return torch.sigmoid(rc) + 1 - torch.sigmoid(h)
    # discopop: logistic and exponential blended by sigmoid(h / tau) (Chris Lu et al.)
    blend = torch.sigmoid(h / cfg.discopop_tau)
    return -F.logsigmoid(h) * (1 - blend) + torch.exp(-h) * blend


def dpo_reference(recipe) -> str:
    """dpo.reference resolved; `none` for the losses that need no reference (cpo, simpo, orpo)."""
    return "none" if recipe.settings.loss in REFERENCE_FREE else reference_mode(recipe)


class Preference:
    """DPO's loss for the trainer: the policy's log-probabilities against the reference's, which come
    from the batch (precomputed), the model with adapters off (base), or the Job's frozen copy."""

    def __init__(self, cfg: DPOConfig, mode: str, frozen: dict):
        self.cfg, self.mode, self.frozen = cfg, mode, frozen

    def reference(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        if "ref_logps" in batch:
            return batch["ref_logps"]
        return reference_of(model, self.mode, self.frozen, lambda m: logps(m, batch))

    def __call__(self, model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]):
        lengths = reply_lengths(batch)
        if self.cfg.loss in REFERENCE_FREE:
            policy, pairs = logps(model, batch), len(lengths) // 2
            others = policy[2 * pairs :] if "other_targets" in batch else None
            counts = (batch["other_targets"][:pairs] != IGNORE).sum(1) if others is not None else None
            return reference_free_loss(policy[: 2 * pairs], lengths, self.cfg, others, counts)
        stats: dict[str, Tensor] = {}
        policy = logps(model, batch, stats)
        loss, metrics = dpo_loss(policy, self.reference(model, batch), lengths, self.cfg)
        return loss, {**metrics, **stats}


@torch.no_grad()
def precompute(model: nn.Module, pairs: list, pad: int, batch_size: int, device, share_prompt: bool = True) -> Tensor:
    """(N, 2) the reference's log-probabilities of every pair's chosen and rejected reply (zeros for a
    model on the meta device: a memory plan, which needs their count only)."""
    if any(p.is_meta for p in model.parameters()):
        return torch.zeros(len(pairs), 2)
    was, out = model.training, []
    model.to(device).eval()
    with phase("reference log-probabilities", -(-len(pairs) // batch_size), "batches") as advance:
        for batch in sequential_batches(PairBatches(pairs, pad, share_prompt=share_prompt), batch_size, 0):
            advance(1)
            out.append(torch.stack(logps(model, {k: v.to(device) for k, v in batch.items()}).chunk(2), dim=1).cpu())
    model.train(was)
    return torch.cat(out) if out else torch.zeros(0, 2)


class DPO(PairTask):
    key = "dpo"
    recipe_pattern = "dpo-{family}-mini"
    Config = DPOConfig
    describe = "DPO preference tuning"

    def frozen_copies(self, recipe) -> int:
        return int(dpo_reference(recipe) == "copy")

    def setup(self, recipe, backbone) -> Job:
        ft, cfg = recipe.finetune, recipe.settings
        self.check(recipe, backbone)
        mode = dpo_reference(recipe)
        splits = self.pairs(recipe, backbone)
        (train_split, train), *held_out = splits.items()
        self.usable(train_split, train)
        held_split, held = next(((s, p.pairs) for s, p in held_out if p.pairs), ("", []))
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        frozen = {"reference": starting_model(self.run_dir, recipe, backbone)} if mode == "copy" else {}
        refs, files = (
            self.reference_file(recipe, backbone, train.pairs, held, pad) if mode == "precompute" else ({}, {})
        )
        loss = Preference(cfg, mode, frozen)
        full = backbone.model.flops_per_token(int(np.mean([p.length for p in train.pairs[:500]])))
        extra = 2.0 if mode in ("copy", "base") else 0.0  # the reference's forward pass
        others = cfg.loss == "orpo"  # its NLL reads the chosen sequence's prompt too
        val = PairBatches(held, pad, refs.get("held_out"), cfg.share_prompt, others) if held else None
        self.held = (held_split, loss, val)  # what the final report measures against, as training did
        return Job(
            heads=nn.ModuleDict(),
            loss=loss,
            train=PairBatches(train.pairs, pad, refs.get("train"), cfg.share_prompt, others),
            val=val,
            flops_per_item=full * (training_flops_multiplier(ft.train) + extra) / 6.0,
            count_items=count_tokens,
            best_key="rewards/accuracies" if held else "",
            held_out=bool(held),
            examples=len(train.pairs),
            loss_weight=pair_count,
            frozen=frozen,
            files=files,
            plan_batch=longest_rows(max(shared_length(p) for p in train.pairs) - 1) if cfg.share_prompt else None,
        )

    def reference_file(self, recipe, backbone, train: list, held: list, pad: int) -> tuple[dict, dict]:
        """dpo.reference precompute: the log-probabilities the run directory holds (a resumed run), or
        one pass of the starting model over every pair, written there."""
        if self.run_dir is not None:  # a resumed run reads what it computed when it started
            path = Path(self.run_dir) / REFERENCE_FILE
            if path.is_file():
                saved = json.loads(path.read_text())
                if len(saved["train"]) == len(train) and len(saved["held_out"]) == len(held):
                    text = path.read_text()
                    return {k: torch.tensor(v, dtype=torch.float32).reshape(-1, 2) for k, v in saved.items()}, {
                        REFERENCE_FILE: text
                    }
        b, share = recipe.train.batch_size, recipe.settings.share_prompt
        refs = {
            "train": precompute(backbone.model, train, pad, b, self.rt.device, share),
            "held_out": precompute(backbone.model, held, pad, b, self.rt.device, share),
        }
        return refs, {REFERENCE_FILE: json.dumps({k: v.tolist() for k, v in refs.items()})}

    def report(self, recipe, run_dir: Path) -> dict[str, Any]:
        """The best checkpoint's metrics on all the held-out pairs, against the reference training used
        (its frozen copy, the base, or the precomputed log-probabilities): printed, and eval.json."""
        split, loss, val = self.held
        backbone = from_run(run_dir, device=str(self.rt.device))
        # imported here: every process would pay for the import at start
        from torch.distributed.tensor import DTensor

        if loss.mode == "copy" and any(isinstance(p, DTensor) for p in loss.frozen["reference"].parameters()):
            # an FSDP run's reference is sharded over processes that have finished: read it whole again
            reference = base_model(run_dir, recipe).to(self.rt.device).eval().requires_grad_(False)
            loss = Preference(loss.cfg, "copy", {"reference": reference})
        results = {split: measure(recipe, backbone.model, loss, val, split, self.rt.device)}
        self.say(results)
        self.write_report(run_dir, backbone.checkpoint, results)
        return results

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        """`tfcli eval dpo`: reward accuracy, margins and log-probabilities on the held-out pairs (the
        first --limit N of each split) against --reference (default: the run's own reference)."""
        results = self.score(recipe, backbone, options.data, options.reference, options.limit)
        self.write_evaluation(backbone, options, results, reference=options.reference)
        return results

    def score(
        self, recipe, backbone, data: str | None, reference: str | None, limit: int, say: bool = True
    ) -> dict[str, dict]:
        splits = self.pairs(recipe, backbone, data, need_train=False, say=say)
        held = {s: p.pairs[: limit or None] for s, p in self.held_out(splits).items()}
        loss, device = self.eval_reference(recipe, backbone, reference), next(backbone.model.parameters()).device
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        results = {}
        for split, pairs in held.items():
            cfg = recipe.settings
            pairs = PairBatches(pairs, pad, share_prompt=cfg.share_prompt, other_targets=cfg.loss == "orpo")
            results[split] = measure(recipe, backbone.model, loss, pairs, split, device)
        self.say(results)
        return results

    def say(self, results: dict[str, dict]) -> None:
        if self.quiet:
            return
        for split, m in results.items():
            console.print(
                f"dpo {split} ({m['n']} pairs): reward accuracy {100 * m['rewards/accuracies']:.2f}%, "
                f"margin {m['rewards/margins']:.4f}, rewards chosen {m['rewards/chosen']:.4f} / rejected "
                f"{m['rewards/rejected']:.4f}, logps chosen {m['logps/chosen']:.2f} / rejected "
                f"{m['logps/rejected']:.2f}, loss {m['loss']:.4f}"
            )

    def eval_reference(self, recipe, backbone, reference: str | None) -> Preference:
        """What an evaluation compares the model with: --reference, else the run's: its adapters off
        when it trained adapters, else the model it started from."""
        cfg = recipe.settings
        if cfg.loss in REFERENCE_FREE:
            return Preference(cfg, "none", {})
        if reference is None and adapters.method(recipe.finetune.train).switchable and backbone.recipe is not None:
            return Preference(cfg, "base", {})
        source = reference or recorded(backbone.run_dir).get("from")
        if not source:
            raise UserError("eval dpo: name the reference model (--reference MODEL)")
        device = next(backbone.model.parameters()).device
        return Preference(cfg, "copy", {"reference": for_inference(source, device=str(device)).model})


def measure(recipe, model: nn.Module, loss: Preference, pairs: PairBatches, split: str, device) -> dict[str, float]:
    """Loss and TRL's reward metrics of `model` against `loss`'s reference on every pair, in order."""
    batches = sequential_batches(pairs, recipe.train.batch_size, 0)
    with phase(f"scoring {split} pairs"):
        m = held_out_metrics(
            ObjectiveModule(model, nn.ModuleDict(), loss), batches, device, recipe.train.precision, pair_count
        )
    return {**m, "acc": m["rewards/accuracies"], "n": pairs.epoch_size(0)}
