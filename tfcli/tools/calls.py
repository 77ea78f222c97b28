"""Tool calls read from what a model wrote, in its chat template's own format: the format is the one
whose reader gets back a probe call the template itself renders (so a template is never trusted by
its name). Formats: hermes (Qwen2.5/3, SmolLM3, Hermes: `<tool_call>{json}</tool_call>` blocks),
mistral (`[TOOL_CALLS]` then a JSON list, or `name[ARGS]{json}`), llama3 (the reply is one JSON object
with name and parameters, after an optional `<|python_tag|>`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UserError

PROBE = {"name": "tfcli_probe_tool", "arguments": {"x": 1}}


@dataclass(frozen=True)
class Parsed:
    """A turn read: its text, its calls ({"type": "function", "function": {name, arguments}}), and
    why it looked like a call that could not be read (None when it did not, or could)."""

    content: str
    calls: list[dict]
    malformed: str | None = None

    @property
    def message(self) -> dict:
        out: dict = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = self.calls
        return out


def call(name, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _one(obj, keys=("arguments", "parameters")) -> dict | str:
    """A JSON call object -> a call, or what is wrong with it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return "a call needs a JSON object with a name"
    arguments = next((obj[k] for k in keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return "its arguments are not JSON"
    return call(obj["name"], arguments)


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at character {e.pos})") from None


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def hermes(text: str) -> Parsed:
    start = text.find("<tool_call>")
    if start < 0:
        return Parsed(text, [])
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            one = _one(_loads(body.strip()))
        except ValueError as e:
            return Parsed(text, [], f"malformed tool call: {e}")
        if isinstance(one, str):
            return Parsed(text, [], f"malformed tool call: {one}")
        calls.append(one)
    return Parsed(text[:start].strip(), calls)


def mistral(text: str) -> Parsed:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return Parsed(text, [])
    body = text[start + len("[TOOL_CALLS]") :].strip()
    calls = []
    try:
        if "[ARGS]" in body:  # v11+: name[ARGS]{json}, repeated
            for piece in body.split("[TOOL_CALLS]"):
                name, _, args = piece.partition("[ARGS]")
                calls.append(_one({"name": name.strip(), "arguments": _loads(args.strip())}))
        else:
            listed = _loads(body)
            calls = [_one(c) for c in (listed if isinstance(listed, list) else [listed])]
    except ValueError as e:
        return Parsed(text, [], f"malformed tool call: {e}")
    bad = next((c for c in calls if isinstance(c, str)), None)
    if bad:
        return Parsed(text, [], f"malformed tool call: {bad}")
    return Parsed(text[:start].strip(), calls)


def llama3(text: str) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text, [])
    try:
        obj = _loads(body)
    except ValueError as e:
        looks = '"name"' in body
        return Parsed(text, [], f"malformed tool call: {e}" if looks else None)
    if not (isinstance(obj, dict) and "name" in obj and ("parameters" in obj or "arguments" in obj)):
        return Parsed(text, [])  # a reply that happens to be JSON
    one = _one(obj)
    return Parsed("", [one]) if not isinstance(one, str) else Parsed(text, [], f"malformed tool call: {one}")


_END = re.compile(r"\s*(<[^<>\s]+>|\[/?[A-Z_]+\])\s*$")
FORMATS: dict[str, Callable[[str], Parsed]] = {"hermes": hermes, "mistral": mistral, "llama3": llama3}


def format_of(template) -> str:
    """The call format of a chat template (data.chat.ChatTemplate): the one that reads back the probe
    call the template writes. One line when the template writes calls in no format tfcli reads."""
    from ..data.chat import PROBE_SPECIALS

    schema = {"type": "function", "function": {"name": PROBE["name"], "parameters": {"type": "object"}}}
    asked = [{"role": "user", "content": "q"}]
    said = asked + [{"role": "assistant", "content": "", "tool_calls": [call(**PROBE)]}]
    before = template.text(asked, add_generation_prompt=True, tools=[schema], **PROBE_SPECIALS)
    after = template.text(said, tools=[schema], **PROBE_SPECIALS)
    written = after[len(os.path.commonprefix([before, after])) :]
    while _END.search(written):  # the turn's end-of-turn marker: a model's turn is read without it
        written = _END.sub("", written)
    for name, read in FORMATS.items():
        parsed = read(written)
        if parsed.calls and parsed.calls[0]["function"] == PROBE:
            return name
    raise UserError(
        f"{template.where}: it writes tool calls in a format tfcli does not read ({written.strip()[:80]!r}); "
        f"formats read: {', '.join(FORMATS)}"
    )
