"""Chat templates: a model's Jinja template (tokenizer_config.json's `chat_template`, a GGUF's, or one
tfcli ships) rendered the way transformers' `apply_chat_template` renders it, and the mask of the
tokens a model should learn to write.

A template is data, never code: it is rendered in jinja2's ImmutableSandboxedEnvironment (as
transformers does), so attribute tricks that reach Python internals (`''.__class__...`) stop with
a one-line error. The assistant mask comes from rendering prefixes of the conversation and
differencing them (torchtune's approach): the characters an assistant message adds after its
generation prompt are its reply (the tokens the model samples at inference: the reply and its
end-of-turn token), so no template needs `{% generation %}` markers. A template that has them (TRL's
training templates) is taken at its word instead: the mask is the marked text, as transformers'
`return_assistant_tokens_mask` makes it, so a run in one of TRL's templates trains what SFTTrainer's
`assistant_only_loss` trains (those also take the line breaks around the end-of-turn token).

Tool calls (TRL's conversational format): an assistant message may carry `tool_calls` ({"type":
"function", "function": {"name", "arguments"}}) and `tool` messages carry their results; the
conversation's tools (JSON schemas) are given to the template as transformers gives them (`tools=`).
An assistant message is a reply whether it writes text or calls tools; tool results and the system's
tool list are never one.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from ..errors import UserError, short
from .special_tokens import template_of

ROLES = ("system", "user", "assistant", "tool")
TOOL_PROBE = "tfcli_probe_tool"  # a tool name no template writes unless it writes tool calls
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"  # where `{% generation %}` opens and closes (private use)
PROBE_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}  # what probes of a template render it with
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "chat_templates"


@dataclass(frozen=True)
class Rendered:
    """A conversation as token ids, with the assistant reply each token belongs to."""

    ids: list[int]
    turns: list[int]  # per token: the number (1, 2, ...) of the assistant reply it belongs to, else 0
    text: str

    @property
    def assistant_mask(self) -> list[int]:
        return [int(t > 0) for t in self.turns]


class ChatTemplate:
    """One Jinja chat template, compiled once in the sandbox."""

    def __init__(self, source: str, where: str = "chat template"):
        self.source, self.where = source, where
        self._template = _compile(source, where)

    @classmethod
    def load(cls, name_or_path: str) -> ChatTemplate:
        """A template tfcli ships (chatml, llama-3-instruct, ...), a .jinja file, or a
        tokenizer_config.json (its `chat_template`)."""
        path = Path(name_or_path)
        shipped = SHIPPED_DIR / f"{name_or_path}.jinja"
        if not path.is_file() and shipped.is_file():
            path = shipped
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in SHIPPED_DIR.glob("*.jinja")))
            raise UserError(f"chat template {name_or_path!r}: no such file or shipped template (shipped: {known})")
        text = path.read_text()
        if path.suffix == ".json":
            template = template_of(json.loads(text))
            if template is None:
                raise UserError(f"{path}: no chat_template in it")
            text = template
        return cls(text, str(path))

    @functools.cached_property
    def reads_parts(self) -> bool:
        """Whether the template reads a message's content as a list of parts ({"type": "text"} /
        {"type": "image"}), as vision-language models' templates do, rather than as one text."""
        import jinja2

        probe = "\u2063probe\u2063"
        try:
            out = self._template.render(messages=[{"role": "user", "content": [{"type": "text", "text": probe}]}])
        except (jinja2.exceptions.TemplateError, TypeError, ValueError):
            return False
        return probe in out and "'type'" not in out

    @functools.cached_property
    def writes_tool_calls(self) -> bool:
        """Whether the template writes an assistant's tool calls (it has a tool format): a probe call's
        tool name appears in what it renders."""
        call = {"type": "function", "function": {"name": TOOL_PROBE, "arguments": {"x": 1}}}
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        schema = {"type": "function", "function": {"name": TOOL_PROBE, "parameters": {"type": "object"}}}
        try:
            return TOOL_PROBE in self.text(messages, tools=[schema], **PROBE_SPECIALS)
        except UserError:
            return False

    @functools.cached_property
    def needs_call_ids(self) -> bool:
        """Whether the template refuses a tool call without an id (Mistral's 9-character ids): then
        every call and result is given one where the conversation has none (with_call_ids)."""
        import jinja2

        call = {"type": "function", "function": {"name": TOOL_PROBE, "arguments": {}}}
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            self._template.render(messages=messages, tools=[], **PROBE_SPECIALS)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as e:
            return " id" in str(e).lower() or "ids" in str(e).lower()
        return False

    def text(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        marker: str | None = None,
        tools: list | None = None,
        **specials: str,
    ) -> str:
        """The conversation as the template writes it (bos_token, eos_token, ... as given). Content is
        given to the template in the form it reads: where there are images (`marker`), a template that
        reads parts gets each text as parts (split at the marker, an image part for each); one that
        reads texts gets parts joined, an image part written as the marker."""
        raw = self.marked_text(messages, add_generation_prompt, marker, tools, **specials)
        return raw.replace(MARK_OPEN, "").replace(MARK_CLOSE, "")

    def marked_text(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        marker: str | None = None,
        tools: list | None = None,
        **specials: str,
    ) -> str:
        """`text`, with MARK_OPEN and MARK_CLOSE where the template's generation markers are."""
        import jinja2

        messages = [{**m, "content": self._content(m.get("content"), marker)} for m in messages]
        if self.needs_call_ids:
            messages = with_call_ids(messages)
        if tools is not None:
            specials = {**specials, "tools": tools}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **specials)
        except jinja2.exceptions.SecurityError as e:
            raise UserError(
                f"{self.where}: refused: it reaches for what a template may not ({short(str(e), 120)})"
            ) from None
        except jinja2.exceptions.TemplateError as e:
            raise UserError(f"{self.where}: {short(str(e), 160)}") from None

    def _content(self, content, marker: str | None):
        if isinstance(content, list):
            return content if self.reads_parts else joined(content, marker or "")
        if not isinstance(content, str) or marker is None or not self.reads_parts:
            return content
        pieces = content.split(marker) if marker else [content]
        parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
        for piece in pieces[1:]:
            parts += [{"type": "image"}] + ([{"type": "text", "text": piece}] if piece else [])
        return parts

    def render(
        self,
        tokenizer,
        messages: list[dict],
        add_generation_prompt: bool = False,
        images: ImageMarks | None = None,
        tools: list | None = None,
        **specials: str,
    ) -> Rendered:
        """Ids of the whole conversation and the mask of its assistant replies, each reply's
        end-of-turn token included (whitespace the template writes after it is not). The template
        sees the tokenizer's own special tokens (bos_token, eos_token, ...) unless given. `images`:
        the template places each image's marker (as it reads parts, or where the text has it), and the
        markers of the rendered text are then expanded into the images' tokens. `tools`: the
        conversation's tool schemas, for the template to list."""
        check_messages(messages, parts=images is not None)
        specials = {**tokenizer.specials.to_config(), **specials}
        marker = images.marker if images is not None else None
        raw = self.marked_text(messages, add_generation_prompt, marker, tools, **specials)
        text = raw.replace(MARK_OPEN, "").replace(MARK_CLOSE, "")
        if MARK_OPEN in raw:
            spans = marked_spans(raw, self.where)
        else:
            spans = self.assistant_spans(messages, text, marker, tools, **specials)
        if images is not None:
            if text.count(marker) != images.count:
                raise UserError(
                    f"{self.where}: it writes {text.count(marker)} {marker} markers for {images.count} images"
                )
            spans = [(len(images.expand(text[:a])), len(images.expand(text[:b]))) for a, b in spans]
            text = images.expand(text)
        encoding = tokenizer.tok.encode(text, add_special_tokens=False)
        # a token is the reply's if it overlaps it (" Paris" starts at the space the template writes)
        turns = [next((n for n, (a, b) in enumerate(spans, 1) if s < b and e > a), 0) for s, e in encoding.offsets]
        return Rendered(list(encoding.ids), turns, text)

    def assistant_spans(
        self, messages: list[dict], text: str, marker: str | None = None, tools: list | None = None, **specials: str
    ) -> list[tuple[int, int]]:
        """(start, end) characters of every assistant reply in `text`: what rendering messages[:i+1]
        adds to rendering messages[:i], after the generation prompt's header (found by its text:
        templates may write other blank lines around it on the two routes)."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            previous = self.text(messages[:i], False, marker, tools, **specials)
            through = self.text(messages[: i + 1], False, marker, tools, **specials).rstrip()  # may end in blank lines
            common = len(os.path.commonprefix([previous, through]))
            prompted = self.text(messages[:i], True, marker, tools, **specials)
            header = prompted[len(os.path.commonprefix([previous, prompted])) :].strip()
            found = through.find(header, common) if header else common
            if found < 0 or not text.startswith(through) or not through.startswith(previous.rstrip()):
                raise UserError(
                    f"{self.where}: rendering a longer conversation changes what came before "
                    f"(message {i + 1}); the assistant replies cannot be told apart"
                )
            start = found + len(header)
            while start < len(through) and through[start].isspace():  # the header's line break, indentation
                start += 1
            spans.append((start, len(through)))
        return spans


def marked_spans(raw: str, where: str) -> list[tuple[int, int]]:
    """(start, end) characters, in the text without them, of what each pair of generation markers
    encloses, in order (a template's `{% generation %}` blocks)."""
    spans, removed, start = [], 0, None
    for i, c in enumerate(raw):
        if c not in (MARK_OPEN, MARK_CLOSE):
            continue
        if (c == MARK_OPEN) != (start is None):  # an open inside a block, or a close outside one
            raise UserError(f"{where}: its {{% generation %}} blocks are nested or unclosed")
        if c == MARK_OPEN:
            start = i - removed
        else:
            spans.append((start, i - removed))
            start = None
        removed += 1
    return [(a, b) for a, b in spans if b > a]


def with_call_ids(messages: list[dict]) -> list[dict]:
    """The conversation with an id on every tool call that has none ("call" and its number, 9
    characters: call00001, ...) and, on every tool result without one, the id of the call it answers
    (the calls' ids in order, as results follow their calls)."""
    out, waiting, n = [], [], 0
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                n += 1
                c = c if c.get("id") else {**c, "id": f"call{n:05d}"}
                waiting.append(c["id"])
                calls.append(c)
            m = {**m, "tool_calls": calls}
        elif m.get("role") == "tool" and not m.get("tool_call_id") and waiting:
            m = {**m, "tool_call_id": waiting.pop(0)}
        out.append(m)
    return out


def check_messages(messages: list[dict], parts: bool = False) -> None:
    """Each message a {role, content} with a known role and text content (`parts`: or a list of text
    and image parts, a vision-language model's); an assistant's `tool_calls` (then its content may be
    empty or None) a list of {function: {name, arguments}}."""
    if not messages:
        raise UserError("a conversation needs at least one message")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls is not None and (m.get("role") != "assistant" or not tool_calls_valid(calls)):
            raise UserError(
                f"message {i + 1}: tool_calls must be an assistant's list of "
                f"{{type: function, function: {{name, arguments}}}}, got {short(m, 60)}"
            )
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not (
                isinstance(content, str) or (calls and content is None) or (parts and joined(content, "") is not None)
            )
        ):
            raise UserError(
                f"message {i + 1}: expected {{role: system|user|assistant|tool, content: text}}, got {short(m, 60)}"
            )


def tool_calls_valid(calls) -> bool:
    """A non-empty list of {function: {name: text, arguments: an object or its JSON}}."""
    if not isinstance(calls, list) or not calls:
        return False
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            return False
        if not isinstance(function.get("arguments"), (dict, str)):
            return False
    return True


@dataclass(frozen=True)
class ImageMarks:
    """A conversation's images, for ChatTemplate.render: the marker the template writes for each, how
    many there are, and how a rendered text's markers become the images' tokens (in order)."""

    marker: str
    count: int
    expand: Callable[[str], str]


def joined(content, marker: str) -> str | None:
    """A message's content as one text: a text as it is, a list of parts joined ({"type": "text"}'s
    text; `marker` for each {"type": "image"}); None when it is neither."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            out.append(marker)
        elif kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            return None
    return "".join(out)


@lru_cache(maxsize=32)
def _compile(source: str, where: str):
    """The template compiled in jinja2's immutable sandbox, with the helpers transformers gives
    templates (raise_exception, tojson, strftime_now) and its extensions (loop controls)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _generation_tag()]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise UserError(f"{where}: not a valid Jinja template (line {e.lineno}: {short(e.message, 100)})") from None


def _generation_tag():
    """transformers' `{% generation %}...{% endgeneration %}` (marking the assistant's tokens): its
    body, between MARK_OPEN and MARK_CLOSE, for `render` to find."""
    import jinja2.ext
    from jinja2 import nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            mark = [nodes.Output([nodes.TemplateData(c)]).set_lineno(lineno) for c in (MARK_OPEN, MARK_CLOSE)]
            return [mark[0], *body, mark[1]]

    return Generation


def shipped_templates() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.jinja"))


def tool_templates() -> str:
    """The shipped templates that write tool calls, for the hint of a refusal."""
    return ", ".join(n for n in shipped_templates() if ChatTemplate.load(n).writes_tool_calls)


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|endoftext|>", "<|end_of_text|>")


def stop_ids(tokenizer) -> set[int]:
    """Where a chat reply ends: the tokenizer's end of text and the end-of-turn tokens it has."""
    ids = {tokenizer.token_id(t) for t in END_OF_TURN} | {tokenizer.eos_id}
    return {i for i in ids if i is not None}


def for_model(tokenizer, name: str | None = None) -> ChatTemplate:
    """--chat-template NAME|FILE, else the model's own template, else a one-line refusal naming both."""
    if name:
        return ChatTemplate.load(name)
    if not tokenizer.chat_template:
        raise UserError(
            f"this model has no chat template; pass --chat-template with one of "
            f"{', '.join(shipped_templates())} or a .jinja file"
        )
    return ChatTemplate(tokenizer.chat_template, "the model's chat template")
