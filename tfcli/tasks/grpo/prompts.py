"""Rows -> prompts (the chat template's rendering, the generation prompt included), and the batches of
prompt indices a step draws."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ...data.chat import ChatTemplate, check_messages
from ...data.sampler import Draw, Source
from ...errors import UserError
from .config import GRPOConfig, fields_of


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # what generation starts from (the chat template's rendering, generation prompt included)
    asked: str | list  # the prompt as rewards receive it: its text, or its messages
    row: dict  # the row's columns (what rewards read)
    number: int  # the row's position in its split (1-based), for messages about it


@dataclass
class Prompts:
    examples: list[Prompt]
    skipped: Counter = field(default_factory=Counter)


class PromptBuilder:
    """Rows -> prompts: a `messages` conversation ending with the user's turn, or a `prompt` text (the
    user's message, as SFT reads it; with no template, the text as it is, as TRL feeds a plain prompt),
    rendered with the generation prompt; rows too long to leave room for a completion are skipped."""

    def __init__(
        self, tokenizer, template: ChatTemplate | None, cfg: GRPOConfig, longest: int, tools: list | None = None
    ):
        self.tok, self.template, self.cfg, self.longest = tokenizer, template, cfg, longest
        self.prompt_field = fields_of(cfg)[0]
        self.tools = tools or None  # the tools' schemas every prompt lists (GRPO with tools)

    def build_all(self, rows: list, places: list[str] | None = None) -> Prompts:
        """Every row's prompt (`places`, where each row is, as ExampleBuilder.build_all takes them: a prompt
        row is skipped with its reason, never stops a run, so it is not named)."""
        out = Prompts([])
        for number, row in enumerate(rows, 1):
            built = self.example(row, number) if isinstance(row, dict) else "skip:not a row of fields"
            if isinstance(built, str):
                out.skipped[built[len("skip:") :]] += 1
            else:
                out.examples.append(built)
        return out

    def example(self, row: dict, number: int) -> Prompt | str:
        cfg = self.cfg
        if isinstance(row.get(cfg.messages_field), list):
            messages = row[cfg.messages_field]
            try:
                check_messages(messages)
            except UserError:
                return "skip:a message without role and text content"
            if not messages or messages[-1]["role"] != "user":
                return "skip:messages not ending with the user's turn"
            if any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
                return "skip:earlier tool calls in a prompt (a prompt is the conversation up to the user's turn)"
            if self.template is None:
                return "skip:a conversation needs a chat template (grpo.chat_template)"
            asked: str | list = [{"role": m["role"], "content": m["content"]} for m in messages]
            ids = self.ids(asked)
        elif isinstance(row.get(self.prompt_field), str) and row[self.prompt_field].strip():
            asked = row[self.prompt_field]
            ids = self.ids(asked)
        else:
            return f"skip:no {self.prompt_field!r} text or {cfg.messages_field!r} list"
        if not ids:
            return "skip:empty prompt"
        if len(ids) > self.longest:
            return "skip:prompt longer than data.seq_len - grpo.max_completion_length"
        return Prompt(list(ids), asked, row, number)

    def ids(self, asked: str | list, extra: str = "") -> list[int]:
        """A prompt's ids: its messages (or text, as the user's message) rendered with the generation
        prompt and the tools; `extra` appended to the last user message (an environment's reset)."""
        if self.template is None:
            return self.tok.encode(asked + extra)
        messages = [{"role": "user", "content": asked}] if isinstance(asked, str) else list(asked)
        if extra:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + extra}
        system = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        return self.template.render(self.tok, system + messages, add_generation_prompt=True, tools=self.tools).ids

    def rerender(self, prompt: Prompt, extra: str) -> list[int]:
        return self.ids(prompt.asked, extra)


class PromptBatches(Source):
    """Batches of prompt indices (the rollout looks the prompts up) and a sampling seed of the draw's
    own: the same prompts of the same epoch sample the same completions, so a resumed run does too."""

    def __init__(self, prompts: list[Prompt]):
        self.prompts = prompts
        self.lengths = np.array([len(p.ids) for p in prompts])

    def epoch_size(self, epoch: int) -> int:
        return len(self.prompts)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        seed = int(np.random.default_rng(draw.keys[0].tolist()).integers(2**62))
        return {"index": torch.from_numpy(draw.indices.astype(np.int64)), "seed": torch.tensor([seed])}
