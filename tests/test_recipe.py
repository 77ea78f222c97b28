"""Recipes: every shipped one validates; mistakes are named by their dotted path."""

from __future__ import annotations

import pytest

from tfcli import recipe as recipes
from tfcli.recipe import RecipeError

from .conftest import tiny_gpt_recipe


@pytest.mark.parametrize("name", recipes.available())
def test_every_shipped_recipe_validates_and_pins_every_field(name):
    """Every hyperparameter is pinned in the file (or what it extends); a model's architecture
    switches (models/llama.py: SWITCHES) are its family's defaults unless the recipe changes one."""
    rec = recipes.load(name)
    raw = recipes.load_raw(name)  # the file with what it extends
    resolved = recipes.to_dict(rec)
    for section in ("model", "optim", "schedule", "train", rec.plugin, "finetune", "adapter"):
        if section in resolved:
            switches = set(getattr(type(rec.model), "SWITCHES", ())) if section == "model" else set()
            missing = set(resolved[section]) - set(raw.get(section, {})) - switches
            assert not missing, f"{name}: {section} does not pin {sorted(missing)}"


@pytest.mark.parametrize("name", recipes.available())
def test_a_recipe_names_an_architecture_switch_only_to_change_it(name):
    """A new switch touches no recipe (issue 71): none sets one to its default, so each switch a recipe
    names is what sets that model apart (moe-mini's experts, a Qwen3 q/k norm)."""
    import dataclasses

    from tfcli.models.llama import SWITCHES, LlamaConfig

    defaults = {f.name: f.default for f in dataclasses.fields(LlamaConfig) if f.name in SWITCHES}
    raw = recipes.load_raw(name)
    sections = [raw.get("model") or {}, (raw.get("model") or {}).get("text") or {}]
    for section in sections:
        for key in set(section) & set(SWITCHES):
            default = list(defaults[key]) if isinstance(defaults[key], tuple) else defaults[key]
            assert section[key] != default, f"{name}: model.{key} is set to its default {default!r}"


def test_the_plugin_key_is_validated_with_the_known_keys(tmp_path):
    with pytest.raises(
        RecipeError, match=r"^objective: unknown objective 'lm' \(known: clm, electra, igpt, mae, mlm, span\)"
    ):
        recipes.from_dict(tiny_gpt_recipe(tmp_path, objective="lm"))
    with pytest.raises(RecipeError, match="exactly one of `objective`"):
        recipes.from_dict({**tiny_gpt_recipe(tmp_path), "task": "classify"})


def test_a_plugin_section_belongs_only_to_recipes_of_that_plugin(tmp_path):
    with pytest.raises(RecipeError, match=r"^mlm: unknown key \(allowed: .*\)"):
        recipes.from_dict(tiny_gpt_recipe(tmp_path, mlm={"nsp": False}))
    with pytest.raises(RecipeError, match=r"^finetune: unknown key"):  # pretraining recipes have no finetune section
        recipes.from_dict(tiny_gpt_recipe(tmp_path, finetune={"epochs": 1}))
    rec = recipes.load("bert-mini", {"mlm.nsp": False})
    assert rec.settings.nsp is False and recipes.to_dict(rec)["mlm"]["nsp"] is False
    with pytest.raises(RecipeError, match=r"^mlm\.nsp: expected true or false"):
        recipes.load("bert-mini", {"mlm.nsp": "maybe"})


def test_recipes_are_immutable_and_replace_makes_a_new_one():
    import dataclasses

    rec = recipes.load("gpt-mini")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.train.steps = 3
    longer = recipes.replace(rec, train=recipes.replace(rec.train, steps=3))
    assert (rec.train.steps, longer.train.steps) == (400, 3)


def test_extends_starts_from_another_recipe(tmp_path):
    (tmp_path / "child.yaml").write_text("extends: mnli-bert-mini\noptim:\n  lr: 5.0e-5\n")
    child, base = recipes.load(str(tmp_path / "child.yaml")), recipes.load("mnli-bert-mini")
    assert child.name == "child" and child.optim.lr == 5e-5 and child.optim.betas == base.optim.betas
    assert child.settings.preset == "mnli" and child.finetune == base.finetune
    # a model of another family replaces the base's model section instead of merging into it
    assert recipes.load("classify-gpt-mini").model.family == "gpt"


def test_unknown_key_is_named_by_its_dotted_path(tmp_path):
    raw = tiny_gpt_recipe(tmp_path, optim={"lrr": 1.0})
    with pytest.raises(RecipeError, match=r"^optim\.lrr: unknown key"):
        recipes.from_dict(raw)


def test_unknown_model_key_names_the_family_section(tmp_path):
    raw = tiny_gpt_recipe(tmp_path, model={"n_layers": 3})
    with pytest.raises(RecipeError, match=r"^model\.n_layers: unknown key"):
        recipes.from_dict(raw)


@pytest.mark.parametrize(
    "section,key,value,expect",
    [
        ("train", "steps", "many", r"^train\.steps: expected an integer"),
        ("train", "steps", True, r"^train\.steps: expected an integer"),
        ("optim", "lr", "fast", r"^optim\.lr: expected a number"),
        ("optim", "betas", [0.9], r"^optim\.betas: expected a list of 2"),
        ("schedule", "decay", "exp", r"^schedule\.decay: 'exp' is not one of"),
        ("train", "precision", "fp8", r"^train\.precision: 'fp8' is not one of"),
        ("model", "family", "rnn", r"^model\.family: unknown family 'rnn'"),
    ],
)
def test_wrong_types_are_rejected_with_the_key(tmp_path, section, key, value, expect):
    raw = tiny_gpt_recipe(tmp_path, **{section: {key: value}})
    with pytest.raises(RecipeError, match=expect):
        recipes.from_dict(raw)


def test_yaml_exponent_strings_are_numbers(tmp_path):
    rec = recipes.from_dict(tiny_gpt_recipe(tmp_path, optim={"lr": "1e-3"}))
    assert rec.optim.lr == pytest.approx(1e-3)


def test_overrides_apply_and_are_validated(tmp_path):
    raw = tiny_gpt_recipe(tmp_path)
    rec = recipes.from_dict(
        raw,
        dict(
            [
                recipes.parse_override("optim.lr=3e-4"),
                recipes.parse_override("train.steps=7"),
                recipes.parse_override("optim.betas=[0.8, 0.9]"),
            ]
        ),
    )
    assert (rec.optim.lr, rec.train.steps, rec.optim.betas) == (3e-4, 7, (0.8, 0.9))
    with pytest.raises(RecipeError, match=r"^train\.stepz: unknown key"):
        recipes.from_dict(raw, {"train.stepz": 3})
    with pytest.raises(RecipeError, match="must look like key.path=value"):
        recipes.parse_override("optim.lr")


def test_on_and_off_are_words_not_yaml_booleans(tmp_path):
    """YAML 1.1 reads `off` as false: `train.compile: off` (file or --set) still means "off", and the
    saved config.yaml reads back the same; a boolean where no such word is allowed stays an error."""
    raw = tiny_gpt_recipe(tmp_path, train={"compile": False})
    assert recipes.from_dict(raw).train.compile == "off"
    rec = recipes.from_dict(tiny_gpt_recipe(tmp_path), dict([recipes.parse_override("train.compile=on")]))
    assert rec.train.compile == "on"
    recipes.save(rec, tmp_path / "config.yaml")
    assert recipes.load_resolved(tmp_path / "config.yaml").train.compile == "on"
    with pytest.raises(RecipeError, match=r"^train\.precision: True is not one of"):
        recipes.from_dict(tiny_gpt_recipe(tmp_path, train={"precision": True}))


def test_model_shape_errors_are_user_errors(tmp_path):
    with pytest.raises(RecipeError, match="divisible"):
        recipes.from_dict(tiny_gpt_recipe(tmp_path, model={"d_model": 30, "n_head": 4}))


def test_resolved_recipe_round_trips(tmp_path):
    rec = recipes.from_dict(tiny_gpt_recipe(tmp_path))
    recipes.save(rec, tmp_path / "config.yaml")
    assert recipes.load_resolved(tmp_path / "config.yaml") == rec


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(RecipeError, match="unknown recipe 'nope' .*gpt-mini"):
        recipes.load("nope")
