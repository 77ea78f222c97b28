"""Command-line shortcut flags derived from the recipe's fields: `--steps` is `train.steps`, its type
the field's and its help the field's own `metadata={"help": ...}` in its dataclass (tfcli/recipe.py, or
a plug-in's Config, as TRL's configs carry theirs), so a flag and its field cannot drift apart.

The dataclasses are read from their source files, not imported: importing the recipe imports torch,
and `--help` must answer at once.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from .. import registry

RECIPE_SECTIONS = {
    "data": "DataConfig",
    "optim": "OptimConfig",
    "schedule": "ScheduleConfig",
    "train": "TrainConfig",
    "finetune": "FinetuneConfig",
    "adapter": "AdapterConfig",
}  # recipe section -> its class in recipe.py


@dataclass(frozen=True)
class Field:
    path: str  # section.name, e.g. train.steps
    annotation: str  # as written, e.g. Literal["all", "head"]
    comment: str

    @property
    def section(self) -> str:
        return self.path.split(".")[0]

    @property
    def choices(self) -> list[str]:
        return re.findall(r'"([^"]*)"', self.annotation) if self.annotation.startswith("Literal") else []

    @property
    def python_type(self) -> type:
        """What typer parses: numbers and flags as themselves; text, choices and lists (comma-separated) as str."""
        return {"int": int, "float": float, "bool": bool}.get(self.annotation, str)


PACKAGE = Path(__file__).resolve().parents[1]


def _path(module: str) -> Path:
    """A tfcli module's source file (a package's __init__.py), found without importing it (not even
    through importlib's find_spec, which loads a module that cli.py made lazy)."""
    path = PACKAGE.joinpath(*module.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


@functools.cache
def _source(module: str) -> ast.Module:
    """A module's syntax tree, parsed once: every command-line start reads the recipe fields' help from
    a dozen modules hundreds of times (1.4 s a start when each read parsed the file again)."""
    return ast.parse(_path(module).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _defining(module: str, name: str) -> str:
    """The module that defines class `name` as `module` sees it: itself, or where it imports it from."""
    tree = _source(module)
    if any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body):
        return module
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level and any((a.asname or a.name) == name for a in node.names):
            return _defining(_resolve(module, node), name)
    raise StopIteration(f"{module} has no class {name}")


def _section_class(section: str) -> tuple[str, ast.ClassDef]:
    """(its module, the dataclass) of a recipe section or a plug-in's Config."""
    if section in RECIPE_SECTIONS:
        module, name = "tfcli.recipe", RECIPE_SECTIONS[section]
    else:
        where, plugin = (registry.TASKS.get(section) or registry.OBJECTIVES[section]).split(":")
        module = _defining(f"tfcli.{'tasks' if section in registry.TASKS else 'objectives'}.{where}", plugin)
        config = next(
            n
            for n in _class(_source(module), plugin).body
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "Config"
        )
        name = config.value.id
        module = _defining(module, name)
    return module, _class(_source(module), name)


def _fields(module: str, cls: ast.ClassDef) -> list[ast.AnnAssign]:
    """A dataclass's fields as written, its bases' first (followed through the module's imports: the
    classify section extends the classification tasks' HeadSettings)."""
    tree, out = _source(module), []
    imported = {
        alias.asname or alias.name: _resolve(module, node)
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level
        for alias in node.names
    }
    for base in cls.bases:
        name = getattr(base, "id", "")
        where = module if any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body) else imported.get(name)
        if where:
            out += _fields(where, _class(_source(where), name))
    return out + [n for n in cls.body if isinstance(n, ast.AnnAssign)]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The module a relative `from ... import` in `module` names (a package's __init__ is its own base)."""
    parts = module.split(".")
    package = parts[: len(parts) - node.level + (1 if _path(module).name == "__init__.py" else 0)]
    return ".".join(package + ([node.module] if node.module else []))


@functools.cache
def field(path: str) -> Field:
    """A recipe field's type and its help, from `field(..., metadata={"help": ...})` in its dataclass."""
    section, name = path.split(".")
    node = next((n for n in reversed(_fields(*_section_class(section))) if n.target.id == name), None)
    if node is None:
        raise KeyError(f"{path}: no such recipe field")
    return Field(path, ast.unparse(node.annotation), _help(node))


def _help(node: ast.AnnAssign) -> str:
    """The "help" of a field's metadata, read from the source ("" when it has none)."""
    call = node.value
    metadata = next((k.value for k in getattr(call, "keywords", ()) if k.arg == "metadata"), None)
    if not isinstance(metadata, ast.Dict):
        return ""
    for key, value in zip(metadata.keys, metadata.values):
        if isinstance(key, ast.Constant) and key.value == "help":
            return ast.literal_eval(value)
    return ""


@functools.cache
def tasks_with(name: str) -> list[str]:
    """The tasks whose recipe section has a field `name` (a shared flag binds to the chosen one's)."""
    out = []
    for task in registry.TASKS:
        try:
            fields = _fields(*_section_class(task))
        except StopIteration:  # a task without a Config
            continue
        if any(n.target.id == name for n in fields):
            out.append(task)
    return out


def help_text(f: Field, lead: str = "") -> str:
    """The flag's help: `lead` (what the command adds) or the field's help, its choices, the field (of
    the chosen task, where several tasks have it)."""
    text = lead or f.comment
    choices = " | ".join(f.choices)
    if choices and not all(c in text for c in f.choices):
        text = f"{choices}: {text}" if text else choices
    path = f.path
    if f.section not in RECIPE_SECTIONS:  # a plug-in's own setting: say whose (every task that has it)
        tasks = tasks_with(f.path.split(".")[1]) or [f.section]
        text = f"{', '.join(tasks)}: {text}"
        path = f"<task>.{f.path.split('.')[1]}" if len(tasks) > 1 else f.path
    elif text and not text.startswith(tuple(f.choices)):
        text = text[0].upper() + text[1:]
    return f"{text.rstrip('.')} [default: the recipe's {path}]."


def recipe_flags(*specs: str, after: str, leads: dict[str, str] | None = None):
    """Add a flag per recipe field to a command, after its parameter `after`. A spec is `section.name`
    (the flag --name) or `section.name:flag` (e.g. data.source:data, the flag --data); `leads` puts a
    command's own words before a field's. The command receives the given ones as `shortcuts`:
    {field path: value}, None where a flag was not given."""
    leads = leads or {}

    def wrap(fn):
        signature = inspect.signature(fn, eval_str=True)  # the annotations as types, the flags' beside them
        flags = {}
        for spec in specs:
            path, _, name = spec.partition(":")
            name = name or path.split(".")[1]
            f = field(path)
            cli = f"--{name.replace('_', '-')}" + (f"/--no-{name.replace('_', '-')}" if f.python_type is bool else "")
            flags[name] = (
                path,
                inspect.Parameter(
                    name,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    default=typer.Option(None, cli, help=help_text(f, leads.get(path, ""))),
                    annotation=Optional[f.python_type],  # noqa: UP045 (a runtime type, built from a value)
                ),
            )
        params = [p for p in signature.parameters.values() if p.name != "shortcuts"]
        at = [p.name for p in params].index(after) + 1
        params = params[:at] + [p for _, p in flags.values()] + params[at:]

        @functools.wraps(fn)
        def command(*args, **kwargs):
            shortcuts = {path: kwargs.pop(name) for name, (path, _) in flags.items()}
            return fn(*args, shortcuts=shortcuts, **kwargs)

        command.__signature__ = signature.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.recipe_flags = {name: path for name, (path, _) in flags.items()}
        return command

    return wrap
