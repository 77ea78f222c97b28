"""The seams hold: no import cycles, every registered plug-in is what its registry key says, short
functions in the driver and the trainer, and `tfcli eval --checkpoint` works on every kind of run."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import yaml

from tfcli import recipe as recipes
from tfcli import registry
from tfcli.models import FAMILIES
from tfcli.tasks.presets import PRESETS

from .conftest import REPO, invoke, mae_overrides, pretrained_run, set_args, tiny_bert_recipe, tiny_npz

PACKAGE = REPO / "tfcli"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    """tfcli module -> the tfcli modules it imports, at module level or inside functions (not those
    only a type checker reads, under `if TYPE_CHECKING:`)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        tree = ast.parse(path.read_text())
        checking = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in checking:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def test_no_import_cycles():
    graph, state, stack = import_graph(), {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.parametrize(
    "kind,key", [("objective", k) for k in registry.OBJECTIVES] + [("task", k) for k in registry.TASKS]
)
def test_every_registered_plugin_is_what_its_key_says(kind, key):
    cls = registry.plugin_class(kind, key)
    assert (cls.key, cls.kind) == (key, kind)
    assert cls.families and set(cls.families) <= set(FAMILIES)
    for family, name in cls.recipes.items():
        rec = recipes.load(name)
        assert rec.plugin == key and rec.model.family == family, name
        assert family in cls.families


def test_every_recipe_names_a_registered_plugin_and_presets_have_their_recipes():
    for name in recipes.available():
        raw = recipes.load_raw(name)
        assert (raw.get("objective") in registry.OBJECTIVES) != (raw.get("task") in registry.TASKS), name
    for preset in PRESETS.values():
        for family, name in preset.recipes.items():
            rec = recipes.load(name)  # a preset's own recipe sets it; else the task's, with the preset given
            assert rec.task == preset.task and rec.model.family == family
            assert rec.settings.preset or not preset.recipe_pattern


@pytest.mark.parametrize("module", ["driver.py", "engine/trainer.py"])
def test_driver_and_trainer_functions_are_short(module):
    tree = ast.parse((PACKAGE / module).read_text())
    long = [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 50
    ]
    assert not long, long


def _run(kind: str, tmp: Path, text: Path, mnli: Path) -> Path:
    """A two-step run of each kind the tool makes."""
    if kind in ("clm", "span"):
        model = (
            {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "max_seq_len": 64}
            if kind == "clm"
            else {"family": "t5", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 64}
        )
        return pretrained_run(tmp, text, kind, model)
    if kind in ("mlm", "electra"):
        (tmp / "r.yaml").write_text(
            yaml.safe_dump(tiny_bert_recipe(text, kind, train={"steps": 2, "eval_interval": 2, "ckpt_interval": 2}))
        )
        args = ["pretrain", "--recipe", tmp / "r.yaml"]
    elif kind == "mae":
        args = [
            "pretrain",
            "--objective",
            "mae",
            *set_args(mae_overrides(tiny_npz(tmp / "x.npz"), **{"train.steps": 2})),
        ]
    elif kind == "image-classify":
        args = [
            "finetune",
            "image-classify",
            "--data",
            tiny_npz(tmp / "x.npz"),
            "--steps",
            2,
            *set_args({k: v for k, v in mae_overrides(tmp).items() if k.startswith("model.")}),
        ]
    else:  # text classification of a GPT (text-to-text) or a BERT (classifier)
        base = _run("clm" if kind == "classify-gpt" else "mlm", tmp / "base", text, mnli)
        args = [
            "finetune",
            "mnli",
            "--from",
            base,
            "--data",
            mnli,
            "--steps",
            2,
            "--batch-size",
            4,
            "--set",
            "finetune.eval_limit=6",
        ]
    result = invoke(*args, "--out", tmp / kind, "--quiet")
    assert result.exit_code == 0, result.output
    return tmp / kind


@pytest.mark.parametrize(
    "kind", ["clm", "span", "mlm", "electra", "mae", "image-classify", "classify-gpt", "classify-bert"]
)
def test_eval_works_on_every_kind_of_run(kind, tmp_path, small_text, mnli_dir):
    (tmp_path / "base").mkdir()
    run = _run(kind, tmp_path, small_text, mnli_dir)
    result = invoke("eval", "--checkpoint", run, *(["--limit", 6] if kind.startswith(("classify", "image")) else []))
    assert result.exit_code == 0, result.output
    assert ("accuracy" if kind.startswith(("classify", "image")) else "loss") in result.output


def test_no_upward_imports_and_no_calls_of_other_modules_private_functions():
    """data/ sits below objectives/ and tasks/ (IGNORE lives in data); the runtime and the trainer find
    blocks through models.transformer_blocks, not models.blocks; no module calls another's _private."""
    import re

    for path in (PACKAGE / "data").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"from \.\.(objectives|tasks|engine|commands|driver)\b", text), path
    for module in ("engine/runtime.py", "engine/trainer.py"):
        assert "models.blocks" not in (PACKAGE / module).read_text(), module
    modules = {p.stem for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        for name, private in re.findall(r"(?<![\w.])(\w+)\.(_[a-z]\w*)\(", path.read_text()):
            assert name not in modules, f"{path.relative_to(PACKAGE)} calls {name}.{private}"


ROOMS = {  # room -> the rooms and root modules it must not import (each rule a layer boundary)
    "engine": ("tfcli.tasks", "tfcli.objectives", "tfcli.commands", "tfcli.driver", "tfcli.cli"),
    "data": ("tfcli.engine", "tfcli.tasks", "tfcli.objectives", "tfcli.commands", "tfcli.driver", "tfcli.cli"),
    "models": (
        "tfcli.engine",
        "tfcli.data",
        "tfcli.tasks",
        "tfcli.objectives",
        "tfcli.commands",
        "tfcli.hf",
        "tfcli.driver",
        "tfcli.cli",
    ),
    "tasks": ("tfcli.commands", "tfcli.driver", "tfcli.cli"),
    "objectives": ("tfcli.tasks", "tfcli.commands", "tfcli.driver", "tfcli.cli"),
    "hf": ("tfcli.tasks", "tfcli.objectives", "tfcli.commands", "tfcli.driver", "tfcli.cli"),
    "bench": ("tfcli.tasks", "tfcli.commands", "tfcli.driver", "tfcli.cli"),
}


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_each_room_imports_only_the_layers_below_it(room):
    """The floor plan: models at the bottom, data and hf beside it, the engine that runs a job above them,
    objectives and tasks (plug-ins) above the engine, the driver and the commands on top."""
    graph = import_graph()
    wrong = [
        (module, target)
        for module, targets in graph.items()
        if module.startswith(f"tfcli.{room}")
        for target in targets
        if target.startswith(ROOMS[room])
    ]
    assert not wrong, wrong


def test_the_root_package_keeps_only_the_contract():
    """The root holds the entry point and the contract (driver, plugin, registry, recipe, errors, ...);
    everything else lives in a room."""
    assert len(list(PACKAGE.glob("*.py"))) <= 12, sorted(p.name for p in PACKAGE.glob("*.py"))
    for init in PACKAGE.rglob("__init__.py"):
        assert not [n for n in ast.parse(init.read_text()).body if isinstance(n, ast.ClassDef)], init


def test_code_outside_models_and_hf_asks_a_models_kind_never_its_family_name():
    """No `family ==` / `family in (...)` tests and no quoted family names outside models/ and hf/: tasks,
    generation, the CLI and the trainer ask the kind (models.kinds), so a new family touches two files."""
    import re

    names = "|".join(FAMILIES)
    forbidden = [
        re.compile(r"family\s*(==|!=)"),
        re.compile(r"family\s+(not\s+)?in\s*[(\[{]"),
        re.compile(rf"""["']({names})["']"""),
    ]
    offenders = lines_matching(forbidden, skip=lambda path: path.parent.name in ("models", "hf"))
    assert not offenders, "\n".join(offenders)


def lines_matching(patterns: list, skip) -> list[str]:
    """'file:line: text' of every line of tfcli/ that a pattern finds, in the files `skip` does not skip."""
    return [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if not skip(path)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(p.search(line) for p in patterns)
    ]


def test_every_family_declares_what_its_kind_promises():
    """Each family's model class names a kind, its special tokens, its poolings (and a pad rule if it
    reads text), and implements the kind's protocol."""
    from tfcli.models import kinds

    small = dict(
        n_layer=1,
        d_model=32,
        n_head=2,
        d_ff=64,
        vocab_size=32,
        decoder_d_model=32,
        decoder_n_head=2,
        decoder_d_ff=64,
        decoder_n_layer=1,
    )
    generic = {  # the generic families are built from a transformers config (here a tiny StableLM, a DistilBERT)
        "generic": '{"model_type": "stablelm", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, '
        '"num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32}',
        "generic-encoder": '{"model_type": "distilbert", "dim": 32, "hidden_dim": 64, "n_layers": 1, "n_heads": 2, '
        '"vocab_size": 32}',
    }
    from tfcli.models.llama import LlamaConfig
    from tfcli.models.vit import ViTConfig

    composed = {  # a vision-language model is built from a tower's and a decoder's configs
        "vlm": {
            "vision": ViTConfig(**{k: v for k, v in small.items() if k in ViTConfig.__dataclass_fields__}),
            "text": LlamaConfig(**{k: v for k, v in small.items() if k in LlamaConfig.__dataclass_fields__}),
        }
    }
    for family, (config, cls) in FAMILIES.items():
        assert cls.kind in kinds.KINDS and cls.poolings, family
        assert cls.kind == kinds.VISION_ENCODER or (cls.special_tokens and callable(cls.pad_id)), family
        fields = {k: v for k, v in small.items() if k in config.__dataclass_fields__} | composed.get(family, {})
        model = cls(config(**fields, **({"hf_config": generic[family]} if family in generic else {})))
        assert isinstance(model, kinds.PROTOCOLS[cls.kind]), family


def test_tasks_import_no_objective():
    """A task reads what models declare (e.g. BERT's MLM head and special tokens in models/bert.py, every
    kind's FLOPs per token in its protocol), never an objective's module: only the shared losses
    (objectives/losses.py, which text-to-text finetuning trains too)."""
    graph = import_graph()
    wrong = [
        (module, target)
        for module, targets in graph.items()
        if module.startswith("tfcli.tasks")
        for target in targets
        if target.startswith("tfcli.objectives") and target != "tfcli.objectives.losses"
    ]
    assert not wrong, wrong


def test_flops_per_token_is_defined_once_per_model_kind():
    """torchtitan's pattern: the model gives its FLOPs (models/kinds.py protocols); nothing outside
    models/ defines a count of its own."""
    import re

    for path in PACKAGE.rglob("*.py"):
        if path.parent.name != "models":
            assert not re.search(r"^def flops_per_token", path.read_text(), re.M), path


def test_tasks_ask_what_a_model_can_do_more_than_its_kind():
    """How a model pools, reads a prompt and a target, and counts its FLOPs is the model's to say
    (models/pooling.py, kinds.is_seq2seq, flops_per_token): outside models/ a test of a model's kind
    is left only where a task refuses what a kind cannot do or picks a head for it. Issue 37 counted
    27 such tests in tasks/ and generate.py; fewer than half remain."""
    import re

    tests = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in PACKAGE.rglob("*.py")
        if path.parent.name != "models"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"model\.kind\s*(==|!=|in\b|not in\b)", line)
    ]
    assert len(tests) < 27 / 2, tests


def test_every_import_inside_a_function_resolves():
    """A function-level import runs only when its function does: `--resume auto` imported `tfcli.runs`
    after the module moved, and nothing noticed until a user typed it. Every `from X import a, b`
    anywhere in the package names a module that exists and names it has."""
    import importlib

    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith("tfcli")):
                continue
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            try:
                module = importlib.import_module(base)
            except ImportError as e:
                missing.append(f"{path.relative_to(REPO)}:{node.lineno} {base} ({e})")
                continue
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{base}.{alias.name}") is None:
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno} {base}.{alias.name}")
    assert not missing, missing


def test_no_module_outside_the_methods_table_compares_a_finetuning_methods_name():
    """finetune.train is one table (adapters.METHODS): what a method trains, whether it switches off,
    its FLOPs, its memory and its export are the record's; a new method is a record, not nine branches."""
    import re

    from tfcli.adapters import METHODS
    from tfcli.recipe import FinetuneConfig

    assert typing_args(FinetuneConfig, "train") == tuple(METHODS)
    names = "|".join(METHODS)
    patterns = [
        re.compile(r"\.train\s*(==|!=|\bin\b|\bnot in\b)"),
        re.compile(rf"""\btrain\s*(==|!=)\s*["']({names})["']"""),
        re.compile(rf"""\(\s*["']({names})["']\s*,\s*["']({names})["']"""),
    ]
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "adapters.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(p.search(line) for p in patterns) and "train_on" not in line
    ]
    assert not offenders, "\n".join(offenders)


def typing_args(cls, name: str) -> tuple:
    import typing

    return typing.get_args(typing.get_type_hints(cls)[name])


def test_no_module_compares_a_distributed_strategys_name():
    """DDP and FSDP answer for themselves (runtime.Strategy: sharded, lockstep, held, gradient_copies):
    how checkpoints are written, what a process holds for the plan, whether processes generate together."""
    import re

    pattern = re.compile(
        r"""strategy\.name\s*(==|!=|in\b)|["'](ddp|fsdp)["']\s*(==|!=)|(==|!=|in)\s*\(?["'](ddp|fsdp)["']"""
    )
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "\n".join(offenders)


@pytest.mark.slow
def test_the_plugin_contract_type_checks():
    """plugin.py, driver.py, recipe.py and registry.py pass mypy (its settings: pyproject's [tool.mypy]):
    a contract that is only documented drifts; one that is checked does not."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_only_model_source_works_out_what_a_path_is():
    """A model source is resolved once (engine/model_source.py: a run, a checkpoint, a transformers
    directory, a GGUF file, a hub id); the driver, the commands and the loaders take its answer."""
    import re

    pattern = re.compile(
        r"\b(is_run|looks_like_run|is_gguf|looks_like_hub_id|family_of|read_source_config)\(|"
        r"suffix\.lower\(\)\s*==\s*(gguf\.)?SUFFIX|snapshot_download\(|/ (checkpoint\.)?CHECKPOINTS\)\.is_dir\(\)"
    )
    allowed = {"engine/model_source.py", "hf/hub.py"}  # the resolver, and the hub download it calls
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if str(path.relative_to(PACKAGE)) not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "\n".join(offenders)


RECORDS_HOME = ("hf/registry.py", "hf/traits.py", "hf/record.py")  # where architectures are declared


def test_no_module_compares_a_transformers_model_type_outside_the_records():
    """How architectures differ is declared in their records (hf/registry.py, with hf/traits.py):
    the tables read the record's fields, so no `model_type == "qwen2"`, `model_type in (...)` or
    `hf_model_type == ...` test is left anywhere in tfcli/ (issue 71)."""
    import re

    from tfcli.hf import registry

    types = "|".join(re.escape(t) for t in registry.NATIVE)
    forbidden = [
        re.compile(r"""model_type\W{0,3}\s*(==|!=)\s*["'A-Z]"""),
        re.compile(r"model_type\W{0,3}\s+(not\s+)?in\s*[(\[{]"),
        re.compile(rf"""(==|!=)\s*["']({types})["']"""),
    ]
    offenders = lines_matching(forbidden, skip=lambda path: str(path.relative_to(PACKAGE)) in RECORDS_HOME)
    assert not offenders, "\n".join(offenders)


def test_models_knows_only_tfclis_own_fields():
    """transformers' config keys (rope_parameters, rope_scaling, layer_types, ...) are read in hf/
    (hf/positions.py for the positions); models/ builds from tfcli's own config fields."""
    keys = ("rope_parameters", "rope_scaling", '"rope_theta"', "max_window_layers", "use_sliding_window")
    offenders = [
        f"{path.relative_to(PACKAGE)}: {key}"
        for path in (PACKAGE / "models").glob("*.py")
        if path.name != "generic.py"  # the generic path hands transformers its own config whole
        for key in keys
        if key in path.read_text()
    ]
    assert not offenders, offenders
