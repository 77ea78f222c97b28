"""Presets of the text-classification task: a named data source, its text fields and its label set.
`tfcli finetune mnli` is `tfcli finetune classify` with the `mnli` preset. A new preset is one entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..recipe import shipped_recipes


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
    recipe_pattern: str = ""  # its default recipe's name for a family: "mnli-{family}-mini"
    cloze_words: tuple[str, ...] = ()  # zero-shot cloze: one word per label, in id order

    @property
    def recipes(self) -> dict[str, str]:
        """family -> its shipped default recipe, for the families the preset's task trains."""
        from ..registry import plugin_class

        return shipped_recipes(self.recipe_pattern, plugin_class("task", self.task).families)


PRESETS = {
    "mnli": Preset(
        task="classify", text_fields=("premise", "hypothesis"), label_field="label",
        labels=("entailment", "neutral", "contradiction"), splits=("train", "dev_matched", "dev_mismatched"),
        hub=("nyu-mll/glue", "mnli"),
        hub_splits={"train": "train", "dev_matched": "validation_matched", "dev_mismatched": "validation_mismatched"},
        aliases={"premise": ("sentence1",), "hypothesis": ("sentence2",), "label": ("gold_label",)},
        recipe_pattern="mnli-{family}-mini",
        cloze_words=("yes", "maybe", "no")),
}
