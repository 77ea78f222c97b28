"""MNLI: premise + hypothesis -> entailment / neutral / contradiction (GLUE order 0, 1, 2).

MNLI is a data config and a label set; training and evaluation are the generic
tasks.sequence_classification. Data: `--data DIR` holding GLUE TSV files (train.tsv,
dev_matched.tsv, dev_mismatched.tsv) or JSON Lines (train.jsonl, ...: premise, hypothesis,
label as a word or GLUE id), or, with no --data, glue/mnli from the Hugging Face hub.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from ..data.sources import load_hub_dataset
from ..errors import UserError
from . import sequence_classification as seqcls
from . import text_to_text
from .sequence_classification import PairTask, Rows

DEFAULT_RECIPE = "mnli-bert-mini"
LABELS = ("entailment", "neutral", "contradiction")
SPLITS = ("train", "dev_matched", "dev_mismatched")
HF_SPLITS = {"train": "train", "dev_matched": "validation_matched", "dev_mismatched": "validation_mismatched"}


def label_id(value) -> int:
    """'entailment' / 'neutral' / 'contradiction' or GLUE id 0/1/2 (also as text) -> id; -1 if unusable."""
    if isinstance(value, bool) or value is None:
        return -1
    if isinstance(value, (int, float)):
        return int(value) if int(value) in (0, 1, 2) and value == int(value) else -1
    text = str(value).strip().lower()
    if text in LABELS:
        return LABELS.index(text)
    return int(text) if text in ("0", "1", "2") else -1


def _row(premise, hypothesis, label) -> tuple[str, str, int] | None:
    lid = label_id(label)
    if not isinstance(premise, str) or not isinstance(hypothesis, str) or not premise.strip() \
            or not hypothesis.strip() or lid < 0:
        return None
    return premise, hypothesis, lid


def read_jsonl(path: Path) -> Rows:
    rows, skipped = [], 0
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{n}: not valid JSON") from None
        row = _row(obj.get("premise"), obj.get("hypothesis"), obj.get("label")) if isinstance(obj, dict) else None
        rows.append(row) if row else None
        skipped += row is None
    return Rows(rows, skipped)


def read_tsv(path: Path) -> Rows:
    """GLUE's MNLI TSV: columns sentence1, sentence2 and gold_label (or label); no quoting."""
    csv.field_size_limit(sys.maxsize)
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None) or []
        label_col = "gold_label" if "gold_label" in header else "label"
        for col in ("sentence1", "sentence2", label_col):
            if col not in header:
                raise UserError(f"{path}: no {col!r} column (a GLUE MNLI TSV has sentence1, sentence2, gold_label)")
        i1, i2, il = header.index("sentence1"), header.index("sentence2"), header.index(label_col)
        rows, skipped = [], 0
        for rec in reader:
            row = _row(rec[i1], rec[i2], rec[il]) if len(rec) > max(i1, i2, il) else None
            rows.append(row) if row else None
            skipped += row is None
    return Rows(rows, skipped)


def read_hub(split: str) -> Rows:
    ds = load_hub_dataset("glue", "mnli", HF_SPLITS[split], instead="pass --data DIR with train/dev_matched/"
                          "dev_mismatched as .tsv or .jsonl (e.g. ../shared/data/mnli)")
    rows = [_row(p, h, l) for p, h, l in zip(ds["premise"], ds["hypothesis"], ds["label"])]
    return Rows([r for r in rows if r], sum(r is None for r in rows))


def load_split(data: str, split: str) -> Rows:
    """One split's usable rows and the number skipped (label -1 or '-', missing fields)."""
    if not data:
        return read_hub(split)
    d = Path(data)
    if not d.is_dir():
        raise UserError(f"MNLI data directory not found: {data}")
    for suffix, reader in ((".tsv", read_tsv), (".jsonl", read_jsonl)):
        if (d / f"{split}{suffix}").is_file():
            return reader(d / f"{split}{suffix}")
    raise UserError(f"{data}: no {split}.tsv or {split}.jsonl (MNLI needs {', '.join(SPLITS)})")


TASK = PairTask(name="mnli", labels=LABELS, train_split="train", eval_splits=("dev_matched", "dev_mismatched"),
                load_split=load_split, best_key="dev_matched_acc")


def default_recipe(from_=None) -> str:
    """mnli-t5-mini / mnli-gpt-mini for text-to-text finetuning of a t5 / gpt run, else the BERT one.
    Generative finetuning wants its own settings: a BERT learning rate leaves a small T5 guessing."""
    family = text_to_text.generative_family(from_)
    return f"mnli-{family}-mini" if family else DEFAULT_RECIPE


def finetune(recipe, from_=None, out=None, quiet: bool = False) -> Path:
    """Finetune a BERT (tfcli run, Hugging Face directory, or fresh) on MNLI; a t5/gpt run text-to-text."""
    if text_to_text.is_generative_run(from_):
        return text_to_text.finetune(TASK, recipe, from_=from_, out=out, quiet=quiet)
    return seqcls.finetune(TASK, recipe, from_=from_, out=out, quiet=quiet)


def evaluate(checkpoint, options) -> None:
    """Accuracy and confusion matrices on matched and mismatched, or one pair's probabilities."""
    if options.few_shot >= 0 or text_to_text.is_generative_run(checkpoint):
        text_to_text.evaluate(TASK, checkpoint, options)  # label-word scoring, k-shot prompting
        return
    seqcls.evaluate(TASK, checkpoint, options)
