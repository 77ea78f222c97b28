"""The base of the tasks that train a model's replies (sft, dpo, grpo), as classification.py is the
classifiers': their shared recipe fields (ReplyConfig), reading every split through a task's own
builder with one line per split, the chat template, a fresh tokenizer's texts, the refusal of a head
to train alone, an evaluation's file names, the final report's file and the hints. A task adds what it
builds from a row (examples, pairs, prompts), its loss and its metrics."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..adapters import method
from ..data.chat import ChatTemplate
from ..data.labelled import TextSpec, raw_splits
from ..display import console, phase
from ..errors import UserError
from ..plugin import EvalOptions, Plugin
from ..recipe import require
from .presets import PRESETS, ReplyPreset
from .reply_batches import reply_format

REPORT_FLOOR = 32  # the fewest held-out examples a proportionate final report scores


@dataclass(frozen=True)
class ReplyConfig:
    """The fields every reply task's recipe section has (sft:, dpo:, grpo: extend it)."""

    preset: str = field(default="", metadata={"help": "gsm8k: GSM8K's fields and splits (and its scoring)"})
    prompt_field: str = field(
        default="", metadata={"help": 'the column holding the prompt ("": the preset\'s, else prompt)'}
    )
    messages_field: str = field(
        default="messages", metadata={"help": "the column holding a conversation (a list of role/content messages)"}
    )
    system: str = field(default="", metadata={"help": "a system message before every prompt"})
    chat_template: str = field(
        default="",
        metadata={
            "help": 'a chat template tfcli ships (chatml, llama-3-instruct, ...), a .jinja file, or none ("": the '
            "model's own, none when it has none)",
            "path": "path",
        },
    )

    presets: ClassVar[bool] = True  # whether `preset` may name a reply preset (DPO's pairs have none)

    def __post_init__(self):
        known = [n for n, p in PRESETS.items() if isinstance(p, ReplyPreset)] if self.presets else []
        require(
            not self.preset or self.preset in known, "preset", f"one of {', '.join(known) or '(none)'}", self.preset
        )

    @property
    def reply_preset(self) -> ReplyPreset | None:
        return PRESETS.get(self.preset) if self.preset else None

    @property
    def prompt_column(self) -> str:
        """The column holding the prompt: the recipe's, else the preset's, else prompt."""
        p = self.reply_preset
        return self.prompt_field or (p.prompt_field if p else "prompt")


def template_for(name: str, backbone) -> ChatTemplate | None:
    """The template examples are rendered in: `name` (a shipped template or a file), else the model's
    own, else none (name "none", a model without one, an encoder-decoder)."""
    tok = backbone.tokenizer
    if reply_format(backbone.model).seq2seq or name == "none":
        return None
    if name:
        return ChatTemplate.load(name)
    return ChatTemplate(tok.chat_template, "the model's chat template") if tok.chat_template else None


def summary_line(label: str, count: int, noun: str, skipped, where: str) -> str:
    """'<label>: N <noun> from <where>, K rows skipped (k1 reason1, ...)'."""
    total = sum(skipped.values())
    why = "" if not total else " (" + ", ".join(f"{n:,} {reason}" for reason, n in skipped.most_common()) + ")"
    return f"{label}: {count:,} {noun} from {where}, {total:,} rows skipped{why}"


def report_rows(recipe) -> int:
    """How many held-out examples the final report scores: finetune.report_limit (or eval_limit), else
    as many as the run trained on (steps x batch x accumulation), at least REPORT_FLOOR: a two-step
    smoke run is not held up by thousands of generations."""
    t = recipe.train
    return recipe.finetune.report_size or max(REPORT_FLOOR, t.steps * t.batch_size * t.grad_accum)


class ReplyTask(Plugin):
    """A task that trains a model's replies: what sft, dpo and grpo do alike."""

    kind = "task"
    noun: ClassVar[str] = "examples"  # what a split holds, for its line: examples, pairs, prompts
    eval_noun: ClassVar[str] = "questions"  # what an evaluation's split holds, for its line
    eval_limit_hint: ClassVar[int] = 0  # the evaluation hint's --limit (0: none)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held: Any = None  # what setup keeps for the final report (the held-out split and its scoring)

    @classmethod
    def data_spec(cls, cfg: ReplyConfig) -> TextSpec:
        """Where the splits are: the preset's (GSM8K: train and test), else train and a held-out dev."""
        p = cfg.reply_preset
        if p is None:
            return TextSpec(cls.key, ())
        return TextSpec(cfg.preset, (), splits=p.splits, hub=p.hub, hub_splits=p.hub_splits)

    def text_columns(self, cfg: ReplyConfig) -> tuple[str, ...]:
        """The row columns a fresh model's tokenizer learns from, besides conversations."""
        return (cfg.prompt_column,)

    def tokenizer_texts(self, recipe) -> Iterator[str]:
        """A fresh model's tokenizer learns from the training rows' texts and conversations."""
        cfg, d = recipe.settings, recipe.data
        rows = next(
            iter(raw_splits(self.data_spec(cfg), d.source, d.val_source, d.val_fraction, recipe.train.seed).values())
        )[0]
        columns = self.text_columns(cfg)
        for row in rows:
            yield from (row[k] for k in columns if isinstance(row.get(k), str))
            yield from (
                m["content"]
                for m in row.get(cfg.messages_field) or []
                if isinstance(m, dict) and isinstance(m.get("content"), str)
            )

    def check(self, recipe, backbone) -> None:
        """A reply task trains the model itself: there is no head to train alone."""
        if not method(recipe.finetune.train).backbone_trains:
            raise UserError(
                f"{self.key} trains the model's replies: there is no classifier head to train alone "
                f"(--train all, lora, qlora, ia3 or bitfit)"
            )

    def template(self, recipe, backbone) -> ChatTemplate | None:
        return template_for(recipe.settings.chat_template, backbone)

    def read(
        self, recipe, build, data: str | None = None, need_train: bool = True, say: bool = True, raw: dict | None = None
    ) -> dict:
        """Every split's rows (the recipe's data, or `data`; or `raw`, splits already made as raw_splits
        makes them) through `build` (.build_all), the training split first: its first finetune.limit
        rows, or none for an evaluation, whose --data FILE is evaluated whole. One line a split (say):
        what it holds, and the rows skipped and why."""
        d, ft = recipe.data, recipe.finetune
        held_out_file = data if data and not need_train and Path(data).is_file() else ""
        spec = self.data_spec(recipe.settings)
        with phase(f"reading {spec.name} data"):
            raw = raw or raw_splits(
                spec,
                data or d.source,
                held_out_file or ("" if data else d.val_source),
                d.val_fraction,
                recipe.train.seed,
                need_train,
            )
        say = say and self.rt.is_main and not self.quiet
        out = {}
        for i, (split, (rows, unreadable, where, numbers)) in enumerate(raw.items()):
            rows = rows[: ft.limit] if i == 0 and ft.limit > 0 else [] if i == 0 and not need_train else rows
            out[split] = build.build_all(rows, [f"{where}: row {n}" for n in numbers[: len(rows)]])
            out[split].skipped.update({"unreadable line": unreadable} if unreadable else {})
            if say and (rows or need_train):
                console.print(self.split_line(split, out[split], where, need_train))
        return out

    def split_line(self, split: str, built, where: str, training: bool) -> str:
        """The line a split of the data gets: what it holds (an evaluation's: questions)."""
        return summary_line(
            f"{self.key} {split}",
            len(self.items(built)),
            self.noun if training else self.eval_noun,
            built.skipped,
            where,
        )

    @staticmethod
    def items(built) -> list:
        """What a split's builder made (examples, pairs or prompts)."""
        return built.examples

    def usable(self, split: str, built) -> list:
        """The training split's items, or one line saying why there are none."""
        items = self.items(built)
        if not items:
            reasons = ", ".join(f"{n} {why}" for why, n in built.skipped.most_common(3)) or "no rows"
            raise UserError(f"{self.key} {split}: no usable {self.noun} ({reasons})")
        return items

    def held_out(self, splits: dict) -> dict:
        """The held-out splits that hold anything (what each split's builder made), or one line when
        none does."""
        held = {s: built for i, (s, built) in enumerate(splits.items()) if i > 0 and self.items(built)}
        if not held:
            raise UserError(
                f"{self.key}: no held-out {self.noun} to evaluate on (give --data with a dev or test split)"
            )
        return held

    def evaluation_files(self, backbone, options: EvalOptions, detail: str = "") -> tuple[Path, Path | None]:
        """Where `tfcli eval <task>` writes: --out, else eval-<task>[-<data>][-limit<N>].json beside the
        run (the working directory for a model that is not a run), and the file of each question's
        answer beside it (`detail`: predictions, samples; none without)."""
        run = backbone.run_dir or Path(".")
        name = (
            f"eval-{self.key}"
            + (f"-{Path(options.data).stem}" if options.data else "")
            + (f"-limit{options.limit}" if options.limit else "")
        )
        out = options.report_path(run / f"{name}.json")
        if not detail:
            return out, None
        stem = out.stem.replace("eval-", f"{detail}-", 1) if out.stem.startswith("eval-") else f"{out.stem}-{detail}"
        return out, out.with_name(f"{stem}.jsonl")

    def write_evaluation(self, backbone, options: EvalOptions, results: dict, **extra) -> None:
        """`tfcli eval <task>`'s report: the checkpoint, the data, `extra`, each split's results."""
        out, _ = self.evaluation_files(backbone, options)
        report = {"checkpoint": str(backbone.checkpoint), "data": options.data, **extra, **results}
        out.write_text(json.dumps(report, indent=1))
        console.print(f"report: {out}")

    @staticmethod
    def write_report(run_dir: Path, checkpoint, results: dict) -> None:
        """The final report of the run's best checkpoint: eval.json."""
        (Path(run_dir) / "eval.json").write_text(json.dumps({"checkpoint": str(checkpoint), **results}, indent=1))

    an_image = None  # a training image, for a vision-language model's chat hint (set by the task's setup)

    def hints(self, run_dir) -> list[str]:
        limit = f" --limit {self.eval_limit_hint}" if self.eval_limit_hint else ""
        image = f" --image {shlex.quote(str(self.an_image))}" if self.an_image else ""
        return [
            f"evaluate it:  tfcli eval --checkpoint {run_dir}{limit}",
            f"chat with it: tfcli chat --checkpoint {run_dir}{image}",
            f"export it:    tfcli export --checkpoint {run_dir} --hf {Path(run_dir).name}-hf",
        ]
