"""Presets of tasks: a named data source and how to read it. `tfcli finetune mnli` is `tfcli finetune
classify` with the `mnli` preset (text fields and a label set); `tfcli finetune gsm8k` is `tfcli
finetune sft` with the `gsm8k` preset (prompt and reply fields, and how a generated reply is scored).
A new preset is one entry.
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
        return preset_recipes(self.task, self.recipe_pattern)


@dataclass(frozen=True)
class ReplyPreset:
    """A preset of supervised finetuning (tasks/sft.py): prompt/reply rows and their scoring."""

    task: str
    prompt_field: str
    response_field: str
    metric: str  # how a generated reply is scored: exact | contains | final-number
    splits: tuple[str, ...]  # training split first, then the held-out splits
    hub: tuple[str, str]
    hub_splits: dict[str, str] = field(default_factory=dict)
    recipe_pattern: str = ""  # "": the task's own recipes, with this preset set

    @property
    def recipes(self) -> dict[str, str]:
        return preset_recipes(self.task, self.recipe_pattern)


def preset_recipes(task: str, pattern: str) -> dict[str, str]:
    """family -> a preset's shipped default recipe, for the families its task trains (the task's own
    recipes where the preset ships none)."""
    from ..registry import plugin_class

    families = plugin_class("task", task).families
    return shipped_recipes(pattern, families) if pattern else plugin_class("task", task).recipes


PRESETS = {
    "mnli": Preset(
        task="classify",
        text_fields=("premise", "hypothesis"),
        label_field="label",
        labels=("entailment", "neutral", "contradiction"),
        splits=("train", "dev_matched", "dev_mismatched"),
        hub=("nyu-mll/glue", "mnli"),
        hub_splits={"train": "train", "dev_matched": "validation_matched", "dev_mismatched": "validation_mismatched"},
        aliases={"premise": ("sentence1",), "hypothesis": ("sentence2",), "label": ("gold_label",)},
        recipe_pattern="mnli-{family}-mini",
        cloze_words=("yes", "maybe", "no"),
    ),
    "gsm8k": ReplyPreset(
        task="sft",
        prompt_field="question",
        response_field="answer",
        metric="final-number",
        splits=("train", "test"),
        hub=("openai/gsm8k", "main"),
    ),
}


def presets_of(task: str) -> dict:
    """The presets of one task, by name."""
    return {name: p for name, p in PRESETS.items() if p.task == task}


def task_target(name: str) -> tuple[str, dict, dict]:
    """(task key, its recipe-section overrides, default recipes by family) for a task or a preset."""
    from ..errors import UserError
    from ..registry import TASKS, plugin_class

    if name in PRESETS:
        p = PRESETS[name]
        return p.task, {"preset": name}, p.recipes
    if name not in TASKS:
        raise UserError(f"unknown task {name!r} (known: {', '.join(sorted([*TASKS, *PRESETS]))})")
    return name, {}, plugin_class("task", name).recipes
