"""Multi-turn rollouts with tools: the model writes until it calls a tool or ends its turn; the call
is read in its template's format, the tool runs, its result enters as a tool message through the
template, and the model goes on in the same KV cache (generate.generate_turns), up to grpo.max_turns
turns and max_completion_length tokens in all. Token ids in and out: the trained tokens are the
sampled ones, never re-tokenized text; the tool messages and the template's tokens between turns are
read, not trained (TRL's tool_mask). A call that cannot be read or run goes back to the model as the
tool's error, counted by kind."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from ...data.chat import tool_templates
from ...errors import UserError
from ...generate import generate_turns
from ...tools import calls as call_formats
from ...tools.toolbox import FAILURES, Toolbox, ToolSet


@dataclass
class Conversation:
    """One rollout's turns after its prompt."""

    toolbox: Toolbox
    messages: list[dict] = field(default_factory=list)  # assistant and tool messages, in order
    turn_start: int = 0  # where the model's current turn starts in its ids
    turns: int = 0
    calls: int = 0
    failures: Counter = field(default_factory=Counter)
    environment: object = None

    @property
    def answer(self) -> str:
        """The model's last turn: what rewards read."""
        said = [m for m in self.messages if m["role"] == "assistant"]
        return said[-1]["content"] if said else ""


@dataclass(frozen=True)
class Turns:
    ids: list[list[int]]  # each rollout's ids after its prompt: its turns and the tool messages between
    sampled: list[list[bool]]  # whether each id was sampled (trained) or read (a tool message, a header)
    conversations: list[Conversation]


class ToolTurns:
    """The template's side of tool use: the call format it writes, and the ids of tool messages
    between two turns, found as TRL finds them (a conversation with and without the tool messages,
    cut after the call's end-of-turn token), so that the ids the model reads are those the template
    would render for the whole conversation."""

    def __init__(self, template, tokenizer, stops: set[int], max_turns: int):
        self.template, self.tok, self.stops, self.max_turns = template, tokenizer, stops, max_turns
        if not template.writes_tool_calls:
            raise UserError(
                f"{template.where} has no tool format (it does not write an assistant's tool_calls); give "
                f"grpo.chat_template one that does (shipped: {tool_templates()})"
            )
        self.format = call_formats.format_of(template)
        self.read = call_formats.FORMATS[self.format]
        self.check_prefix()

    def check_prefix(self) -> None:
        """One line unless the template renders a conversation's earlier turns the same whatever follows
        (the property that continuing a conversation's ids relies on)."""
        probe = [call_formats.call("tfcli_probe_tool", {})]
        said = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": probe}]
        answered = said + [{"role": "tool", "name": "tfcli_probe_tool", "content": "1"}]
        specials = self.tok.specials.to_config()
        short = self.template.text(said, **specials)
        long = self.template.text(answered, add_generation_prompt=True, **specials)
        if not long.startswith(self._through_stop(short)):
            raise UserError(
                f"{self.template.where}: rendering a tool result changes the turn before it (the template does "
                f"not preserve a conversation's prefix), so a rollout's ids could not continue; use a template "
                f"that does (shipped: {tool_templates()})"
            )

    def _through_stop(self, text: str) -> str:
        ids = self.tok.tok.encode(text, add_special_tokens=False).ids
        ends = [i for i, t in enumerate(ids) if t in self.stops]
        return self.tok.decode(ids[: ends[-1] + 1] if ends else ids, skip_special_tokens=False)

    def tool_ids(self, tool_messages: list[dict]) -> list[int]:
        """The ids of `tool_messages` after a call's end-of-turn token, through the next turn's header
        (TRL's _get_tool_suffix_ids)."""
        probe = [call_formats.call(tool_messages[0]["name"], {})]
        said = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": probe}]
        encode = lambda text: self.tok.tok.encode(text, add_special_tokens=False).ids
        specials = self.tok.specials.to_config()
        prefix = encode(self.template.text(said, **specials))
        full = encode(self.template.text(said + tool_messages, add_generation_prompt=True, **specials))
        ends = [i for i, t in enumerate(prefix) if t in self.stops]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise UserError(f"{self.template.where}: a tool message changes the ids of the turn before it")
        return full[len(prefix) :]

    def run(
        self,
        model: nn.Module,
        prompts: list[list[int]],
        conversations: list[Conversation],
        *,
        max_new_tokens: int,
        sampling: dict,
        seed: int | None,
        pad_id: int,
        finished=bool,
    ) -> Turns:
        def turn_ended(r: int, ids: list[int], room: int) -> list[int] | None:
            return self.answer_calls(conversations[r], ids, room)

        ids, sampled = generate_turns(
            model,
            prompts,
            turn_ended,
            max_new_tokens=max_new_tokens,
            stop_ids=self.stops,
            seed=seed,
            pad_id=pad_id,
            finished=finished,
            **sampling,
        )
        for c, row in zip(conversations, ids):  # a turn cut at the token limit is the last one
            closed = bool(c.messages) and c.messages[-1].get("_end") == len(row)
            if len(row) > c.turn_start and not closed:
                c.messages.append({"role": "assistant", "content": self._text(row[c.turn_start :])})
                c.turns += 1
        return Turns(ids, sampled, conversations)

    def _text(self, ids: list[int]) -> str:
        body = ids[:-1] if ids and ids[-1] in self.stops else ids
        return self.tok.decode(body, skip_special_tokens=False)

    def answer_calls(self, c: Conversation, ids: list[int], room: int) -> list[int] | None:
        """A turn has ended (its last id a stop token): its calls run and their results' ids are given
        back to read (None: the conversation is over: no call, the last turn, or no room left for the
        results, which are then dropped as TRL drops them)."""
        text = self._text(ids[c.turn_start :])
        parsed = self.read(text)
        c.turns += 1
        said = {**parsed.message, "_end": len(ids)}
        if parsed.malformed:
            said = {"role": "assistant", "content": text, "_end": len(ids)}
        c.messages.append(said)
        if c.turns >= self.max_turns or not (parsed.calls or parsed.malformed):
            return None
        if parsed.malformed:
            c.calls += 1
            c.failures["malformed"] += 1
            results = [{"role": "tool", "name": "invalid", "content": str({"error": parsed.malformed})}]
        else:
            results = []
            for one in parsed.calls:
                c.calls += 1
                function = one["function"]
                outcome = c.toolbox.call(function["name"], function["arguments"])
                if outcome.failure:
                    c.failures[outcome.failure] += 1
                results.append({"role": "tool", "name": outcome.name, "content": outcome.content})
        more = self.tool_ids(results)
        if len(more) > room:
            return None
        c.messages += results
        c.turn_start = len(ids) + len(more)
        return more


def public(messages: list[dict]) -> list[dict]:
    """The messages without tfcli's bookkeeping (what samples files and rewards get)."""
    return [{k: v for k, v in m.items() if not k.startswith("_")} for m in messages]


class ToolUse:
    """A run's tools put together: the tools, the environment class (a fresh instance per rollout,
    reset on its row), the template's turns, and how a prompt is rendered again when an environment's
    reset adds to its last user message."""

    def __init__(self, turns: ToolTurns, toolset: ToolSet, limits, rerender):
        self.turns, self.limits, self.rerender = turns, limits, rerender
        self.tools, self.env = toolset.tools, toolset.env

    def start(self, prompts: list) -> tuple[list[list[int]], list[Conversation]]:
        """Each rollout's prompt ids and its conversation (its own environment, reset on its row)."""
        ids, conversations = [], []
        for p in prompts:
            tools, environment, extra = list(self.tools), None, None
            if self.env is not None:
                environment = self.env.new(f"row {p.number}")
                try:
                    extra = environment.reset(**p.row)
                except Exception as e:  # the user's environment
                    raise UserError(
                        f"--env: {self.env.name}.reset failed on row {p.number} ({type(e).__name__}: {e})"
                    ) from None
                tools += self.env.tools_of(environment)
            ids.append(self.rerender(p, extra) if isinstance(extra, str) and extra else p.ids)
            conversations.append(Conversation(Toolbox(tools, self.limits), environment=environment))
        return ids, conversations


def tool_sums(conversations: list[Conversation]) -> dict[str, float]:
    """Per rollout (or held-out question): tool calls (TRL's tools/call_frequency), turns, and failed
    calls of each kind."""
    n = max(1, len(conversations))
    failures: Counter = sum((c.failures for c in conversations), Counter())
    out = {
        "tools/call_frequency": sum(c.calls for c in conversations) / n,
        "tools/turns": sum(c.turns for c in conversations) / n,
    }
    out.update({f"tools/failures/{kind}": failures[kind] / n for kind in FAILURES})
    return out


def tool_metrics(conversations: list[Conversation]) -> dict[str, float]:
    """A step's tool metrics: tool_sums, TRL's tools/failure_frequency (failed calls per call), and the
    share of calls that were valid (read, a known tool, arguments its schema takes)."""
    calls = sum(c.calls for c in conversations)
    failures: Counter = sum((c.failures for c in conversations), Counter())
    invalid = sum(failures[k] for k in ("malformed", "unknown_tool", "bad_arguments"))
    return {
        **tool_sums(conversations),
        "tools/failure_frequency": sum(failures.values()) / calls if calls else 0.0,
        "tools/valid_frequency": (calls - invalid) / calls if calls else 0.0,
    }
