"""KTO (`tfcli finetune kto`, Ethayarajh et al. 2024): a decoder learns from replies marked desirable
or undesirable one by one, with no pairs needed, relative to a frozen reference, as TRL's KTOTrainer.

    tfcli finetune kto --from MODEL --data rows.jsonl --train lora    # prompt, completion, label
    tfcli finetune kto --from MODEL --data pairs.jsonl                # DPO's pairs, each split in two
    tfcli eval kto --checkpoint RUN --data rows.jsonl

Rows are TRL's unpaired format (`prompt`, `completion` as text or messages, `label` true/false), or
pairs (`prompt`/`chosen`/`rejected`, HH dialogues) split into a desirable and an undesirable row, as
TRL's maybe_unpair_preference_dataset splits them. With r = log pi(y|x) - log ref(y|x) summed over
the reply and its end token, and z the batch's KL estimate, the mean over the batch of
`kto.desirable_weight` (1 - sigmoid(beta (r - z))) for desirable rows and `kto.undesirable_weight`
(1 - sigmoid(beta (z - r))) for the others. z is TRL's: each row's prompt with the previous row's
completion in the batch (the completions rotated by one, the first taking the last), mean
(log pi - log ref) of those mismatched pairs, at least 0, no gradient. A row and its mismatched pair
share a row of the batch (the prompt read once, as DPO's pairs do). `kto.loss=apo_zero_unpaired` is
APO's unpaired loss (no KL). The reference is DPO's: `copy` or, for adapters, `base`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from ..data.conversations import DecoderExamples, Example
from ..data.preferences import as_messages, reply_text, split_pair
from ..data.sampler import Draw, Source, sequential_batches
from ..display import console, note, phase
from ..engine.backbone import from_run
from ..engine.evaluate import held_out_metrics
from ..engine.perf import training_flops_multiplier
from ..engine.trainer import ObjectiveModule
from ..errors import UserError
from ..plugin import EvalOptions, Job
from ..recipe import require
from .dpo import logps
from .pairs import PairConfig, PairTask
from .reference import reference_mode, reference_of, starting_model
from .reply_batches import count_tokens, decoder_rows, shared_prompt_rows


@dataclass(frozen=True)
class KTOConfig(PairConfig):
    """The `kto:` recipe section (a pair task's fields, for rows given as pairs, and these)."""

    completion_field: str = field(default="completion", metadata={"help": "an unpaired row's reply column"})
    label_field: str = field(default="label", metadata={"help": "an unpaired row's column: true when desirable"})
    loss: Literal["kto", "apo_zero_unpaired"] = field(
        default="kto", metadata={"help": "kto (with the batch's KL estimate), or APO's unpaired loss"}
    )
    beta: float = field(default=0.1, metadata={"help": "how far the model may move from the reference (higher: less)"})
    desirable_weight: float = field(default=1.0, metadata={"help": "the weight of a desirable row's loss"})
    undesirable_weight: float = field(default=1.0, metadata={"help": "the weight of an undesirable row's loss"})
    reference: Literal["auto", "copy", "base"] = field(
        default="auto", metadata={"help": "auto: base for lora/qlora/ia3, else copy"}
    )

    def __post_init__(self):
        super().__post_init__()
        require(self.beta > 0, "kto.beta", "> 0", self.beta)
        require(self.desirable_weight > 0, "kto.desirable_weight", "> 0", self.desirable_weight)
        require(self.undesirable_weight > 0, "kto.undesirable_weight", "> 0", self.undesirable_weight)


@dataclass(frozen=True)
class Labelled:
    """A reply marked desirable or not, as a decoder example (its prompt, the reply and its end token)."""

    example: Example
    desirable: bool

    @property
    def length(self) -> int:
        return len(self.example.ids)

    @property
    def start(self) -> int:
        """Where the reply starts: its first trained token."""
        return int(np.flatnonzero(self.example.trained)[0])


@dataclass
class LabelledRows:
    rows: list[Labelled]
    skipped: Counter = field(default_factory=Counter)


class LabelledBuilder:
    """Rows -> labelled examples: an unpaired row as it is, a pair as its two replies."""

    def __init__(self, examples: DecoderExamples, cfg: KTOConfig):
        self.examples, self.cfg = examples, cfg

    def build_all(self, rows: list, places: list[str] | None = None) -> LabelledRows:
        out, skipped = [], Counter()
        for n, row in enumerate(rows):
            where = places[n] if places else f"row {n + 1}"
            for item in self.labelled(row, where) if isinstance(row, dict) else ["skip:not a row of fields"]:
                if isinstance(item, str):
                    skipped[item[len("skip:") :]] += 1
                else:
                    out.append(item)
        return LabelledRows(out, skipped)

    def labelled(self, row: dict, where: str) -> list:
        c = self.cfg
        if c.completion_field not in row and c.chosen_field in row and c.rejected_field in row:
            parsed = split_pair(row, c.pair_fields())
            if isinstance(parsed, str):
                return [parsed]
            messages, chosen, rejected = parsed
            return [self.one(messages, chosen, True), self.one(messages, rejected, False)]
        label = row.get(c.label_field)
        if not isinstance(label, bool):
            raise UserError(
                f"{where}: a KTO row needs {c.label_field!r} true or false (desirable or not), got {label!r}"
            )
        prompt, reply = row.get(c.prompt_column), reply_text(row.get(c.completion_field))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else as_messages(prompt)
        if messages is None or reply is None:
            return [f"skip:a {c.prompt_column!r} or {c.completion_field!r} that is neither text nor messages"]
        if c.system:
            messages = [{"role": "system", "content": c.system}] + messages
        return [self.one(messages, reply, label)]

    def one(self, messages: list[dict], reply: str, desirable: bool) -> Labelled | str:
        if not reply.strip():
            return "skip:empty reply"
        example = self.examples.within_length(self.examples.build(messages + [{"role": "assistant", "content": reply}]))
        return example if isinstance(example, str) else Labelled(example, desirable)


def mismatched(prompt_of: Labelled, reply_of: Labelled) -> Example:
    """One row's prompt with another row's reply (the KL estimate's pairs): its tokens trained as there."""
    a, b = prompt_of.example, reply_of.example
    ids = np.concatenate([a.ids[: prompt_of.start], b.ids[reply_of.start :]])
    trained = np.concatenate([np.zeros(prompt_of.start, dtype=a.trained.dtype), b.trained[reply_of.start :]])
    return Example(ids, trained, list(a.ids[: prompt_of.start]), b.reply)


@dataclass(frozen=True)
class _Pair:
    chosen: Example  # the row itself
    rejected: Example  # its prompt with the previous row's reply


class LabelledBatches(Source):
    """Labelled rows for the one Sampler: each with its mismatched pair (its prompt, the previous row's
    reply in the batch, the first row taking the last's), laid out as DPO lays out a pair (share_prompt:
    one row, the prompt once; else 2B rows), and `desirable` (B,)."""

    def __init__(self, rows: list[Labelled], pad_id: int, share_prompt: bool = True):
        self.rows, self.pad, self.share = rows, pad_id, share_prompt
        self.lengths = np.array([r.length for r in rows])

    def epoch_size(self, epoch: int) -> int:
        return len(self.rows)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        rows = [self.rows[i] for i in draw.indices]
        pairs = [_Pair(r.example, mismatched(r, rows[i - 1])) for i, r in enumerate(rows)]
        if self.share:
            out = shared_prompt_rows(pairs, self.pad)
        else:
            out = decoder_rows([[p.chosen] for p in pairs] + [[p.rejected] for p in pairs], self.pad)
        return {**out, "desirable": torch.tensor([r.desirable for r in rows])}


def row_count(batch: dict[str, Tensor]) -> Tensor:
    """A KTO batch's rows: what its loss averages over."""
    return torch.tensor(batch["desirable"].numel())


def kto_loss(policy: Tensor, reference: Tensor, desirable: Tensor, cfg: KTOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """policy, reference (2B,): the rows' log-probabilities, then their mismatched pairs' -> (loss,
    TRL's metrics). Rewards and log-probabilities are averaged over the rows of each kind (0 when a
    batch holds none of a kind)."""
    (pc, pk), (rc, rk) = policy.chunk(2), reference.chunk(2)
    beta, good = cfg.beta, desirable.bool()
    kl = (pk - rk).detach().mean().clamp(min=0) if cfg.loss == "kto" else pc.new_zeros(())
    ratio = pc - rc
    if cfg.loss == "kto":
        losses = torch.where(good, 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio)))
    else:  # APO's unpaired loss: raise the desirable, lower the rest
        losses = torch.where(good, 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio))
    weights = torch.where(good, cfg.desirable_weight, cfg.undesirable_weight)
    loss = (weights * losses).mean()
    rewards, n_good, n_bad = beta * ratio.detach(), good.sum().clamp(min=1), (~good).sum().clamp(min=1)
    chosen, rejected = rewards[good].sum() / n_good, rewards[~good].sum() / n_bad
    return loss, {
        "loss": loss.detach(),
        "kl": kl,
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "logps/chosen": pc.detach()[good].sum() / n_good,
        "logps/rejected": pc.detach()[~good].sum() / n_bad,
    }


def policy_logps(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """(2B,) the rows' log-probabilities, then their mismatched pairs' (the KL estimate's, which takes
    no gradient). A row per sequence: the mismatched pairs' rows are read without gradients, as TRL
    reads them. A row per pair: they share the row, its prompt read once (here a prompt read twice
    costs more than the backward pass over the mismatched reply's tokens: HH's prompts are 3 times
    its replies)."""
    if "shared_prompt" in batch:
        return logps(model, batch)
    half = batch["input_ids"].size(0) // 2
    with torch.no_grad():
        mismatched = logps(model, {key: batch[key][half:] for key in ("input_ids", "targets")})
    return torch.cat([logps(model, {key: batch[key][:half] for key in ("input_ids", "targets")}), mismatched])


class KTOLoss:
    """KTO's loss for the trainer: the policy's log-probabilities against the reference's."""

    def __init__(self, cfg: KTOConfig, mode: str, frozen: dict):
        self.cfg, self.mode, self.frozen = cfg, mode, frozen

    def __call__(self, model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]):
        reference = reference_of(model, self.mode, self.frozen, lambda m: logps(m, batch))
        return kto_loss(policy_logps(model, batch), reference, batch["desirable"], self.cfg)


class KTO(PairTask):
    key = "kto"
    noun = eval_noun = "rows"
    recipe_pattern = "kto-{family}-mini"
    Config = KTOConfig
    describe = "KTO (desirable / undesirable replies)"

    def labelled(self, recipe, backbone, data: str | None = None, need_train: bool = True, say: bool = True):
        length = min(recipe.data.seq_len, backbone.cfg.max_seq_len)
        examples = DecoderExamples(backbone.tokenizer, self.template(recipe, backbone), "last", length)
        return self.read(recipe, LabelledBuilder(examples, recipe.settings), data, need_train, say)

    @staticmethod
    def items(built: LabelledRows) -> list:
        return built.rows

    def text_columns(self, cfg: KTOConfig) -> tuple[str, ...]:
        return (cfg.prompt_column, cfg.completion_field, cfg.chosen_field, cfg.rejected_field)

    def frozen_copies(self, recipe) -> int:
        return int(reference_mode(recipe) == "copy")

    def setup(self, recipe, backbone) -> Job:
        ft, cfg = recipe.finetune, recipe.settings
        self.check(recipe, backbone)
        mode = reference_mode(recipe)
        (train_split, train), *held_out = self.labelled(recipe, backbone).items()
        rows = self.usable(train_split, train)
        check_classes(rows, cfg, train_split)
        if recipe.train.batch_size < 2 and cfg.loss == "kto":
            raise UserError(
                "kto needs --batch-size 2 or more: its KL estimate pairs each prompt with another row's reply"
            )
        held_split, held = next(((s, b.rows) for s, b in held_out if b.rows), ("", []))
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        frozen = {"reference": starting_model(self.run_dir, recipe, backbone)} if mode == "copy" else {}
        loss = KTOLoss(cfg, mode, frozen)
        val = LabelledBatches(held, pad, cfg.share_prompt) if held else None
        self.held = (held_split, loss, val)
        full = backbone.model.flops_per_token(int(np.mean([r.length for r in rows[:500]])))
        return Job(
            heads=nn.ModuleDict(),
            loss=loss,
            train=LabelledBatches(rows, pad, cfg.share_prompt),
            val=val,
            # a row and its mismatched pair, trained; both read again by the reference
            flops_per_item=full * (training_flops_multiplier(ft.train) + 2.0) / 6.0,
            count_items=count_tokens,
            best_key="rewards/margins" if held else "",
            held_out=bool(held),
            examples=len(rows),
            loss_weight=row_count,
            frozen=frozen,
        )

    def report(self, recipe, run_dir: Path) -> dict[str, Any]:
        split, loss, val = self.held
        backbone = from_run(run_dir, device=str(self.rt.device))
        results = {split: measure(recipe, backbone.model, loss, val, split, self.rt.device)}
        self.say(results)
        self.write_report(run_dir, backbone.checkpoint, results)
        return results

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        """`tfcli eval kto`: rewards, margins and the KL estimate on the held-out rows (the first
        --limit N of each split), against the run's reference (its adapters off, or its base model)."""
        from ..engine.backbone import for_inference, recorded

        splits = self.labelled(recipe, backbone, options.data, need_train=False, say=not options.quiet)
        mode = "base" if options.reference is None and self._switchable(recipe, backbone) else "copy"
        frozen = {}
        if mode == "copy":
            source = options.reference or recorded(backbone.run_dir).get("from")
            if not source:
                raise UserError("eval kto: name the reference model (--reference MODEL)")
            device = str(next(backbone.model.parameters()).device)
            frozen = {"reference": for_inference(source, device=device).model}
        loss, pad = KTOLoss(recipe.settings, mode, frozen), type(backbone.model).pad_id(backbone.tokenizer)
        device = next(backbone.model.parameters()).device
        results = {}
        for split, built in self.held_out(splits).items():
            batches = LabelledBatches(built.rows[: options.limit or None], pad, recipe.settings.share_prompt)
            results[split] = measure(recipe, backbone.model, loss, batches, split, device)
        self.say(results)
        self.write_evaluation(backbone, options, results)
        return results

    @staticmethod
    def _switchable(recipe, backbone) -> bool:
        from .. import adapters

        return adapters.method(recipe.finetune.train).switchable and backbone.recipe is not None

    def say(self, results: dict[str, dict]) -> None:
        if self.quiet:
            return
        for split, m in results.items():
            console.print(
                f"kto {split} ({m['n']} rows): margin {m['rewards/margins']:.4f}, rewards desirable "
                f"{m['rewards/chosen']:.4f} / undesirable {m['rewards/rejected']:.4f}, kl {m['kl']:.4f}, "
                f"loss {m['loss']:.4f}"
            )


def check_classes(rows: list[Labelled], cfg: KTOConfig, split: str) -> None:
    """Both kinds of row, or one line; a note where the weighted classes are out of TRL's advised
    balance (desirable_weight x desirable / undesirable_weight x undesirable in [1, 4/3])."""
    good = sum(r.desirable for r in rows)
    if good in (0, len(rows)):
        kind = "desirable" if good else "undesirable"
        raise UserError(f"kto {split}: every row is {kind}; KTO needs both kinds (label true and false)")
    balance = cfg.desirable_weight * good / (cfg.undesirable_weight * (len(rows) - good))
    if not 1.0 <= balance <= 4 / 3 + 1e-9:
        note(
            f"kto: desirable_weight x {good} desirable / undesirable_weight x {len(rows) - good} undesirable is "
            f"{balance:.2f}; KTO's authors advise 1 to 4/3 (set kto.desirable_weight or kto.undesirable_weight)"
        )


def measure(recipe, model: nn.Module, loss: KTOLoss, rows: LabelledBatches, split: str, device) -> dict[str, float]:
    batches = sequential_batches(rows, recipe.train.batch_size, 0)
    with phase(f"scoring {split} rows"):
        m = held_out_metrics(
            ObjectiveModule(model, nn.ModuleDict(), loss), batches, device, recipe.train.precision, row_count
        )
    return {**m, "n": rows.epoch_size(0)}
