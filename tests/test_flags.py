"""The shortcut flags of pretrain and finetune are derived from the recipe's fields (commands/flags.py):
each names a real field, parses as its type, carries the field's comment as its help, and reaches the
field; a task's own flag is refused on another task."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from tfcli import recipe as recipes
from tfcli import registry
from tfcli.commands import flags
from tfcli.commands.training import finetune, pretrain

from .conftest import invoke


def _dataclass(section: str):
    if section in flags.RECIPE_SECTIONS:
        return getattr(recipes, flags.RECIPE_SECTIONS[section])
    return registry.plugin_class("task", section).Config


@pytest.mark.parametrize("command", [pretrain, finetune], ids=["pretrain", "finetune"])
def test_every_shortcut_flag_is_a_recipe_field_of_its_type(command):
    assert command.recipe_flags
    for path in command.recipe_flags.values():
        section, field = path.split(".")
        hints = typing.get_type_hints(_dataclass(section))
        assert field in {f.name for f in dataclasses.fields(_dataclass(section))}, path
        expected = hints[field] if hints[field] in (int, float, bool) else str
        assert flags.field(path).python_type is expected, path


def test_a_flags_help_is_its_fields_comment():
    result = invoke("finetune", "--help")
    text = " ".join(result.output.split())
    for path in finetune.recipe_flags.values():
        f = flags.field(path)
        if path not in ("data.source", "train.steps"):  # the command's own words lead those
            assert " ".join(f.comment.split())[1:30] in text, path
        section, name = path.split(".")
        shared = section in registry.TASKS and len(flags.tasks_with(name)) > 1  # the chosen task's field
        assert f"the recipe's {f'<task>.{name}' if shared else path}" in text, path


def test_a_flag_reaches_its_field_and_a_tasks_flag_belongs_to_that_task(tmp_path):
    result = invoke("finetune", "classify", "--pack", "--data", "x.csv")
    assert result.exit_code == 2 and "--pack is an option of finetune sft (this is classify)" in result.output
    result = invoke("finetune", "sft", "--text-fields", "a", "--data", "x.jsonl")
    assert result.exit_code == 2 and "--text-fields is an option of finetune classify (this is sft)" in result.output
    result = invoke("finetune", "mnli", "--layer", "-5", "--out", tmp_path / "r")
    assert result.exit_code == 2 and "classify.layer" in result.output and not (tmp_path / "r").exists()


def test_an_unknown_field_is_refused_when_the_command_is_built():
    with pytest.raises(KeyError, match="train.nope"):
        flags.recipe_flags("train.nope", after="x")(lambda x=None, shortcuts=None: None)


def test_every_option_of_every_command_has_help():
    """Walks the typer app: every option and argument of every command says what it is."""
    import typer.main

    from tfcli.cli import app

    def commands(group, prefix=""):
        for name, command in getattr(group, "commands", {}).items():
            yield from (
                commands(command, f"{prefix}{name} ") if hasattr(command, "commands") else [(prefix + name, command)]
            )

    missing = [
        f"{name}: {param.name}"
        for name, command in commands(typer.main.get_command(app))
        for param in command.params
        if not (getattr(param, "help", "") or "").strip() and param.name not in ("help",)
    ]
    assert not missing, missing


@pytest.mark.parametrize("task", ["sft", "dpo", "grpo"])
def test_shared_task_flags_bind_to_the_chosen_tasks_config(task, tmp_path):
    """--chat-template, --prompt-field and --system set the chosen task's own field (dpo.chat_template
    was refused as 'an option of finetune sft')."""
    result = invoke(
        "finetune", task, "--chat-template", "chatml", "--prompt-field", "question", "--system", "Be brief.",
        "--data", tmp_path / "none.jsonl", "--dry-run",
    )  # fmt: skip
    assert "is an option of" not in result.output, result.output
    assert "none.jsonl" in result.output  # it got as far as reading the data
    refused = invoke("finetune", "dpo", "--pack", "--data", tmp_path / "none.jsonl")
    assert refused.exit_code == 2 and "--pack is an option of finetune sft (this is dpo)" in refused.output
