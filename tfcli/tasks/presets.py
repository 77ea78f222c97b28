"""Presets of the text-classification task: a named data source, its text fields and its label set.
`tfcli finetune mnli` is `tfcli finetune classify` with the `mnli` preset. A new preset is one entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    task: str  # the task plug-in it presets
    text_fields: tuple[str, ...]
    label_field: str
    labels: tuple[str, ...]  # in id order (GLUE's for MNLI)
    splits: tuple[str, ...]  # training split first, then the evaluation splits
    hub: tuple[str, str]  # Hugging Face dataset and config, the default data
    hub_splits: dict[str, str] = field(default_factory=dict)  # our split name -> the hub's
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # field -> other names it has in files
    recipes: dict[str, str] = field(default_factory=dict)  # family -> default recipe
    cloze_words: tuple[str, ...] = ()  # zero-shot cloze: one word per label, in id order


PRESETS = {
    "mnli": Preset(
        task="classify", text_fields=("premise", "hypothesis"), label_field="label",
        labels=("entailment", "neutral", "contradiction"), splits=("train", "dev_matched", "dev_mismatched"),
        hub=("nyu-mll/glue", "mnli"),
        hub_splits={"train": "train", "dev_matched": "validation_matched", "dev_mismatched": "validation_mismatched"},
        aliases={"premise": ("sentence1",), "hypothesis": ("sentence2",), "label": ("gold_label",)},
        recipes={"bert": "mnli-bert-mini", "t5": "mnli-t5-mini", "gpt": "mnli-gpt-mini"},
        cloze_words=("yes", "maybe", "no")),
}
