"""Reward models (`tfcli finetune rm`): a decoder with a scalar head learns to score the reply people
preferred above the one they did not, from the same pairs DPO reads (fields, templates, HH dialogues).

    tfcli finetune rm --from MODEL --data pairs.jsonl --train lora
    tfcli eval rm --checkpoint RUN --data pairs.jsonl
    tfcli export --checkpoint RUN --hf DIR         # AutoModelForSequenceClassification, one label
    tfcli finetune grpo ... --reward rm:RUN        # its score as a GRPO reward

As TRL's RewardTrainer: the reward r is `score` (a linear layer without a bias, as transformers'
*ForSequenceClassification) on the last token's hidden state of the whole rendered conversation; the
loss is Bradley-Terry, -log sigmoid(r_chosen - r_rejected - margin) (margin: the row's `margin`
column where it has one, else 0), plus rm.center_rewards_coefficient * mean((r_chosen + r_rejected)^2)
(Eisenstein et al.'s centring). Metrics are named as TRL names them: accuracy, margin, min_reward,
mean_reward, max_reward. A row per pair reads the prompt once (rm.share_prompt), as DPO's rows do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.sampler import sequential_batches
from ..display import console, phase
from ..engine.backbone import from_run
from ..engine.evaluate import held_out_metrics
from ..engine.perf import training_flops_multiplier
from ..engine.trainer import ObjectiveModule
from ..errors import UserError
from ..plugin import EvalOptions, Job
from ..recipe import require
from .pairs import PairConfig, PairTask
from .reply_batches import RewardBatches, count_tokens, hidden_states, last_token_rows, pair_count

SCORE = "score"  # the head's name: heads.score.weight in a checkpoint, score.weight in an export


@dataclass(frozen=True)
class RewardConfig(PairConfig):
    """The `rm:` recipe section (a pair task's fields, and these)."""

    margin_field: str = field(
        default="margin", metadata={"help": "the column of how much better the chosen reply is, where a row has it"}
    )
    center_rewards_coefficient: float = field(
        default=0.0, metadata={"help": "pulls rewards towards zero: coefficient x mean((r_chosen + r_rejected)^2)"}
    )

    def __post_init__(self):
        super().__post_init__()
        require(
            self.center_rewards_coefficient >= 0,
            "rm.center_rewards_coefficient",
            ">= 0",
            self.center_rewards_coefficient,
        )

    def pair_fields(self):
        from dataclasses import replace

        return replace(super().pair_fields(), margin=self.margin_field)


def score_head(d_model: int, weights: dict[str, Tensor] | None = None) -> nn.Linear:
    """The scalar head: a run's own weights when it has them (continuing a reward model), else
    normal(0, 0.02), as transformers initialises *ForSequenceClassification's `score`."""
    head = nn.Linear(d_model, 1, bias=False)
    saved = (weights or {}).get(f"{SCORE}.weight")
    with torch.no_grad():
        if saved is not None and tuple(saved.shape) == (1, d_model):
            head.weight.copy_(saved)
        else:
            nn.init.normal_(head.weight, std=0.02)
    return head


def rewards(model: nn.Module, head: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """(2B,) every sequence's reward, the chosen first: the head on its last token's hidden state."""
    last = hidden_states(model, batch)[batch["score_row"], batch["score_at"]]  # (2B, D)
    return head(last.to(head.weight.dtype)).squeeze(-1).float()


def reward_loss(scores: Tensor, margin: Tensor | None, cfg: RewardConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """scores (2B,), the chosen first -> (Bradley-Terry loss, TRL's metrics)."""
    chosen, rejected = scores.chunk(2)
    diff = chosen - rejected
    loss = -F.logsigmoid(diff - margin if margin is not None else diff).mean()
    if cfg.center_rewards_coefficient:
        loss = loss + cfg.center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    s = scores.detach()
    return loss, {
        "loss": loss.detach(),
        "accuracy": (chosen > rejected).float().mean(),
        "margin": diff.detach().mean(),
        "min_reward": s.min(),
        "mean_reward": s.mean(),
        "max_reward": s.max(),
    }


class BradleyTerry:
    """The reward model's loss for the trainer: (model, heads, batch) -> (loss, metrics)."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg

    def __call__(self, model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]):
        return reward_loss(rewards(model, heads[SCORE], batch), batch.get("margin"), self.cfg)


class RewardModel(PairTask):
    key = "rm"
    recipe_pattern = "rm-{family}-mini"
    Config = RewardConfig
    describe = "reward model (Bradley-Terry)"

    def check(self, recipe, backbone) -> None:
        """Every method trains: --train head trains the score head alone on the frozen model's features."""

    def setup(self, recipe, backbone) -> Job:
        ft, cfg = recipe.finetune, recipe.settings
        splits = self.pairs(recipe, backbone)
        (train_split, train), *held_out = splits.items()
        self.usable(train_split, train)
        held_split, held = next(((s, p.pairs) for s, p in held_out if p.pairs), ("", []))
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        heads = nn.ModuleDict({SCORE: score_head(backbone.cfg.d_model, backbone.heads)})
        loss = BradleyTerry(cfg)
        val = RewardBatches(held, pad, cfg.share_prompt) if held else None
        self.held = (held_split, val)
        full = backbone.model.flops_per_token(int(np.mean([p.length for p in train.pairs[:500]])))
        return Job(
            heads=heads,
            loss=loss,
            train=RewardBatches(train.pairs, pad, cfg.share_prompt),
            val=val,
            flops_per_item=full * training_flops_multiplier(ft.train) / 6.0,
            count_items=count_tokens,
            best_key="accuracy" if held else "",
            held_out=bool(held),
            examples=len(train.pairs),
            loss_weight=pair_count,
        )

    def report(self, recipe, run_dir: Path) -> dict[str, Any]:
        """The best checkpoint's pairwise accuracy and rewards on every held-out pair: printed, and eval.json."""
        split, val = self.held
        backbone = from_run(run_dir, device=str(self.rt.device))
        results = {split: measure(recipe, backbone, val, split, self.rt.device)}
        self.say(results)
        self.write_report(run_dir, backbone.checkpoint, results)
        return results

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        """`tfcli eval rm`: pairwise accuracy, margin and rewards on the held-out pairs (the first
        --limit N of each split)."""
        require_reward_model(backbone)
        splits = self.pairs(recipe, backbone, options.data, need_train=False, say=not options.quiet)
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        device = next(backbone.model.parameters()).device
        results = {}
        for split, pairs in self.held_out(splits).items():
            batches = RewardBatches(pairs.pairs[: options.limit or None], pad, recipe.settings.share_prompt)
            results[split] = measure(recipe, backbone, batches, split, device)
        self.say(results)
        self.write_evaluation(backbone, options, results)
        return results

    def say(self, results: dict[str, dict]) -> None:
        if self.quiet:
            return
        for split, m in results.items():
            console.print(
                f"rm {split} ({m['n']} pairs): accuracy {100 * m['accuracy']:.2f}%, margin {m['margin']:.4f}, "
                f"rewards mean {m['mean_reward']:.4f} (min {m['min_reward']:.4f}, max {m['max_reward']:.4f}), "
                f"loss {m['loss']:.4f}"
            )

    def hints(self, run_dir) -> list[str]:
        return [
            f"evaluate it:  tfcli eval --checkpoint {run_dir}",
            f"export it:    tfcli export --checkpoint {run_dir} --hf {Path(run_dir).name}-hf",
        ]


def require_reward_model(backbone) -> None:
    if f"{SCORE}.weight" not in backbone.heads:
        raise UserError(f"{backbone.source}: not a reward model (no {SCORE} head; train one with tfcli finetune rm)")


def measure(recipe, backbone, pairs: RewardBatches, split: str, device) -> dict[str, float]:
    """Loss and TRL's reward metrics of a reward model on every pair, in order."""
    head = nn.ModuleDict({SCORE: score_head(backbone.cfg.d_model, backbone.heads)}).to(device)
    module = ObjectiveModule(backbone.model, head, BradleyTerry(recipe.settings))
    with phase(f"scoring {split} pairs"):
        m = held_out_metrics(
            module, sequential_batches(pairs, recipe.train.batch_size, 0), device, recipe.train.precision, pair_count
        )
    return {**m, "acc": m["accuracy"], "n": pairs.epoch_size(0)}


class RunReward:
    """A reward model run as an on-policy reward (`--reward rm:RUN`): each completion, after its prompt,
    rendered as the reward model was trained (its template, or the base format) and scored at its
    last token, as TRL scores with a reward model (decoded, then tokenized by the reward model's own
    tokenizer). The run is read as data: its weights and config, no code. A conversation longer than
    the reward model reads keeps its last tokens."""

    batch = 16  # conversations scored together

    def __init__(self, path: str):
        from ..data.conversations import DecoderExamples
        from ..engine.runtime import pick_device
        from .replies import template_for

        device = pick_device("auto")
        try:
            backbone = from_run(Path(path), device=str(device))
            require_reward_model(backbone)
        except UserError as e:
            raise UserError(f"--reward rm:{path}: {e}") from None
        self.model, self.device = backbone.model.eval().requires_grad_(False), device
        self.head = score_head(backbone.cfg.d_model, backbone.heads).to(device).requires_grad_(False)
        template = template_for(backbone.recipe.settings.chat_template, backbone)
        self.examples = DecoderExamples(backbone.tokenizer, template, "last", 1 << 30)
        self.length, self.pad = backbone.cfg.max_seq_len, type(backbone.model).pad_id(backbone.tokenizer)
        self.where = path

    def ids(self, prompt, reply: str) -> np.ndarray:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        example = self.examples.build(messages + [{"role": "assistant", "content": reply}])
        if isinstance(example, str):
            raise UserError(f"reward rm:{self.where}: it cannot read this conversation ({example[5:]})")
        return example.ids[-self.length :]

    @torch.no_grad()
    def __call__(self, prompts: list, texts: list[str]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(texts), self.batch):
            sequences = [self.ids(p, t) for p, t in zip(prompts[start : start + self.batch], texts[start:])]
            batch = {k: v.to(self.device) for k, v in last_token_rows(sequences, self.pad).items()}
            out += rewards(self.model, self.head, batch).tolist()
        return out
