"""Supervised finetuning (`tfcli finetune sft`): a decoder (GPT, llama) or an encoder-decoder (T5)
learns to write the replies of a user's own data, in the model's chat template.

    tfcli finetune sft --from MODEL --data rows.jsonl --prompt-field question --response-field answer
    tfcli finetune gsm8k --from MODEL --data gsm8k/        # the gsm8k preset: fields, splits, scoring
    tfcli eval sft --checkpoint RUN --data test.jsonl --limit 100

What is trained is the replies and the end-of-turn token that closes each (`sft.train_on`), found
by prefix differencing of the template's renderings (data/chat.py); the loss is the mean over every
trained token of the global batch (Job.loss_weight), with or without packing (tasks/reply_batches).
Each evaluation reports the held-out reply loss and perplexity; the final report and `tfcli eval
sft` also generate replies and score them (tasks/answers.py), writing predictions.jsonl.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from rich.table import Table
from rich.text import Text

from ..data.chat import ChatTemplate, stop_ids
from ..data.conversations import Examples, Fields, require_targets
from ..data.image_prompts import ImageExamples, ImagePrompts, folder_rows, readable
from ..data.labelled import row_splits
from ..data.sampler import sequential_batches
from ..display import console, counted, phase
from ..engine.backbone import from_run
from ..engine.evaluate import held_out_metrics
from ..engine.perf import training_flops_multiplier
from ..engine.trainer import ObjectiveModule
from ..errors import UserError
from ..models import kinds
from ..objectives.losses import with_perplexity
from ..plugin import EvalOptions, Job
from ..recipe import require
from . import answers
from .replies import ReplyConfig, ReplyTask, report_rows
from .reply_batches import count_tokens, reply_format


@dataclass(frozen=True)
class SFTConfig(ReplyConfig):
    """The `sft:` recipe section (a reply task's fields, and these). Fields left empty come from the
    preset, then the defaults."""

    preset: str = field(default="", metadata={"help": "gsm8k: GSM8K's fields, splits and scoring"})
    format: Literal["auto", "prompt", "messages", "text"] = field(
        default="auto", metadata={"help": "auto: by the fields each row has"}
    )
    response_field: str = field(
        default="", metadata={"help": 'the column holding the reply ("": the preset\'s, else completion)'}
    )
    text_field: str = field(default="text", metadata={"help": "the column holding plain text (every token trained)"})
    image_question: str = field(
        default="What is in this picture?",
        metadata={"help": "a vision-language model's rows from a folder of images: what each asks"},
    )
    train_on: Literal["assistant", "all", "last"] = field(
        default="assistant",
        metadata={
            "help": "which tokens are learned: assistant (every reply), all (every token), last (the last reply)"
        },
    )
    pack: bool = field(default=False, metadata={"help": "several examples per row, each attending only to itself"})
    metric: Literal["", "exact", "contains", "final-number"] = field(
        default="", metadata={"help": '"" = the preset\'s, else exact'}
    )
    max_new_tokens: int = field(default=256, metadata={"help": "generated replies (eval sft and the final report)"})
    temperature: float = field(default=0.0, metadata={"help": "0: greedy"})
    generate_limit: int = field(
        default=50, metadata={"help": "the final report generates replies for the first N held-out examples"}
    )
    generate_batch: int = field(
        default=32, metadata={"help": "replies generated together (decoding reads every weight once per step for all)"}
    )

    def __post_init__(self):
        super().__post_init__()
        require(self.max_new_tokens >= 1, "sft.max_new_tokens", ">= 1", self.max_new_tokens)
        require(self.temperature >= 0, "sft.temperature", ">= 0 (0: greedy)", self.temperature)
        require(self.generate_limit >= 0, "sft.generate_limit", ">= 0", self.generate_limit)
        require(self.generate_batch >= 1, "sft.generate_batch", ">= 1", self.generate_batch)


def fields(cfg: SFTConfig) -> Fields:
    p = cfg.reply_preset
    return Fields(
        prompt=cfg.prompt_column,
        response=cfg.response_field or (p.response_field if p else "completion"),
        messages=cfg.messages_field,
        text=cfg.text_field,
        system=cfg.system,
    )


def metric(cfg: SFTConfig) -> str:
    p = cfg.reply_preset
    return cfg.metric or (p.metric if p else "exact")


class SFT(ReplyTask):
    key = "sft"
    model_kinds = (kinds.DECODER, kinds.ENCODER_DECODER)
    recipe_pattern = "sft-{family}-mini"
    Config = SFTConfig
    describe = "supervised finetuning"
    eval_limit_hint = 50
    plain_text = False  # set by setup: every training row is plain text (every token trained)
    takes_images = True

    def text_columns(self, cfg: SFTConfig) -> tuple[str, ...]:
        f = fields(cfg)
        return (f.prompt, f.response, f.text)

    def check(self, recipe, backbone) -> None:
        """What SFT cannot do, refused before the data is read."""
        super().check(recipe, backbone)
        cfg = recipe.settings
        if reply_format(backbone.model).seq2seq and (cfg.pack or cfg.chat_template not in ("", "none")):
            raise UserError(
                f"a {backbone.family} reads the prompt with its encoder: sft.pack and sft.chat_template "
                f"are for decoders"
            )

    def builder(self, recipe, backbone, template: ChatTemplate | None, data: str | None = None):
        """The rows' builder for this model; a model that reads images gets rows with images (their
        paths relative to the data)."""
        cfg, length = recipe.settings, min(recipe.data.seq_len, backbone.cfg.max_seq_len)
        args = (backbone.tokenizer, template, cfg.train_on, length, fields(cfg), cfg.format)
        if kinds.reads_images(backbone.model):
            source = Path(data or recipe.data.source)
            prompts = ImagePrompts(backbone.cfg, backbone.tokenizer)
            return ImageExamples(*args, prompts=prompts, root=source if source.is_dir() else source.parent)
        return reply_format(backbone.model).builder(*args)

    def examples(
        self, recipe, backbone, data: str | None = None, need_train: bool = True, say: bool = True
    ) -> dict[str, Examples]:
        """Every split's examples (the training split first), each split's skipped rows named (say)."""
        build = self.builder(recipe, backbone, self.template(recipe, backbone), data)
        return self.read(
            recipe, build, data, need_train, say, raw=self.image_folder(recipe, backbone, data, need_train)
        )

    def image_folder(self, recipe, backbone, data: str | None, need_train: bool) -> dict | None:
        """A folder of images (class sub-folders, or a labels file) as rows asking sft.image_question, for
        a model that reads images; None for anything else. An evaluation scores every image of a folder
        without a test split."""
        folder = data or recipe.data.source
        if not kinds.reads_images(backbone.model) or not folder:
            return None
        rows = folder_rows(Path(folder), recipe.settings.image_question, backbone.cfg.image_token)
        if rows is None:
            return None
        if not need_train and len(rows) == 1:
            rows = {"train": [], "test": rows["train"]}
        return row_splits(rows, folder, "train", recipe.data.val_fraction, recipe.train.seed)

    def split_line(self, split: str, built, where: str, training: bool) -> str:
        """A split's line; a training run's says the share of its tokens that trains."""
        line = super().split_line(split, built, where, training)
        if not training:
            return line
        share = built.trained_tokens / max(1, built.tokens)
        return line + f"; {built.trained_tokens:,} of {built.tokens:,} tokens trained ({100 * share:.1f}%)"

    def setup(self, recipe, backbone) -> Job:
        self.check(recipe, backbone)
        template = self.template(recipe, backbone)
        backbone.tokenizer.chat_template = template.source if template is not None else None  # export keeps it
        splits = self.examples(recipe, backbone)
        (train_split, train), *held_out = splits.items()
        require_targets(train_split, train)
        self.plain_text = all(e.plain_text for e in train.examples)  # every token trained
        self.an_image = next((e.images[0].path for e in train.examples if getattr(e, "images", ())), None)
        if self.rt.is_main and not self.quiet:
            console.print(preview(backbone.tokenizer, train.examples[0]))
        pad = type(backbone.model).pad_id(backbone.tokenizer)
        source = self.source(recipe, backbone, train.examples, pad, for_training=True)
        val = next((self.source(recipe, backbone, e.examples, pad) for _, e in held_out if e.examples), None)
        replies = reply_format(backbone.model)
        return Job(
            heads=torch.nn.ModuleDict(),
            loss=replies.loss,
            train=source,
            val=val,
            flops_per_item=self.flops(recipe, backbone, train),
            count_items=count_tokens,
            held_out_metrics=with_perplexity,
            held_out=val is not None,
            examples=source.epoch_size(0),
            loss_weight=replies.loss_weight,
        )

    def source(self, recipe, backbone, examples: list, pad: int, for_training: bool = False):
        pack = min(recipe.data.seq_len, backbone.cfg.max_seq_len) if for_training and recipe.settings.pack else 0
        return reply_format(backbone.model).batches(examples, pad, pack, recipe.train.seed)

    def flops(self, recipe, backbone, train: Examples) -> float:
        """Training FLOPs per token at the mean example length (scaled for adapters)."""
        sample = train.examples[:500]
        full = backbone.model.flops_per_token(*reply_format(backbone.model).lengths(sample))
        return full * training_flops_multiplier(recipe.finetune.train) / 6.0

    def report(self, recipe, run_dir: Path) -> dict[str, Any]:
        """The reply loss of the run's best checkpoint on the first report_rows(recipe) examples of every
        held-out split, and replies generated for the first sft.generate_limit of those, scored:
        printed, and saved as eval.json and predictions.jsonl."""
        backbone = from_run(run_dir, device=str(self.rt.device))
        n = report_rows(recipe)
        results = self.score(
            recipe,
            backbone,
            None,
            n,
            min(recipe.settings.generate_limit, n),
            Path(run_dir) / "predictions.jsonl",
            say=False,
        )
        self.write_report(run_dir, backbone.checkpoint, results)
        return results

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        """`tfcli eval sft`: reply loss and generated replies on the held-out splits (--limit N: the first
        N examples of each), written beside the run (or --out) with predictions-<name>.jsonl."""
        if options.inputs or options.few_shot > 0 or options.cloze:
            raise UserError(
                "eval sft scores generated replies on a data split (--data FILE, --limit N); "
                "to answer one prompt use tfcli generate --chat"
            )
        out, predictions = self.evaluation_files(backbone, options, "predictions")
        results = self.score(recipe, backbone, options.data, options.limit or None, options.limit or None, predictions)
        out.write_text(json.dumps({"checkpoint": str(backbone.checkpoint), "data": options.data, **results}, indent=1))
        console.print(f"report: {out}\npredictions: {predictions}")
        return results

    def score(
        self,
        recipe,
        backbone,
        data: str | None,
        n_loss: int | None,
        n_generated: int | None,
        predictions: Path,
        say: bool = True,
    ) -> dict:
        """Per held-out split: the reply loss and perplexity of its first n_loss examples and the scores
        of replies generated for its first n_generated (None: all of them; 0: none)."""
        splits = self.examples(recipe, backbone, data, need_train=False, say=say)
        held_out = self.held_out(splits)
        cfg, model = recipe.settings, backbone.model.eval()
        pad = type(model).pad_id(backbone.tokenizer)
        loss, weight = reply_format(model).loss, reply_format(model).loss_weight
        results, lines = {}, []
        for split, e in held_out.items():
            scored = e.examples[:n_loss]
            batches = list(sequential_batches(self.source(recipe, backbone, scored, pad), recipe.train.batch_size, 0))
            with phase(f"reply loss on {split}", len(batches), "batches") as advance:
                metrics = held_out_metrics(
                    ObjectiveModule(model, torch.nn.ModuleDict(), loss),
                    counted(batches, advance),
                    next(model.parameters()).device,
                    recipe.train.precision,
                    weight,
                )
            generated = [x for x in e.examples if not x.plain_text][:n_generated]
            texts = (
                answers.generate(
                    model,
                    backbone.tokenizer,
                    [x.prompt for x in generated],
                    cfg.max_new_tokens,
                    cfg.temperature,
                    cfg.generate_batch,
                    stop_ids(backbone.tokenizer),
                    pad,
                    f"{split} replies",
                    images=[getattr(x, "images", ()) for x in generated],
                )
                if generated
                else []
            )
            results[split] = {
                **with_perplexity(metrics),
                "n": len(scored),
                "generated": len(texts),
                **(
                    {"metric": metric(cfg), **answers.scores(texts, [x.reply for x in generated], metric(cfg))}
                    if texts
                    else {}
                ),
            }
            lines += [
                {
                    "split": split,
                    "prompt": readable(backbone.tokenizer.decode(x.prompt, skip_special_tokens=False)),
                    "reference": x.reply,
                    "prediction": t,
                    "correct": answers.correct(t, x.reply, metric(cfg)),
                }
                for x, t in zip(generated, texts)
            ]
        predictions.write_text("".join(json.dumps(line) + "\n" for line in lines))
        if not self.quiet:
            console.print(results_table(results))
        return results

    def title(self, recipe, backbone) -> str:
        train_on = "all (plain text)" if self.plain_text else recipe.settings.train_on
        return f"sft ({recipe.settings.preset or 'own data'}, train_on {train_on}" + (
            ", packed)" if recipe.settings.pack else ")"
        )


def preview(tok, example, colour: bool | None = None) -> Text:
    """One example as the model reads it, the trained tokens highlighted; without colour (output piped
    to a file or a pager) they are marked [[between double brackets]]."""
    colour = console.color_system is not None if colour is None else colour
    marks = ("", "") if colour else ("[[", "]]")
    text = Text("one training example (")
    text.append("trained" if colour else "trained tokens [[between double brackets]]", style="bold green")
    text.append(" / not trained):\n" if colour else "):\n")
    if hasattr(example, "trained"):
        runs, start = [], 0
        flags = example.trained.tolist()
        for i in range(1, len(flags) + 1):
            if i == len(flags) or flags[i] != flags[start]:
                runs.append((example.ids[start:i].tolist(), flags[start]))
                start = i
    else:
        runs = [(example.source.tolist(), 0), (example.target.tolist(), 1)]
    for ids, trained in runs:
        piece = readable(tok.decode(ids, skip_special_tokens=False))
        text.append(
            (f"{marks[0]}{piece}{marks[1]}" if trained else piece) + ("" if hasattr(example, "trained") else "\n"),
            style="bold green" if trained else "dim",
        )
    return text


def results_table(results: dict[str, dict]) -> Table:
    table = Table(
        "split", "reply loss", "ppl", "scored", "generated", "metric", "replies right", title="sft evaluation"
    )
    for split, r in results.items():
        key = answers.SCORE_NAMES.get(r.get("metric", ""), "")
        acc = (
            f"{100 * r[key]:.2f}%"
            + (f" (strict {100 * r['strict_exact_match']:.2f}%)" if "strict_exact_match" in r else "")
            if key in r
            else "-"
        )
        table.add_row(
            split,
            f"{r.get('loss', float('nan')):.4f}",
            f"{r.get('ppl', float('nan')):.2f}",
            str(r["n"]),
            str(r["generated"]),
            r.get("metric", "-"),
            acc,
        )
    return table
