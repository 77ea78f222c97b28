"""Text classification on a user's own labelled data, or a preset (`tfcli finetune mnli`).

    tfcli finetune classify --data reviews.csv --text-fields title,body --label-field label --from RUN

One or two text fields per row (a pair: BERT reads [CLS] a [SEP] b [SEP]) and a label, as a word or
an id. How the backbone reads them depends on its family: a BERT gets a classifier on pooled
features (tasks.heads); a T5 or GPT learns the label word as text (tasks.text_to_text), and an
un-finetuned one can be prompted with k solved examples (`tfcli eval mnli --few-shot K`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..adapters import method
from ..data.labelled import TextSpec, balanced_sample, load_splits
from ..data.sampler import sequential_batches
from ..display import console, phase
from ..engine.runtime import to_device
from ..errors import UserError, listing
from ..models import kinds
from ..models.bert import special_ids
from ..plugin import EvalOptions
from ..recipe import FinetuneConfig
from . import cloze, prompts
from .classification import ClassificationTask, Head, HeadSettings, TaskData, with_data
from .cloze import ClozeHead
from .heads import ClassifierHead, ExampleSource, check_pooling, resolve_pooling
from .presets import presets_of
from .text_to_text import T5_PROMPT_TOKENS, TextHead, fit_input


@dataclass(frozen=True)
class ClassifyConfig(HeadSettings):
    """The `classify:` recipe section: the head's settings, and the data's. Fields left empty come from
    the preset."""

    preset: str = field(default="", metadata={"help": 'e.g. "mnli": its data source, text fields and labels'})
    text_fields: tuple[str, ...] = field(
        default=(), metadata={"help": "the column(s) holding the text: one, or two for a pair (e.g. title,body)"}
    )
    label_field: str = field(
        default="", metadata={"help": 'the column holding the label ("": the preset\'s, else label)'}
    )
    labels: tuple[str, ...] = field(
        default=(), metadata={"help": "label names in id order (\"\" = the preset's, else the training data's, sorted)"}
    )
    cloze_template: str = field(
        default="",
        metadata={
            "help": 'zero-shot cloze (eval --cloze, BERT): the texts as {field}s around one [MASK]; "" = PET\'s pattern'
        },
    )
    cloze_words: tuple[str, ...] = field(
        default=(), metadata={"help": 'one word per label, in id order ("" = the preset\'s)'}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.preset and self.preset not in presets_of("classify"):
            raise ValueError(
                f"classify.preset: unknown preset {self.preset!r} (known: {', '.join(sorted(presets_of('classify')))})"
            )


def text_spec(cfg: ClassifyConfig) -> TextSpec:
    """Where the text and labels are: the recipe's fields over the preset's."""
    p = presets_of("classify").get(cfg.preset)
    fields = cfg.text_fields or (p.text_fields if p else ())
    if not fields:
        raise UserError("classify.text_fields: name the column(s) holding the text (--text-fields title,body)")
    if len(fields) > 2:
        raise UserError(f"classify.text_fields: one text or a pair, not {len(fields)} ({', '.join(fields)})")
    if p is None:
        return TextSpec("classify", fields, cfg.label_field or "label", cfg.labels)
    return TextSpec(
        cfg.preset,
        fields,
        cfg.label_field or p.label_field,
        cfg.labels or p.labels,
        p.splits,
        p.hub,
        p.hub_splits,
        p.aliases,
    )


def encode(tokenizer, rows: list, max_length: int) -> list[tuple[np.ndarray, int, int]]:
    """(texts, label) rows -> (ids of [CLS] a [SEP] (b [SEP]), length of "[CLS] a [SEP]", label),
    the longer text trimmed first until the row fits max_length."""
    ids = special_ids(tokenizer)
    encoded = [tokenizer.encode_batch([r[0][i] for r in rows]) for i in range(len(rows[0][0]))]
    out = []
    for k, (_, label) in enumerate(rows):
        parts = [list(e[k]) for e in encoded]  # one or two token lists
        while sum(map(len, parts)) > max_length - 1 - len(parts) - (ids["pair_sep"] - 1) * (len(parts) - 1):
            longest = max(range(len(parts)), key=lambda i: len(parts[i]))
            parts[longest].pop()
        seq = [ids["cls"], *parts[0], ids["sep"]]  # RoBERTa: <s> a </s></s> b </s>
        for p in parts[1:]:
            seq += [ids["sep"]] * (ids["pair_sep"] - 1) + [*p, ids["sep"]]
        out.append((np.array(seq, dtype=np.int64), len(parts[0]) + 2, label))
    return out


def reads_as(recipe, backbone) -> str:
    """classifier or text: classify.head, where auto is a classifier for a text encoder (BERT) and text
    for the models that generate (decoders, encoder-decoders)."""
    head = recipe.settings.head
    encoder = backbone.model.kind == kinds.TEXT_ENCODER
    if head == "auto":
        return "classifier" if encoder else "text"
    if head == "text" and encoder:
        raise UserError(
            f"a {backbone.family.upper()} cannot answer as text (a text encoder generates nothing); "
            f"--head classifier (or --cloze in eval for zero-shot)"
        )
    return head


def text_encoder(backbone, spec: TextSpec, max_length: int):
    """(encode rows, collate) for a decoder or encoder-decoder classifier: the task's text, right-padded
    with the family's pad; an encoder-decoder's input ends in end of text (T5's </s>) and its decoder
    starts from the pad."""
    tok, seq2seq = backbone.tokenizer, kinds.is_seq2seq(backbone.model)
    eos = [tok.eos_id] if seq2seq and tok.eos_id is not None else []
    pad = type(backbone.model).pad_id(tok)

    def encode_rows(rows: list) -> list:
        return [
            (
                np.array(
                    fit_input(
                        lambda t: tok.encode(prompts.input_text(spec.name, spec.text_fields, t)) + eos,
                        texts,
                        max_length,
                    ),
                    dtype=np.int64,
                ),
                0,
                y,
            )
            for texts, y in rows
        ]

    def batch(examples: list) -> dict[str, torch.Tensor]:
        out = collate(examples, pad)
        del out["token_type_ids"]
        if seq2seq:
            out["decoder_input_ids"] = torch.full((len(examples), 1), pad, dtype=torch.long)
        return out

    return encode_rows, batch


def collate(examples: list, pad_id: int) -> dict[str, torch.Tensor]:
    """Pad to the longest row of this batch only (dynamic padding)."""
    T = max(len(e[0]) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    types = torch.zeros((len(examples), T), dtype=torch.long)
    mask = torch.zeros((len(examples), T), dtype=torch.long)
    for i, (seq, n_a, _) in enumerate(examples):
        ids[i, : len(seq)] = torch.from_numpy(seq)
        types[i, n_a : len(seq)] = 1
        mask[i, : len(seq)] = 1
    return {
        "input_ids": ids,
        "token_type_ids": types,
        "attention_mask": mask,
        "labels": torch.tensor([e[2] for e in examples]),
    }


class Classify(ClassificationTask):
    key = "classify"
    model_kinds = (kinds.TEXT_ENCODER, kinds.DECODER, kinds.ENCODER_DECODER)
    recipe_pattern = "classify-{family}-mini"
    Config = ClassifyConfig
    describe = "text classification"

    def resolve(self, recipe, backbone):
        """`--train head` on a model that reads the task as text means a classifier on its frozen
        last-layer features (there is no head to train alone in text-to-text), with the family's pooling."""
        recipe = super().resolve(recipe, backbone)
        ft, cfg = recipe.finetune, recipe.settings
        if (
            ft is not None
            and not method(ft.train).backbone_trains
            and cfg.head == "auto"
            and reads_as(recipe, backbone) == "text"
        ):
            if self.rt.is_main and not self.quiet:
                console.print(
                    f"[yellow]note:[/] --train head on a {backbone.family}: a classifier on its frozen "
                    f"last-layer features (classify.head classifier, pooling {cfg.pooling})"
                )
            recipe = replace(recipe, settings=replace(cfg, head="classifier"))
        return recipe

    def tokenizer_texts(self, recipe) -> Iterator[str]:
        """A fresh model's tokenizer learns from the training rows' texts."""
        total = 0
        for texts, _ in self.load(recipe, None).train:
            if total >= recipe.tokenizer.train_chars:
                return
            total += sum(map(len, texts))
            yield from texts

    def load(
        self, recipe, backbone, data: str | None = None, labels: tuple[str, ...] = (), need_train: bool = True
    ) -> TaskData:
        spec = text_spec(recipe.settings)
        spec = replace(spec, labels=labels) if labels else spec
        d, ft = with_data(recipe, data).data, recipe.finetune or FinetuneConfig()
        key = (spec, d.source, d.val_source, d.val_fraction, need_train)
        if getattr(self, "_loaded_key", None) != key:
            with phase(f"reading {spec.name} data"):
                self._loaded = load_splits(spec, d.source, d.val_source, d.val_fraction, recipe.train.seed, need_train)
            self._loaded_key = key
        splits, labels = self._loaded
        for name, split in splits.items():
            if not split.rows and not (name == spec.splits[0] and not need_train):
                raise UserError(f"{split.where}: no usable rows ({split.skipped} skipped)")
            if self.rt.is_main and not self.quiet and backbone is not None and (split.rows or need_train):
                console.print(
                    f"{spec.name} {name}: {len(split.rows):,} rows, {split.skipped:,} skipped "
                    f"(missing text or no label) from {split.where}"
                )
        train = splits[spec.splits[0]].rows
        return TaskData(
            train[: ft.limit] if ft.limit > 0 else train,
            {s: v.rows for s, v in splits.items() if s != spec.splits[0]},
            labels,
        )

    def sample(self, rows: list, n: int, seed: int) -> list:
        return [rows[i] for i in balanced_sample(np.array([y for _, y in rows]), n, seed)]

    def check(self, recipe, backbone, options: EvalOptions | None = None) -> None:
        """--cloze on a BERT only, a text head on T5/GPT only, a pooling the family has, and nothing to
        train alone in text-to-text: each refused before the data is read."""
        if options is not None and options.cloze:
            self.cloze_family(backbone)
            return
        ft, cfg = recipe.finetune or FinetuneConfig(), recipe.settings
        if reads_as(recipe, backbone) == "classifier":
            check_pooling(backbone.cfg, resolve_pooling(backbone.family, cfg.pooling))
        elif not method(ft.train).backbone_trains or cfg.pooling != "auto" or cfg.head_lr:
            raise UserError(
                f"the {backbone.family} reads {text_spec(recipe.settings).name} as text (classify.head "
                f"text): there is no head to pool for or train alone; use --head classifier, or --train "
                f"all, lora, ia3 or bitfit"
            )

    @staticmethod
    def cloze_family(backbone) -> None:
        if backbone.model.kind != kinds.TEXT_ENCODER:
            raise UserError(
                f"--cloze reads a BERT's masked-LM head (a text encoder's); this is a {backbone.family} "
                f"(prompt it with --few-shot K instead)"
            )

    def head(self, recipe, backbone, data: TaskData, options: EvalOptions | None = None) -> Head:
        if options is not None and options.cloze:
            return self.cloze(recipe, backbone, data)
        return (
            self.classifier(recipe, backbone, data)
            if reads_as(recipe, backbone) == "classifier"
            else self.text_head(recipe, backbone, data, options)
        )

    def classifier(self, recipe, backbone, data: TaskData) -> ClassifierHead:
        """A linear classifier on pooled features, for any family: BERT reads [CLS] a [SEP] b [SEP], a
        GPT or T5 the task's text ("mnli premise: ... hypothesis: ...")."""
        cfg, tok, spec = backbone.cfg, backbone.tokenizer, text_spec(recipe.settings)
        max_length = min(recipe.data.seq_len, getattr(cfg, "context", getattr(cfg, "max_seq_len", recipe.data.seq_len)))
        if backbone.model.kind == kinds.TEXT_ENCODER:
            pad = special_ids(tok)["pad"]
            encode_rows, batch = (lambda rows: encode(tok, rows, max_length)), (lambda ex: collate(ex, pad))
        else:
            encode_rows, batch = text_encoder(backbone, spec, max_length)

        def make_source(rows: list, train: bool) -> ExampleSource:
            examples = encode_rows(rows)
            return ExampleSource(examples, batch, np.array([len(e[0]) for e in examples]))

        sample = encode_rows(data.train[:2000]) if data.train else []
        mean_len = float(np.mean([len(e[0]) for e in sample])) if sample else float(max_length)
        head = recipe.settings
        return ClassifierHead(
            cfg, head.pooling, len(data.labels), make_source, mean_len, dropout=cfg.dropout, layer=head.layer
        )

    def cloze(self, recipe, backbone, data: TaskData) -> ClozeHead:
        """Zero-shot: label words scored at the template's [MASK] by the BERT's MLM head."""
        self.cloze_family(backbone)
        settings, spec, tok = recipe.settings, text_spec(recipe.settings), backbone.tokenizer
        preset = presets_of("classify").get(settings.preset)
        words = settings.cloze_words or (preset.cloze_words if preset else ())
        if len(words) != len(data.labels):
            raise UserError(f"classify.cloze_words: give one word per label ({listing(data.labels)}), got {len(words)}")
        pieces = cloze.parse_template(
            settings.cloze_template or cloze.default_template(spec.text_fields), spec.text_fields
        )
        ids, max_length = special_ids(tok), min(recipe.data.seq_len, backbone.cfg.context)
        has_head = "mlm.bias" in backbone.heads and hasattr(backbone.model, "mlm_heads")
        mlm = backbone.model.mlm_heads() if has_head else None
        if mlm is None and not self.quiet:
            console.print(
                f"[yellow]note:[/] {backbone.source} has no masked-LM head; label words are scored by "
                f"the [MASK]'s hidden state against their embeddings (an untrained head)"
            )

        def make_source(rows: list, train: bool) -> ExampleSource:
            examples = cloze.encode(tok, ids, pieces, spec.text_fields, rows, max_length)
            return ExampleSource(examples, lambda ex: collate(ex, ids["pad"]), np.array([len(e[0]) for e in examples]))

        return ClozeHead(
            make_source,
            ids["mask"],
            cloze.word_ids(tok, words, cloze.mask_follows_space(pieces)),
            mlm,
            float(max_length),
        )

    def text_head(self, recipe, backbone, data: TaskData, options: EvalOptions | None) -> TextHead:
        """Text-to-text: the whole model learns the label word; un-finetuned runs are prompted k-shot."""
        spec = text_spec(recipe.settings)
        self.check(recipe, backbone)
        finetuned = backbone.recipe is not None and backbone.recipe.task == self.key
        k = options.few_shot if options is not None else -1
        if options is not None and k < 0 and not finetuned:
            raise UserError(
                f"{backbone.checkpoint} was not finetuned on {spec.name}; score it with --few-shot K "
                f"(K solved examples in the prompt, 0 for none)"
            )
        demos, max_length = [], recipe.data.seq_len
        seq2seq = kinds.is_seq2seq(backbone.model)
        if k >= 0:
            max_length = max(backbone.cfg.max_seq_len, T5_PROMPT_TOKENS if seq2seq else 0)
        if k > 0:
            shots = prompts.balanced_shots([y for _, y in data.train], k, len(data.labels), options.seed)
            demos = prompts.few_shot_prefix(spec.name, spec.text_fields, data.train, shots, data.labels)
        cue = backbone.model.kind == kinds.DECODER or (options is not None and not finetuned)
        return TextHead(
            backbone.model, backbone.tokenizer, spec.name, spec.text_fields, data.labels, max_length, cue, demos
        )

    def classify_one(self, recipe, backbone, options: EvalOptions) -> dict[str, float]:
        """The label probabilities of one input (e.g. --premise and --hypothesis)."""
        spec = text_spec(recipe.settings)
        if len(options.inputs) != len(spec.text_fields):
            raise UserError(
                f"{spec.name} reads {len(spec.text_fields)} text(s) ({', '.join(spec.text_fields)}); "
                f"got {len(options.inputs)}"
            )
        labels = backbone.labels or spec.labels
        if not labels:
            raise UserError(f"{backbone.checkpoint} does not record its labels")
        self.check(recipe, backbone, options)
        data = self.load(recipe, backbone, options.data) if options.few_shot > 0 else TaskData([], {}, labels)
        head = self.head(recipe, backbone, data, options)
        head.heads.load_state_dict({k: v for k, v in backbone.heads.items() if k.split(".")[0] in head.heads})
        batch = to_device(
            next(sequential_batches(head.source([(tuple(options.inputs), 0)], train=False), 1, seed=0)), self.rt.device
        )
        with torch.no_grad():
            probs = torch.softmax(head.scores(backbone.model.eval(), head.heads.to(self.rt.device), batch).float(), -1)[
                0
            ]
        for name, p in zip(labels, probs.tolist()):
            console.print(f"{name:>14}  {p:.4f}")
        return dict(zip(labels, probs.tolist()))

    def name(self, recipe) -> str:
        return text_spec(recipe.settings).name

    def title(self, recipe, backbone) -> str:
        how = "classifier" if reads_as(recipe, backbone) == "classifier" else "text-to-text"
        return f"{text_spec(recipe.settings).name} ({how})"
