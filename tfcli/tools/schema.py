"""A Python function's tool schema: its name, type hints and Google-style docstring as the JSON
schema chat templates list, equal to transformers' `get_json_schema` (which tfcli's core install
cannot import), and the check of a call's arguments against a schema."""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG = re.compile(
    r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)",
    re.DOTALL,
)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {**{t: {"type": n} for t, n in _SCALARS.items()}, list: {"type": "array"}, tuple: {"type": "array"}}
_BARE.update({dict: {"type": "object"}, Any: {}})


class SchemaError(ValueError):
    """A function whose schema cannot be written (no docstring, an argument without a hint or a
    description, a hint JSON cannot hold): the message names the function and what it lacks."""


def json_schema(fn: Callable, name: str | None = None) -> dict:
    """{"type": "function", "function": {name, description, parameters[, return]}} of `fn` (a bound
    method's self left out), as transformers' get_json_schema writes it."""
    name = name or getattr(fn, "__name__", "tool")
    doc = (inspect.getdoc(fn) or "").strip()
    if not doc:
        raise SchemaError(f"{name} has no docstring (its first line describes the tool to the model)")
    found = _DESCRIPTION.search(doc)
    description = found.group(1).strip() if found else None
    described = _arg_descriptions(doc)
    returns = _RETURNS.search(doc)
    parameters, output = _parameters(fn, name)
    for arg, schema in parameters["properties"].items():
        if arg not in described:
            raise SchemaError(f"{name}'s docstring has no description for its argument {arg!r} (an Args: line)")
        text = described[arg]
        choices = _CHOICES.search(text)
        if choices:
            import json

            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = text[: choices.start()].strip()
        schema["description"] = text
    function: dict = {"name": name, "description": description, "parameters": parameters}
    if output is not None:
        if returns:
            output["description"] = returns.group(1).strip()
        function["return"] = output
    return {"type": "function", "function": function}


def _arg_descriptions(doc: str) -> dict[str, str]:
    block = _ARGS.search(doc)
    if block is None:
        return {}
    text = "\n".join(line for line in block.group(1).split("\n") if line.strip())
    return {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in _ARG.findall(text)}


def _parameters(fn: Callable, name: str) -> tuple[dict, dict | None]:
    try:
        hints = get_type_hints(fn)
    except Exception as e:  # a hint naming something the module does not define
        raise SchemaError(f"{name}'s type hints cannot be read ({type(e).__name__}: {e})") from None
    signature = inspect.signature(fn)
    required, properties = [], {}
    first = next(iter(signature.parameters.values()), None)
    for arg, param in signature.parameters.items():
        if param is first and arg in ("self", "cls") and param.annotation is inspect.Parameter.empty:
            continue  # a method's receiver
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise SchemaError(f"{name} takes *{arg}: a tool's arguments are named, each with a type hint")
        if param.annotation is inspect.Parameter.empty:
            raise SchemaError(f"{name}'s argument {arg!r} has no type hint (the schema's type comes from it)")
        if param.default is inspect.Parameter.empty:
            required.append(arg)
        properties[arg] = _hint(hints[arg], name, arg)
    output = None
    if "return" in hints:
        try:
            output = _hint(hints["return"], name, "return")
        except SchemaError:
            pass  # the model never writes the return value: a hint JSON cannot hold is left out
    parameters: dict = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return parameters, output


def _hint(hint, name: str, arg: str) -> dict:
    origin, args = get_origin(hint), get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, Enum):
        return _enum([m.value for m in hint], name, arg)
    if origin is None:
        if hint in _BARE:
            return dict(_BARE[hint])
        raise SchemaError(f"{name}'s argument {arg!r}: JSON has no type for {hint!r} (int, float, str, bool, "
                          f"list, dict, Literal, Enum and their unions do)")  # fmt: skip
    if origin is Union or origin is types.UnionType:
        subtypes = [_hint(t, name, arg) for t in args if t is not type(None)]
        if len(subtypes) == 1:
            out = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            kinds = sorted({s["type"] for s in subtypes})
            out = {"type": kinds[0] if len(kinds) == 1 else kinds}
        else:
            out = {"anyOf": subtypes}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal and args:
        return _enum(list(args), name, arg)
    if origin is list:
        return {"type": "array", "items": _hint(args[0], name, arg)} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 1 or ... in args:
            raise SchemaError(f"{name}'s argument {arg!r}: write a variable-length tuple as list[...]")
        return {"type": "array", "prefixItems": [_hint(t, name, arg) for t in args]} if args else {"type": "array"}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _hint(args[1], name, arg)
        return out
    raise SchemaError(f"{name}'s argument {arg!r}: JSON has no type for {hint!r}")


def _enum(values: list, name: str, arg: str) -> dict:
    if not values or any(type(v) not in _SCALARS for v in values):
        raise SchemaError(f"{name}'s argument {arg!r}: its choices must be JSON scalars")
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


_CHECKS = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def argument_problem(schema: dict, arguments) -> str | None:
    """What is wrong with a call's arguments for the tool `schema` (one line), or None: not an object,
    a required argument missing, one the tool does not take, a value of the wrong JSON type or outside
    its choices."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    parameters = schema.get("function", schema).get("parameters") or {}
    properties = parameters.get("properties") or {}
    missing = [a for a in parameters.get("required", []) if a not in arguments]
    if missing:
        return f"missing argument{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    unknown = [a for a in arguments if a not in properties]
    if unknown:
        return f"unknown argument {unknown[0]!r} (it takes {', '.join(properties) or 'none'})"
    for arg, value in arguments.items():
        spec = properties[arg]
        if value is None and spec.get("nullable"):
            continue
        kinds = spec.get("type")
        kinds = [kinds] if isinstance(kinds, str) else (kinds or [])
        if kinds and not any(_CHECKS.get(k, lambda v: True)(value) for k in kinds):
            return f"argument {arg!r} must be {' or '.join(kinds)}, got {value!r}"[:200]
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {arg!r} must be one of {spec['enum']}, got {value!r}"[:200]
    return None
