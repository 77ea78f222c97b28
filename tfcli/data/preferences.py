"""Preference pairs for DPO (tasks/dpo.py): a prompt, the reply a person preferred and the one they did
not, as two decoder examples whose trained tokens are the reply and its end token (the SFT examples
of data/conversations.py with train_on="last", so templates, masks and the base format are SFT's).

Rows come as
  - `prompt` / `chosen` / `rejected`: strings, or message lists (TRL's conversational format: the
    prompt's messages, the reply as [{role: assistant, content}]);
  - whole dialogues in `chosen` / `rejected` that share every turn but the last reply (Anthropic's
    HH: "\\n\\nHuman: ...\\n\\nAssistant: ..."), split at the last shared turn, Human/Assistant as
    user/assistant.
A pair whose replies are identical or empty, whose prompt alone fills the context, or that is longer
than the model reads is skipped and counted by reason.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from ..errors import UserError
from .chat import check_messages
from .conversations import Example, ExampleBuilder, built, why_out_of_order

_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")
ROLES = {"Human": "user", "Assistant": "assistant"}


@dataclass(frozen=True)
class PairFields:
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    system: str = ""  # a system message before every prompt ("" = none)
    margin: str = ""  # a reward model's column of how much better the chosen reply is ("" = none)


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example
    margin: float = 0.0  # how much better the chosen reply is (a reward model's margin column; else 0)

    @property
    def length(self) -> int:
        return max(len(self.chosen.ids), len(self.rejected.ids))


@dataclass
class Pairs:
    pairs: list[Pair]
    skipped: Counter = field(default_factory=Counter)


def dialogue(text: str) -> list[dict] | None:
    """'\\n\\nHuman: a\\n\\nAssistant: b' -> [{user: a}, {assistant: b}]; None when it is not one."""
    parts = _TURN.split(text if text.startswith("\n\n") else "\n\n" + text.lstrip("\n"))
    if len(parts) < 3 or parts[0].strip():
        return None
    return [{"role": ROLES[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts) - 1, 2)]


def as_messages(value) -> list[dict] | None:
    """A message list as it is, a Human/Assistant dialogue parsed, None otherwise."""
    if isinstance(value, list):
        try:
            check_messages(value)
        except UserError:
            return None
        if any(m["role"] == "tool" or m.get("tool_calls") for m in value):  # preferences over replies, not calls
            return None
        return [{"role": m["role"], "content": m["content"]} for m in value]
    return dialogue(value) if isinstance(value, str) and "\n\nHuman:" in "\n\n" + value.lstrip("\n") else None


def reply_text(value) -> str | None:
    """A reply given as text or as [{role: assistant, content}]."""
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and len(value) == 1
        and isinstance(value[0], dict)
        and value[0].get("role") == "assistant"
        and isinstance(value[0].get("content"), str)
    ):
        return value[0]["content"]
    return None


def split_pair(row: dict, f: PairFields) -> tuple[list[dict], str, str] | str:
    """(prompt messages, chosen reply, rejected reply), or 'skip:<why>'."""
    for name in (f.chosen, f.rejected):
        if row.get(name) is None:
            return f"skip:no {name!r}"
    if f.prompt in row:
        prompt = row[f.prompt]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else as_messages(prompt)
        chosen, rejected = reply_text(row[f.chosen]), reply_text(row[f.rejected])
        if messages is None or chosen is None or rejected is None:
            return "skip:a prompt or reply that is neither text nor messages"
    else:  # whole dialogues: the prompt is what both share before the last reply
        a, b = as_messages(row[f.chosen]), as_messages(row[f.rejected])
        if not a or not b or a[-1]["role"] != "assistant" or b[-1]["role"] != "assistant" or a[:-1] != b[:-1]:
            return "skip:dialogues that do not share every turn but the last reply"
        messages, chosen, rejected = a[:-1], a[-1]["content"], b[-1]["content"]
    if f.system:
        messages = [{"role": "system", "content": f.system}] + messages
    if not chosen.strip() or not rejected.strip():
        return "skip:empty reply"
    if chosen.strip() == rejected.strip():
        return "skip:identical replies"
    return messages, chosen, rejected


class PairBuilder:
    """Rows -> pairs of decoder examples, through an SFT example builder (train_on last)."""

    def __init__(self, examples: ExampleBuilder, fields: PairFields = PairFields()):
        self.examples, self.fields = examples, fields

    def build_all(self, rows: list, places: list[str] | None = None) -> Pairs:
        """Every row's pair (`places`, as ExampleBuilder.build_all takes them: a pair row is skipped with
        its reason, never stops a run, so it is not named)."""
        return Pairs(*built(rows, self.pair))

    def pair(self, row: dict) -> Pair | str:
        parsed = split_pair(row, self.fields)
        if isinstance(parsed, str):
            return parsed
        messages, chosen, rejected = parsed
        if why_out_of_order(messages + [{"role": "assistant", "content": chosen}]):
            return "skip:roles out of order"
        built = [
            self.examples.within_length(self.examples.build(messages + [{"role": "assistant", "content": reply}]))
            for reply in (chosen, rejected)
        ]
        why = next((b for b in built if isinstance(b, str)), None)
        if why is not None:
            return why
        margin = row.get(self.fields.margin, 0.0) if self.fields.margin else 0.0
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            return f"skip:a {self.fields.margin!r} that is not a number"
        return Pair(*built, float(margin))
