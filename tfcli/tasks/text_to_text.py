"""Classification the generative way, for encoder-decoders (T5) and decoders (GPT, llama): the label
word is the answer.

Finetuning: T5 reads "mnli premise: ... hypothesis: ... <extra_id_0>" and learns to fill the
sentinel with the label word; GPT reads the same text followed by "answer:" and learns the label
word as the next tokens. Prediction is never free-running decoding: the model scores each label
word (the sum of its tokens' log-probabilities) and the highest wins. k-shot prompting scores an
un-finetuned checkpoint the same way, with k solved training examples before the question.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from ..data import IGNORE
from ..engine.perf import training_flops_multiplier
from ..errors import UserError
from ..models import kinds
from ..objectives.losses import next_token_loss, seq2seq_loss, shift_right
from ..plugin import Batch
from . import prompts
from .classification import Head
from .heads import ExampleSource

T5_PROMPT_TOKENS = 1024  # T5's encoder has no position table; k-shot prompts may be this long


def _pad(rows: list[list[int]], value: int) -> Tensor:
    out = torch.full((len(rows), max(map(len, rows))), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _mask(rows: list[list[int]]) -> Tensor:
    lengths = torch.tensor([len(r) for r in rows])
    return (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()  # (N, S)


def _device(model: nn.Module) -> torch.device:
    """Where the model's weights are: scoring batches are built on the CPU and moved there."""
    return next(model.parameters()).device


class Seq2SeqReader:
    """T5: the prompt, ending in the sentinel <extra_id_0> and </s>, goes to the encoder; the target
    is <extra_id_0> label-word </s>, the span-corruption answer format.

    Why the sentinel, finetuned or not: span corruption always starts its target with
    <extra_id_0>, so a pretrained decoder's first position never learned to read the encoder. A
    label word there starts from nothing (a small T5 finetuned that way stayed at the label prior);
    after the sentinel it sits where pretraining taught the decoder to fill a gap from the input.
    """

    loss = staticmethod(seq2seq_loss)

    def __init__(self, tokenizer, label_words):
        self.tok = tokenizer
        self.eos, self.pad = tokenizer.eos_id, tokenizer.token_id("<pad>")
        sentinel = tokenizer.token_id(prompts.SENTINEL)
        if self.eos is None or self.pad is None or sentinel is None:
            raise UserError(f"this T5 run's tokenizer lacks <pad>, </s> or {prompts.SENTINEL}")
        self.answers = [[sentinel] + tokenizer.encode(w) + [self.eos] for w in label_words]

    def query(self, text: str) -> list[int]:
        return self.tok.encode(f"{text} {prompts.SENTINEL}") + [self.eos]

    def batch(self, prompt_ids: list[list[int]], labels: list[int]) -> Batch:
        targets = _pad([self.answers[y] for y in labels], IGNORE)
        return {
            "input_ids": _pad(prompt_ids, self.pad),
            "attention_mask": _mask(prompt_ids),
            "labels": targets,
            "decoder_input_ids": shift_right(targets, self.pad),
        }

    def scores(self, model: nn.Module, prompt_ids: list[list[int]]) -> Tensor:
        """(N, n_labels) log p(answer | prompt)."""
        dev = _device(model)
        ids, mask = _pad(prompt_ids, self.pad).to(dev), _mask(prompt_ids).to(dev)
        encoded = model.encode(ids, mask)  # (N, S, D), once for every label
        return torch.stack(
            [
                target_log_probs(model, encoded, mask, _pad([a] * len(prompt_ids), IGNORE).to(dev), self.pad)
                for a in self.answers
            ],
            dim=1,
        )


class DecoderReader:
    """GPT: the prompt ends in "answer:"; the label word's tokens are its continuation."""

    loss = staticmethod(next_token_loss)

    def __init__(self, tokenizer, label_words):
        self.tok = tokenizer
        probe = tokenizer.encode("answer:")
        self.answers = []
        for w in label_words:  # the word as the tokenizer splits it right after "answer:"
            full = tokenizer.encode(f"answer: {w}")
            self.answers.append(full[len(probe) :] if full[: len(probe)] == probe else tokenizer.encode(f" {w}"))
        self.fill = tokenizer.eos_id if tokenizer.eos_id is not None else 0

    def query(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def batch(self, prompt_ids: list[list[int]], labels: list[int]) -> Batch:
        seqs = [p + self.answers[y] for p, y in zip(prompt_ids, labels)]
        targets = _pad([[IGNORE] * (len(p) - 1) + self.answers[y] for p, y in zip(prompt_ids, labels)], IGNORE)
        return {"input_ids": _pad([s[:-1] for s in seqs], self.fill), "targets": targets}

    def scores(self, model: nn.Module, prompt_ids: list[list[int]]) -> Tensor:
        """(N, n_labels) log p(label tokens | prompt). The prompts (left-padded) are read once into a KV
        cache; each label's later tokens are then read after it (a k-shot prompt costs one pass, not one
        per label)."""
        dev = _device(model)
        width = max(map(len, prompt_ids))
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=dev)  # (N, W)
        ids = torch.tensor([[self.fill] * (width - len(p)) + p for p in prompt_ids], device=dev)
        caches = model.new_caches(width + max(map(len, self.answers)))
        first = model.logits(model(ids, caches, key_mask=mask)[:, -1]).float().log_softmax(-1)  # (N, V)
        out = []
        for answer in self.answers:
            total = first[:, answer[0]]  # (N,)
            if len(answer) > 1:
                for c in caches:
                    c.rewind(width)
                rest = torch.tensor(answer[:-1], device=dev).expand(len(prompt_ids), -1)  # (N, A-1)
                key_mask = torch.cat([mask, mask.new_ones(len(prompt_ids), len(answer) - 1)], dim=1)
                logp = model.logits(model(rest, caches, key_mask=key_mask)).float().log_softmax(-1)  # (N, A-1, V)
                total = total + logp.gather(
                    -1, torch.tensor(answer[1:], device=dev).expand(len(prompt_ids), -1)[..., None]
                ).squeeze(-1).sum(-1)
            out.append(total)
        return torch.stack(out, dim=1)


def target_log_probs(
    model: nn.Module,
    encoded: Tensor,
    encoder_mask: Tensor | None,
    targets: Tensor,
    start_id: int,
    ignore_id: int = IGNORE,
) -> Tensor:
    """Sum of log p(target token) over each row's target: targets (B, T) with ignore_id padding -> (B,).
    Teacher-forced: the decoder input is the target shifted right behind the start token."""
    dec = shift_right(targets, start_id)
    logp = model.logits(model.decode(dec, encoded, encoder_mask)).float().log_softmax(-1)  # (B, T, V)
    picked = logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)  # (B, T)
    return (picked * (targets != ignore_id)).sum(-1)


READERS = {kinds.ENCODER_DECODER: Seq2SeqReader, kinds.DECODER: DecoderReader}  # by model kind


def fit_input(encode, texts: tuple[str, ...], budget: int) -> list[int]:
    """encode(texts) -> ids, with the longest text shortened word by word until they fit `budget`
    tokens (the end of the input, where a prompt's cue is, is kept)."""
    texts = list(texts)
    while True:
        ids = encode(tuple(texts))
        words = [t.split() for t in texts]
        longest = max(range(len(texts)), key=lambda i: len(words[i]))
        if len(ids) <= budget or len(words[longest]) <= 1:
            return ids[-budget:]
        texts[longest] = " ".join(words[longest][: max(1, len(words[longest]) - max(1, len(ids) - budget))])


class TextHead(Head):
    """Label words scored by a T5 or GPT: no trainable head; the whole model learns (or, k-shot, nothing).

    `cue`: end the prompt in "answer:" (GPT always; T5 only when it was not finetuned on the task).
    `demos`: solved examples put before each question while the prompt fits (k-shot)."""

    item_name = "tok"

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        task: str,
        fields: tuple[str, ...],
        labels: tuple[str, ...],
        max_length: int,
        cue: bool,
        demos: list[str] = (),
    ):
        self.task, self.fields, self.cue, self.demos = task, fields, cue, list(demos)
        self.seq2seq = kinds.is_seq2seq(model)
        self.reader = READERS[model.kind](tokenizer, labels)
        self.budget = (
            max_length
            if self.seq2seq
            else min(max_length, model.cfg.max_seq_len - max(len(a) for a in self.reader.answers))
        )
        self.heads = nn.ModuleDict()
        self.loss = self.reader.loss
        self.shots_used: list[int] = []

    def prompt(self, texts: tuple[str, ...]) -> list[int]:
        """The question's ids (texts shortened to fit), after as many demonstrations as fit."""
        ids = self.fit(texts, self.budget // 2 if self.demos else self.budget)
        used = 0
        for d in reversed(self.demos):  # the demonstrations nearest the question first
            d_ids = self.reader.tok.encode(d + "\n")
            if len(ids) + len(d_ids) > self.budget:
                break
            ids, used = d_ids + ids, used + 1
        self.shots_used.append(used)
        return ids

    def no_shot_fits(self, questions: list[int]) -> None:
        """k-shot scoring where no demonstration fits beside any question would be zero-shot scoring
        reported as k-shot: one line with the sizes instead."""
        demo = int(np.mean([len(self.reader.tok.encode(d + "\n")) for d in self.demos]))
        raise UserError(
            f"--few-shot {len(self.demos)}: no solved example fits beside the questions in this model's "
            f"{self.budget}-token prompt (a question takes {min(questions)}-{max(questions)} tokens, "
            f"an example about {demo}); use --few-shot 0, or a model with a longer context"
        )

    def fit(self, texts: tuple[str, ...], budget: int) -> list[int]:
        make = prompts.question if self.cue else prompts.input_text
        return fit_input(lambda t: self.reader.query(make(self.task, self.fields, t)), texts, budget)

    def source(self, rows: list, train: bool) -> ExampleSource:
        examples = [(self.prompt(texts), y) for texts, y in rows]
        if self.demos and rows and not any(self.shots_used[-len(rows) :]):
            self.no_shot_fits([len(p) for p, _ in examples])
        lengths = np.array([len(p) for p, _ in examples])
        if train:
            return ExampleSource(
                examples, lambda ex: self.reader.batch([p for p, _ in ex], [y for _, y in ex]), lengths
            )
        return ExampleSource(
            examples, lambda ex: {"prompts": [p for p, _ in ex], "labels": torch.tensor([y for _, y in ex])}
        )

    def scores(self, model: nn.Module, heads: nn.ModuleDict, batch: Batch) -> Tensor:
        return self.reader.scores(model, batch["prompts"])

    def notes(self) -> dict[str, float]:
        """How many of the k demonstrations fit, on average, since the last call."""
        used, self.shots_used = self.shots_used, []
        return {"shots": float(np.mean(used)), "k": float(len(self.demos))} if self.demos and used else {}

    def count_items(self, batch: Batch) -> int:
        """Encoder and decoder tokens (T5) or the sequence (GPT)."""
        return int(batch["input_ids"].numel() + (batch["labels"].numel() if "labels" in batch else 0))

    def flops_per_item(self, model: nn.Module, rows: list, train: str) -> float:
        """The pretraining objectives' FLOP counts at the mean prompt and answer lengths (theirs train
        every weight: scaled for adapters, perf.training_flops_multiplier)."""
        prompt = int(np.mean([len(self.fit(texts, self.budget)) for texts, _ in rows[:500]]))
        answer = int(np.mean([len(a) for a in self.reader.answers]))
        full = model.flops_per_token(prompt, answer) if self.seq2seq else model.flops_per_token(prompt + answer)
        return full * training_flops_multiplier(train) / 6.0
