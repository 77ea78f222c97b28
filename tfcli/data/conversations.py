"""Instruction data as token ids with the tokens a model should learn to write marked: the data of
supervised finetuning (tasks/sft.py).

Three row formats, told apart by their fields:
  - prompt/reply rows (`prompt`/`completion`, or the fields a recipe names: GSM8K's question/answer);
  - conversations: a `messages` list of {role, content} (system, then user and assistant in turn),
    tool calls among them in TRL's format (an assistant's `tool_calls`, then a `tool` message for each
    result) with the row's `tools` (JSON schemas) listed by the chat template;
  - plain text (continued pretraining: every token trained).
A row that cannot become an example (a missing field, roles out of order, an empty reply, more
tokens than the model reads) is skipped with its reason counted, never a traceback.

A decoder: with a chat template the whole conversation is rendered once and the replies are found
by prefix differencing (data/chat.py); without one (a base model) an example is the prompt and a
line break, then the reply and the end-of-text token. Either way the token that closes a reply (end
of turn or end of text) is a target: a model that never learned to emit it never stops. An
encoder-decoder (T5) reads everything before the last reply and learns to write that reply.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from .chat import ChatTemplate, ImageMarks, check_messages, joined, tool_templates

TRAIN_ON = ("assistant", "all", "last")
FORMATS = ("auto", "prompt", "messages", "text")


@dataclass(frozen=True)
class Fields:
    """Where a row keeps its parts."""

    prompt: str = "prompt"
    response: str = "completion"
    messages: str = "messages"
    text: str = "text"
    system: str = ""  # a system message put before every prompt/reply row ("" = none)
    tools: str = "tools"  # a conversation's tool schemas (a list, or its JSON)


@dataclass(frozen=True)
class Example:
    """A decoder's example: ids (T,) and trained (T,), 1 where ids[t] is a target of position t-1;
    `prompt` is what generation starts from (every message before the last reply, and the
    assistant's header); `reply` the last reply's text, what a generation is compared with."""

    ids: np.ndarray
    trained: np.ndarray
    prompt: list[int]
    reply: str
    plain_text: bool = False  # a text row: no prompt to answer, so nothing to generate and score
    images: tuple = ()  # a vision-language model's: each image's data.image_prompts.ImageRef, in order

    @property
    def targets(self) -> int:
        return int(self.trained.sum())


@dataclass(frozen=True)
class Seq2SeqExample:
    """An encoder-decoder's example: the encoder reads `source` (ending in end of text), the decoder
    learns `target` (the last reply and end of text), every token of it."""

    source: np.ndarray
    target: np.ndarray
    reply: str

    plain_text = False  # (a class attribute, not a field) an encoder-decoder's example always has a reply

    @property
    def ids(self) -> np.ndarray:
        return self.source

    @property
    def prompt(self) -> list[int]:
        return self.source.tolist()

    @property
    def targets(self) -> int:
        return len(self.target)


AnyExample = Example | Seq2SeqExample


@dataclass
class Examples:
    """A split's examples and why rows were skipped (reason -> count)."""

    examples: list
    skipped: Counter = field(default_factory=Counter)
    columns: tuple[str, ...] = ()  # the fields the rows have (the first rows'), to name when none fit

    @property
    def trained_tokens(self) -> int:
        return sum(e.targets for e in self.examples)

    @property
    def tokens(self) -> int:
        return int(sum(len(e.ids) for e in self.examples))


def built(rows: list, make) -> tuple[list, Counter]:
    """make(row) for every row: what it built, and the reasons ('skip:<why>') of the rows it skipped, counted."""
    out, skipped = [], Counter()
    for row in rows:
        item = make(row) if isinstance(row, dict) else "skip:not a row of fields"
        if isinstance(item, str):
            skipped[item[len("skip:") :]] += 1
        else:
            out.append(item)
    return out, skipped


def row_format(row: dict, fields: Fields, wanted: str = "auto") -> str:
    """prompt, messages or text: the first the row has, unless the recipe says which."""
    if wanted != "auto":
        return wanted
    if fields.messages in row:
        return "messages"
    if fields.prompt in row or fields.response in row:
        return "prompt"
    return "text"


def as_messages(row: dict, fields: Fields, fmt: str, parts: bool = False) -> list[dict] | str:
    """The row as a conversation (prompt rows become [system], user, assistant), its text for a
    text row, or a string naming why it is skipped (prefixed 'skip:'). `parts`: a message's content
    may be a list of text and image parts (a vision-language model's rows)."""
    if fmt == "text":
        text = row.get(fields.text)
        return text if isinstance(text, str) and text.strip() else f"skip:no {fields.text!r} text"
    if fmt == "prompt":
        prompt, reply = row.get(fields.prompt), row.get(fields.response)
        if not isinstance(prompt, str) or not prompt.strip():
            return f"skip:no {fields.prompt!r}"
        if not isinstance(reply, str) or not reply.strip():
            return f"skip:empty {fields.response!r}"
        system = [{"role": "system", "content": fields.system}] if fields.system else []
        return system + [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    messages = row.get(fields.messages)
    if not isinstance(messages, list) or not messages:
        return f"skip:no {fields.messages!r} list"
    try:
        check_messages(messages, parts)
    except UserError as e:
        return "skip:malformed tool_calls" if "tool_calls" in str(e) else "skip:a message without role and text content"
    kept = ("role", "content", "tool_calls", "name", "tool_call_id")  # what a template may read of a message
    return why_out_of_order(messages) or [{k: m[k] for k in kept if k in m} for m in messages]


# the roles that may follow each (after an optional system message, a conversation starts with the user)
FOLLOWS = {"user": {"assistant"}, "assistant": {"user"}, "calls": {"tool"}, "tool": {"tool", "assistant"}}


def why_out_of_order(messages: list[dict]) -> str | None:
    """An optional system message, then user and assistant in turn, ending in a reply: an assistant
    that calls tools is followed by their results (`tool` messages), then the assistant again."""
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    if not turns or turns[0]["role"] != "user":
        return "skip:roles out of order"
    for m, after in zip(turns, turns[1:]):
        kind = "calls" if m["role"] == "assistant" and m.get("tool_calls") else m["role"]
        if after["role"] not in FOLLOWS.get(kind, ()):
            return "skip:roles out of order"
    if turns[-1]["role"] != "assistant":
        return "skip:no assistant reply at the end"
    if any(
        m["role"] == "assistant" and not m.get("tool_calls") and not joined(m["content"], "").strip() for m in turns
    ):
        return "skip:empty reply"
    return None


def tools_of(row: dict, fields: Fields) -> list | None:
    """A row's tool schemas (a list, or its JSON as TRL's datasets often store it), None without any."""
    import json

    tools = row.get(fields.tools)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise UserError(f"a row's {fields.tools!r} is not JSON: {tools[:60]!r}") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UserError(f"a row's {fields.tools!r} must be a list of JSON schemas, got {str(tools)[:60]!r}")
    return tools or None


class ExampleBuilder:
    """Rows -> examples: each row parsed, built for the model's kind, held to the length limit, and
    the rows that could not be used counted by reason."""

    def __init__(self, tokenizer, max_length: int, fields: Fields = Fields(), fmt: str = "auto"):
        if fmt not in FORMATS:
            raise UserError(f"sft.format {fmt!r}: choose {', '.join(FORMATS)}")
        self.tok, self.max_length, self.fields, self.fmt = tokenizer, max_length, fields, fmt
        self.eos = tokenizer.eos_id
        if self.eos is None:
            raise UserError("this tokenizer has no end-of-text token; a reply would have nothing to end with")

    def build_all(self, rows: list, places: list[str] | None = None) -> Examples:
        """Every row's example; `places` says where each row is (its file and number), for the one-line
        errors of rows that stop a run (ImageExamples')."""
        columns = dict.fromkeys(k for row in rows[:100] if isinstance(row, dict) for k in row)
        return Examples(*built(rows, self.example), columns=tuple(columns))

    reads_parts = False  # rows' messages may hold image parts (ImageExamples)

    tools: list | None = None  # the row's tool schemas, while its example is built

    def example(self, row: dict) -> AnyExample | str:
        parsed = as_messages(row, self.fields, row_format(row, self.fields, self.fmt), self.reads_parts)
        if isinstance(parsed, str) and parsed.startswith("skip:"):
            return parsed
        self.tools = tools_of(row, self.fields)
        return self.within_length(self.build(parsed))

    def within_length(self, example: AnyExample | str) -> AnyExample | str:
        """The example, or why it is skipped: its prompt alone, or the whole of it, is longer than the
        model reads."""
        if isinstance(example, str):
            return example
        if len(example.prompt) >= self.max_length:
            return "skip:prompt alone longer than data.seq_len"
        if max(len(example.ids), len(getattr(example, "target", ()))) > self.max_length:
            return "skip:longer than data.seq_len"
        return example

    def build(self, parsed: list[dict] | str) -> AnyExample | str:
        """A conversation (or a plain text) -> an example, or 'skip:<why>'."""
        raise NotImplementedError


class DecoderExamples(ExampleBuilder):
    """A decoder's examples: the chat template's rendering (or the base format), `train_on` deciding
    which replies are targets: every assistant reply, all tokens, or the last reply only."""

    def __init__(
        self,
        tokenizer,
        template: ChatTemplate | None,
        train_on: str,
        max_length: int,
        fields: Fields = Fields(),
        fmt: str = "auto",
    ):
        super().__init__(tokenizer, max_length, fields, fmt)
        if train_on not in TRAIN_ON:
            raise UserError(f"sft.train_on {train_on!r}: choose {', '.join(TRAIN_ON)}")
        self.template, self.train_on = template, train_on

    def build(self, parsed):
        if isinstance(parsed, str):  # plain text: every token a target
            ids = self.tok.encode(parsed) + [self.eos]
            return Example(np.array(ids), np.array([0] + [1] * (len(ids) - 1)), ids[:1], parsed, plain_text=True)
        if self.template is not None:
            return self.templated(parsed)
        if self.tools or any(m["role"] == "tool" or m.get("tool_calls") for m in parsed):
            return "skip:tool calls need a chat template (sft.chat_template)"
        if len(parsed) != 2:  # a system message or several turns: only a template says how to write them
            return "skip:a conversation needs a chat template (sft.chat_template)"
        return self.plain(parsed[0]["content"], parsed[1]["content"])

    images: ImageMarks | None = None  # the example's images, while it is built (ImageExamples)

    def templated(self, messages: list[dict]) -> Example:
        calls = any(m.get("tool_calls") for m in messages)
        if calls and not self.template.writes_tool_calls:
            raise UserError(
                f"{self.template.where} has no tool format (it does not write an assistant's tool_calls); "
                f"pass sft.chat_template a template that does (shipped: {tool_templates()})"
            )
        rendered = self.template.render(self.tok, messages, images=self.images, tools=self.tools)
        turns = np.array(rendered.turns)  # (T,): 0, or the number of the reply the token belongs to
        if self.train_on == "all":
            trained = np.ones(len(turns), dtype=np.int64)
        elif self.train_on == "last":
            trained = (turns == turns.max()).astype(np.int64) if turns.max() > 0 else turns * 0
        else:
            trained = (turns > 0).astype(np.int64)
        trained[0] = 0  # the first token is nobody's target
        prompt = self.template.render(
            self.tok, messages[:-1], add_generation_prompt=True, images=self.images, tools=self.tools
        ).ids
        return Example(np.array(rendered.ids), trained, list(prompt), joined(messages[-1]["content"] or "", ""))

    def plain(self, prompt: str, reply: str) -> Example:
        """A base model's example: the prompt and a line break, the reply, end of text."""
        head, tail = self.tok.encode(prompt + "\n"), self.tok.encode(reply) + [self.eos]
        trained = [1] * (len(head) + len(tail)) if self.train_on == "all" else [0] * len(head) + [1] * len(tail)
        trained[0] = 0
        return Example(np.array(head + tail), np.array(trained), head, reply)


class Seq2SeqExamples(ExampleBuilder):
    """An encoder-decoder's examples: the prompt (for a conversation, every earlier message as
    'role: text' lines) to the encoder, the last reply to the decoder."""

    def build(self, parsed):
        if isinstance(parsed, str):
            return "skip:plain text has no reply for an encoder-decoder to learn (give prompt/reply rows)"
        if self.tools or any(m["role"] == "tool" or m.get("tool_calls") for m in parsed):
            return "skip:tool calls need a decoder's chat template"
        *context, last = parsed
        if len(context) == 1 and context[0]["role"] == "user":
            source = context[0]["content"]
        else:
            source = "\n".join(f"{m['role']}: {m['content']}" for m in context)
        return Seq2SeqExample(
            np.array(self.tok.encode(source) + [self.eos]),
            np.array(self.tok.encode(last["content"]) + [self.eos]),
            last["content"],
        )


def require_targets(split: str, examples: Examples) -> None:
    """A split in which nothing would be trained is a mistake in the data or the template."""
    if not examples.examples:
        reasons = ", ".join(f"{n} {why}" for why, n in examples.skipped.most_common(3)) or "no rows"
        missing = any(why.startswith("no '") for why in examples.skipped)
        fields = (
            (
                f"; the rows have {', '.join(repr(c) for c in examples.columns)}: name yours with --prompt-field and "
                f"--response-field (or --set sft.messages_field=... / sft.text_field=...)"
            )
            if missing and examples.columns
            else ""
        )
        raise UserError(f"sft {split}: no usable example ({reasons}){fields}")
    if examples.trained_tokens == 0:
        raise UserError(
            f"sft {split}: no token is trained (the replies are empty or the template hides them); "
            f"check sft.train_on and the chat template"
        )
