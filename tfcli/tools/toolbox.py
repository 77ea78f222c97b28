"""The tools of a run (`--tools calculator,lookup:facts.jsonl,file.py:fn`, `--env file.py:Class`):
each one's schema for the chat template, and a call run within limits. Whatever goes wrong in a call
(an unknown tool, arguments its schema refuses, a tool that raises, runs past its time or returns too
much) comes back as the tool's error message for the model to read, as TRL gives it, with its kind
counted; it never stops the run."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import usercode
from ..errors import UserError
from . import builtin
from .schema import SchemaError, argument_problem, json_schema

BUILT_IN = ("calculator", "lookup:TABLE.jsonl")
FAILURES = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "too_long")
ENV_HOOKS = ("reset", "get_reward")


@dataclass(frozen=True)
class Tool:
    name: str
    schema: dict  # {"type": "function", "function": {...}}: what the template lists
    fn: Callable


@dataclass(frozen=True)
class Outcome:
    """One call's result: the tool message's content, and the failure's kind (None when it ran)."""

    name: str
    content: str
    failure: str | None = None


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    max_chars: int = 4000


def parse_tools(spec: str, named: frozenset[str] = frozenset()) -> list[Tool]:
    """`--tools` -> its tools, in order: built-ins by name, the user's functions (file.py:fn, imported
    only when this command's command line names them). Each is one line when it is not a tool."""
    tools: list[Tool] = []
    for item in [i.strip() for i in spec.split(",") if i.strip()]:
        if item == "calculator":
            tools.append(_tool(builtin.calculator, "calculator"))
        elif item.startswith("lookup:") and not usercode.USER.fullmatch(item):
            tools.append(_tool(builtin.lookup_tool(item[len("lookup:") :]), "lookup"))
        elif usercode.USER.fullmatch(item):
            usercode.refuse_unnamed(item, named, "--tools", absolute_spec(spec))
            fn = usercode.load(item, "--tools")
            if not callable(fn) or inspect.isclass(fn):
                raise UserError(f"--tools {item}: {item.rsplit(':', 1)[1]} is not a function")
            tools.append(_tool(fn, f"--tools {item}"))
        else:
            raise UserError(f"--tools {item!r}: not a built-in tool ({', '.join(BUILT_IN)}) nor a file.py:function")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise UserError(f"--tools {spec!r} names the tool {_repeated(names)!r} twice")
    return tools


def absolute_spec(spec: str) -> str:
    """The spec with every user function's file absolute (what a run records)."""
    items = [i.strip() for i in spec.split(",") if i.strip()]
    return ",".join(usercode.absolute(i) if usercode.USER.fullmatch(i) else i for i in items)


def _tool(fn: Callable, where: str) -> Tool:
    name = getattr(fn, "__name__", "tool")
    try:
        return Tool(name, json_schema(fn), fn)
    except SchemaError as e:
        raise UserError(f"{where}: {e}") from None


def _repeated(names: list[str]) -> str:
    return next(n for n in names if names.count(n) > 1)


class EnvironmentClass:
    """`--env file.py:Class`: TRL's environment_factory. One instance per rollout, made with no
    arguments; `reset(**row)` starts it on a row (a text it returns is appended to the last user
    message); its public methods are the rollout's tools (their schemas from hints and docstrings);
    `get_reward()`, if defined, scores the finished rollout (weight 1, named after the class)."""

    def __init__(self, body: str, named: frozenset[str]):
        usercode.refuse_unnamed(body, named, "--env", usercode.absolute(body))
        cls = usercode.load(body, "--env", "class")
        if not inspect.isclass(cls):
            raise UserError(f"--env {body}: {body.rsplit(':', 1)[1]} is not a class")
        self.cls, self.name = cls, cls.__name__
        members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))
        if not callable(members.get("reset")):
            raise UserError(f"--env {body}: {self.name} has no reset method (reset(**row) starts a rollout)")
        methods = [n for n in members if not n.startswith("_") and n not in ENV_HOOKS]
        if not methods:
            raise UserError(f"--env {body}: {self.name} has no tool methods (public methods besides reset)")
        self.rewards = "get_reward" in members
        try:
            self.schemas = {n: json_schema(members[n], n) for n in methods}
        except SchemaError as e:
            raise UserError(f"--env {body}: {e}") from None

    def tools_of(self, instance) -> list[Tool]:
        return [Tool(n, s, getattr(instance, n)) for n, s in self.schemas.items()]

    def new(self, where: str):
        try:
            return self.cls()
        except Exception as e:  # the user's class
            raise UserError(f"--env: {self.name}() failed on {where} ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class ToolSet:
    """A run's tools (--tools) and environment class (--env), as read from its command line."""

    tools: list[Tool]
    env: EnvironmentClass | None = None

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools] + (list(self.env.schemas.values()) if self.env else [])


@dataclass
class Toolbox:
    """The tools one rollout may call (the run's, and its environment instance's methods)."""

    tools: list[Tool]
    limits: Limits = field(default_factory=Limits)

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools]

    def call(self, name, arguments) -> Outcome:
        by_name = {t.name: t for t in self.tools}
        tool = by_name.get(name) if isinstance(name, str) else None
        if tool is None:
            return failed(str(name), "unknown_tool", f"Tool {name} not found.")
        problem = argument_problem(tool.schema, arguments)
        if problem:
            return failed(name, "bad_arguments", problem)
        result, error = _within(self.limits.timeout_s, lambda: tool.fn(**arguments))
        if error == "timeout":
            return failed(name, "timeout", f"the tool ran past its {self.limits.timeout_s:g} s limit")
        if error is not None:
            return failed(name, "raised", error)
        content = result if isinstance(result, str) else str(result)
        if len(content) > self.limits.max_chars:
            return failed(
                name, "too_long", f"the tool returned {len(content)} characters (limit {self.limits.max_chars})"
            )
        return Outcome(name, content)


def failed(name: str, kind: str, message: str) -> Outcome:
    """A failure as the model reads it: TRL's {'error': message}."""
    return Outcome(name, str({"error": message}), kind)


def _within(seconds: float, run: Callable) -> tuple[object, str | None]:
    """run() on a daemon thread, waited on for `seconds`: (result, None), (None, its message) when it
    raised (TRL gives the model str(e)), (None, 'timeout') when it was still running (the thread is left behind, never joined)."""
    box: dict = {}

    def target():
        try:
            box["result"] = run()
        except BaseException as e:  # the user's tool: anything it raises goes back to the model
            box["error"] = str(e)[:500] or type(e).__name__

    thread = threading.Thread(target=target, daemon=True, name="tfcli-tool")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return None, "timeout"
    return box.get("result"), box.get("error")
