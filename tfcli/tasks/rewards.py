"""Rewards a program can check, for on-policy training (`tfcli finetune grpo --reward ...`).

    --reward final-number                       1 when the completion's final number is the answer's
    --reward final-number,regex:####:0.2        several, each with a weight (default 1), summed
    --reward path/to/file.py:my_reward          the user's own Python function

Built-ins score one completion against its row (its `answer` column, grpo.answer_field):

    final-number    1 if the completion's final number equals the answer's (GSM8K's scorer, answers.py)
    exact           1 if the completion is the answer (case and runs of whitespace aside)
    contains        1 if the answer appears in the completion (the same normalisation)
    regex:PATTERN   1 if PATTERN matches somewhere in the completion (re.search; `.` spans lines)
    length:N        DAPO's soft overlong punishment: 0 up to max_completion_length - N tokens, then
                    linearly down to -1 at max_completion_length (TRL's get_soft_overlong_punishment)
    rm:RUN          the score of a tfcli reward model run (tasks/reward_model.py: weights, no code)

A trailing `:NUMBER` is a weight (`regex:PATTERN:0.2`); a pattern that itself ends in `:NUMBER` needs
an explicit weight after it. A user's function is called as TRL calls reward functions:
fn(prompts=[...], completions=[...], completion_ids=[...], **columns), one entry per completion in every
list (a column: that completion's row's value), and returns one float per completion (None: this
reward does not apply to it). Naming a file is the one way tfcli runs user code: it is imported only
when the command line of that very command names it (`named`, from commands.common.named_code); a
run, a recipe or a grid file that records one is data, and gets a one-line refusal saying how to name it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import usercode
from ..errors import UserError
from . import answers

BUILT_IN = ("final-number", "exact", "contains", "regex:PATTERN", "length:N", "rm:RUN")
_ANSWER_METRICS = {"final-number", "exact", "contains"}
_WEIGHT = re.compile(r"(.+):([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")
_USER = usercode.USER


@dataclass(frozen=True)
class Completions:
    """What every reward is asked about: one entry per completion, in the rollout's order."""

    prompts: list  # the row's prompt (text, or its messages)
    texts: list[str]  # the completion, decoded (its end-of-turn token left out)
    ids: list[list[int]]  # the completion's token ids
    rows: list[dict]  # the row each completion answers (its columns)
    max_length: int  # grpo.max_completion_length
    conversations: list | None = None  # with tools: each completion's turns (tasks/grpo/turns.Conversation)


@dataclass(frozen=True)
class Reward:
    name: str  # as the metrics name it: rewards/<name>/mean
    weight: float
    score: Callable[[Completions], list]  # -> one float (or None) per completion
    reads: str | None = None  # the row column it needs (built-ins that compare with the answer)
    holds: Any = None  # a model it reads (a reward model run's): the run's memory plan counts it

    def scores_nothing_of(self, row: dict) -> bool:
        """Whether no completion can earn this reward on `row` (final-number of an answer with no number,
        exact or contains of an empty answer): such a row's group always scores 0 and teaches nothing."""
        if self.reads is None:
            return False
        answer = str(row.get(self.reads, "") or "")
        base = self.name.split(":")[0]
        return answers.final_number(answer) is None if base == "final-number" else not answers.normalise(answer)


def parse(spec: str, answer_field: str, named: frozenset[str] = frozenset()) -> list[Reward]:
    """`--reward` -> its rewards, in order; a one-line UserError for anything that is not a reward, and
    for a file.py:function that `named` (the user functions this command's own command line names, as
    `user_functions` gives them) does not hold."""
    items = _items(spec)
    for item in items:
        function = _user_body(item)
        if function:
            usercode.refuse_unnamed(function, named, "--reward", absolute_spec(spec))
    rewards = [_one(item, answer_field) for item in items]
    if not rewards:
        raise UserError(
            f"name a reward: --reward with one or more of {', '.join(BUILT_IN)}, or a file.py:function of yours"
        )
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        raise UserError(f"--reward {spec!r} names the same reward twice; give each once (with a weight)")
    return rewards


def _items(spec: str) -> list[str]:
    """The spec's rewards, each with its weight (a comma inside a regex stays in it)."""
    items: list[str] = []
    for piece in spec.split(","):
        if items and not _starts_reward(piece.strip()):
            items[-1] += "," + piece
        else:
            items.append(piece.strip())
    return [item for item in items if item]


def _user_body(item: str) -> str | None:
    """file.py:function of an item that names a user's function (its weight left off), else None."""
    m = _WEIGHT.fullmatch(item)
    body = m.group(1) if m and _USER.fullmatch(m.group(1)) else item
    return body if _USER.fullmatch(body) else None


absolute = usercode.absolute  # file.py:function with the file's absolute path (what `named` holds)


def absolute_spec(spec: str) -> str:
    """The spec with every user function's file made absolute (weights kept): a run records it so, and
    it names the same file from any directory."""
    out = []
    for item in _items(spec):
        function = _user_body(item)
        out.append(absolute(function) + item[len(function) :] if function else item)
    return ",".join(out)


def user_functions(*values: str) -> frozenset[str]:
    """The user functions that command-line values name (absolute): the only ones tfcli may import."""
    return frozenset(absolute(f) for v in values for f in map(_user_body, _items(str(v))) if f)


def _starts_reward(piece: str) -> bool:
    return piece.split(":")[0] in {"final-number", "exact", "contains", "regex", "length", "rm"} or bool(
        _USER.fullmatch(piece.rsplit(":", 1)[0] if piece.count(":") > 1 else piece)
    )


def _weighted(item: str) -> tuple[str, float]:
    """(the reward, its weight): a trailing :NUMBER where what is left is a whole reward, else 1."""
    m = _WEIGHT.fullmatch(item)
    return (m.group(1), float(m.group(2))) if m and _complete(m.group(1)) else (item, 1.0)


def _one(item: str, answer_field: str) -> Reward:
    body, weight = _weighted(item)
    name, _, argument = body.partition(":")
    if name in _ANSWER_METRICS and not argument:
        return Reward(name, weight, _matching(name, answer_field), reads=answer_field)
    if name == "regex" and argument:
        try:
            pattern = re.compile(argument, re.DOTALL)
        except re.error as e:
            raise UserError(f"--reward {item!r}: {argument!r} is not a regular expression ({e})") from None
        return Reward(body, weight, lambda c: [float(pattern.search(t) is not None) for t in c.texts])
    if name == "length" and argument:
        if not argument.isdigit() or int(argument) < 1:
            raise UserError(f"--reward {item!r}: length:N takes N, a number of tokens >= 1")
        return Reward(body, weight, _overlong(int(argument)))
    if name == "rm" and argument:
        from .reward_model import RunReward

        model = RunReward(argument)
        return Reward(body, weight, lambda c: model(c.prompts, c.texts), holds=model.model)
    if _USER.fullmatch(body):
        return Reward(body, weight, _user_function(body))
    raise UserError(f"--reward {item!r}: not a built-in reward ({', '.join(BUILT_IN)}) nor a file.py:function of yours")


def _complete(body: str) -> bool:
    """Whether `body` is a whole reward once a trailing :NUMBER is taken as its weight (length:64 is not
    length weighted 64: length needs its N)."""
    name, _, argument = body.partition(":")
    return (
        (name in _ANSWER_METRICS and not argument)
        or (name in ("regex", "length", "rm") and bool(argument))
        or bool(_USER.fullmatch(body))
    )


def _matching(metric: str, field: str) -> Callable[[Completions], list]:
    def score(c: Completions) -> list:
        return [float(answers.correct(t, str(row.get(field, "")), metric)) for t, row in zip(c.texts, c.rows)]

    return score


def _overlong(cache: int) -> Callable[[Completions], list]:
    def score(c: Completions) -> list:
        expected = c.max_length - cache
        out = []
        for ids in c.ids:
            n = len(ids)
            out.append(0.0 if n <= expected else (expected - n) / cache if n <= c.max_length else -1.0)
        return out

    return score


def _user_function(body: str) -> Callable[[Completions], list]:
    """The user's function, imported from the file they named (the one place tfcli runs user code)."""
    fn = usercode.load(body, "--reward")
    if not callable(fn):
        raise UserError(f"--reward {body}: {body.rsplit(':', 1)[0]} has no function {body.rsplit(':', 1)[1]}")

    def score(c: Completions) -> list:
        columns = {k: [row.get(k) for row in c.rows] for k in dict.fromkeys(k for row in c.rows for k in row)}
        columns = {k: v for k, v in columns.items() if k not in ("prompts", "completions", "completion_ids")}
        if c.conversations is not None and c.conversations[0].environment is not None:
            columns["environments"] = [v.environment for v in c.conversations]  # as TRL gives them
        return fn(prompts=c.prompts, completions=c.texts, completion_ids=c.ids, **columns)

    return score


def environment_reward(name: str) -> Reward:
    """An environment's own reward (`--env` with get_reward): each finished rollout's instance asked,
    weight 1, named after its class, as TRL's environment_factory has it."""

    def score(c: Completions) -> list:
        return [v.environment.get_reward() for v in c.conversations or []]

    return Reward(name, 1.0, score)


def scored(rewards: list[Reward], c: Completions, where: Callable[[int], str], nans: Counter | None = None) -> Tensor:
    """(N, F): every reward of every completion (NaN where a reward returned None or NaN: it does not
    apply; `nans` counts the NaNs by reward, which a run says once). A reward that raises, returns the
    wrong count, something that is not a number, or an infinity stops the run in one line naming it
    and the row (`where(i)` says which row completion i answers)."""
    columns = []
    for r in rewards:
        try:
            values = r.score(c)
        except Exception as e:  # a user's function: find the row it fails on, name it
            raise UserError(
                f"reward {r.name} failed on {where(_failing_row(r, c))} ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(values, (list, tuple)) or len(values) != len(c.texts):
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise UserError(f"reward {r.name} returned {count} values for {len(c.texts)} completions (one each)")
        column = [_number(r, v, where, i) for i, v in enumerate(values)]
        if nans is not None:
            nans[r.name] += sum(v is not None and math.isnan(x) for v, x in zip(values, column))
        columns.append(column)
    return torch.tensor(columns, dtype=torch.float32).t().reshape(len(c.texts), len(rewards))


def _number(r: Reward, value: Any, where, i: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, (bool, int, float)) or (isinstance(value, Tensor) and value.numel() == 1):
        number = float(value)
        if math.isinf(number):
            raise UserError(
                f"reward {r.name} returned {number} for {where(i)} (a finite number, or None where it does not apply)"
            )
        return number
    raise UserError(f"reward {r.name} returned {value!r} for {where(i)} (a number, or None where it does not apply)")


def _failing_row(r: Reward, c: Completions) -> int:
    """The first completion the reward fails on alone (0 when it fails on none alone)."""
    for i in range(len(c.texts)):
        talks = c.conversations[i : i + 1] if c.conversations is not None else None
        one = Completions(
            c.prompts[i : i + 1], c.texts[i : i + 1], c.ids[i : i + 1], c.rows[i : i + 1], c.max_length, talks
        )
        try:
            r.score(one)
        except Exception:
            return i
    return 0
