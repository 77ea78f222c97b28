"""Sentence-pair tasks the generative way, for T5 and GPT runs.

Text-to-text finetuning: T5 reads "mnli premise: ... hypothesis: ... <extra_id_0>" and learns to
fill the sentinel with the label word; GPT reads the same text followed by "answer:" and learns the label word as the next
tokens. Prediction is never free-running decoding: the model scores each label word (the sum of
its tokens' log-probabilities) and the highest wins. k-shot prompting scores an un-finetuned
checkpoint the same way, with k solved training examples (balanced, seeded) before the question.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor, nn

from ..errors import UserError
from ..objectives import next_token, span_corruption
from ..objectives.losses import IGNORE
from . import prompts

GENERATIVE = ("t5", "gpt")
T5_PROMPT_TOKENS = 1024  # T5's encoder has no position table; k-shot prompts may be this long


def _pad(rows: list[list[int]], value: int) -> Tensor:
    out = torch.full((len(rows), max(map(len, rows))), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


class Seq2SeqReader:
    """T5: the prompt, ending in the sentinel <extra_id_0> and </s>, goes to the encoder; the target
    is <extra_id_0> label-word </s>, the span-corruption answer format.

    Why the sentinel, finetuned or not: span corruption always starts its target with
    <extra_id_0>, so a pretrained decoder's first position never learned to read the encoder. A
    label word there starts from nothing (a small T5 finetuned that way stayed at the label prior);
    after the sentinel it sits where pretraining taught the decoder to fill a gap from the input.
    """

    def __init__(self, model, tokenizer, label_words):
        self.model, self.tok = model, tokenizer
        self.eos, self.pad = tokenizer.eos_id, tokenizer.token_id("<pad>")
        sentinel = tokenizer.token_id(prompts.SENTINEL)
        if self.eos is None or self.pad is None or sentinel is None:
            raise UserError(f"this T5 run's tokenizer lacks <pad>, </s> or {prompts.SENTINEL}")
        self.answers = [[sentinel] + tokenizer.encode(w) + [self.eos] for w in label_words]
        self.suffix = f" {prompts.SENTINEL}"
        self.loss = span_corruption.loss

    def query(self, task: str, a: str, b: str, cue: bool) -> list[int]:
        text = prompts.question(task, a, b) if cue else prompts.pair_text(task, a, b)
        return self.tok.encode(text + self.suffix) + [self.eos]

    def batch(self, prompt_ids: list[list[int]], labels: list[int]) -> dict[str, Tensor]:
        ids = _pad(prompt_ids, self.pad)
        targets = _pad([self.answers[y] for y in labels], IGNORE)
        return {"input_ids": ids, "attention_mask": _mask(prompt_ids),
                "labels": targets, "decoder_input_ids": span_corruption.shift_right(targets, self.pad)}

    @torch.no_grad()
    def scores(self, prompt_ids: list[list[int]]) -> Tensor:
        """(N, n_labels) log p(answer | prompt)."""
        from ..seq2seq import target_log_probs

        dev = _device(self.model)
        ids, mask = _pad(prompt_ids, self.pad).to(dev), _mask(prompt_ids).to(dev)
        encoded = self.model.encode(ids, mask)  # (N, S, D), once for every label
        return torch.stack([target_log_probs(self.model, encoded, mask,
                                             _pad([a] * len(prompt_ids), IGNORE).to(dev), self.pad)
                            for a in self.answers], dim=1)


def _device(model: nn.Module) -> torch.device:
    """Where the model's weights are: scoring batches are built on the CPU and moved there."""
    return next(model.parameters()).device


def _mask(rows: list[list[int]]) -> Tensor:
    lengths = torch.tensor([len(r) for r in rows])
    return (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()  # (N, S)


class DecoderReader:
    """GPT: the prompt ends in "answer:"; the label word's tokens are its continuation."""

    def __init__(self, model, tokenizer, label_words):
        self.model, self.tok = model, tokenizer
        probe = tokenizer.encode("answer:")
        self.answers = []
        for w in label_words:  # the word as the tokenizer splits it right after "answer:"
            full = tokenizer.encode(f"answer: {w}")
            self.answers.append(full[len(probe):] if full[: len(probe)] == probe else tokenizer.encode(f" {w}"))
        self.fill = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        self.loss = next_token.loss

    def query(self, task: str, a: str, b: str, cue: bool = True) -> list[int]:
        return self.tok.encode(prompts.question(task, a, b))

    def batch(self, prompt_ids: list[list[int]], labels: list[int]) -> dict[str, Tensor]:
        seqs = [p + self.answers[y] for p, y in zip(prompt_ids, labels)]
        ids = _pad([s[:-1] for s in seqs], self.fill)
        targets = _pad([[IGNORE] * (len(p) - 1) + self.answers[y] for p, y in zip(prompt_ids, labels)], IGNORE)
        return {"input_ids": ids, "targets": targets}

    @torch.no_grad()
    def scores(self, prompt_ids: list[list[int]]) -> Tensor:
        """(N, n_labels) log p(label tokens | prompt), reading only the answer positions' logits."""
        n, L, dev = len(prompt_ids), len(self.answers), _device(self.model)
        pairs = [(p, a) for p in prompt_ids for a in self.answers]
        hidden = self.model(_pad([p + a[:-1] for p, a in pairs], self.fill).to(dev))  # (N*L, T, D)
        rows = torch.tensor([i for i, (p, a) in enumerate(pairs) for _ in a], device=dev)
        cols = torch.tensor([len(p) - 1 + j for p, a in pairs for j in range(len(a))], device=dev)
        logp = self.model.logits(hidden[rows, cols]).float().log_softmax(-1)  # (answer tokens, V)
        picked = logp.gather(1, torch.tensor([t for _, a in pairs for t in a], device=dev)[:, None]).squeeze(1)
        return torch.zeros(n * L, device=dev).index_add_(0, rows, picked).view(n, L)


def make_reader(family: str, model, tokenizer, label_words):
    if family not in GENERATIVE:
        raise UserError(f"text-to-text needs a t5 or gpt run, not {family!r}")
    return (Seq2SeqReader if family == "t5" else DecoderReader)(model, tokenizer, label_words)


def fit_pair(reader, task: str, a: str, b: str, budget: int, cue: bool) -> list[int]:
    """The query's ids, the longer of a and b shortened word by word until it fits `budget` tokens."""
    while True:
        ids = reader.query(task, a, b, cue)
        wa, wb = a.split(), b.split()
        if len(ids) <= budget or (len(wa) <= 1 and len(wb) <= 1):
            return ids[-budget:]
        cut = max(1, len(ids) - budget)
        if len(wa) >= len(wb):
            a = " ".join(wa[: max(1, len(wa) - cut)])
        else:
            b = " ".join(wb[: max(1, len(wb) - cut)])


def k_shot(reader, demos: list[str], query_ids: list[int], budget: int) -> tuple[list[int], int]:
    """Demonstrations (nearest the question first) prepended while the prompt fits; -> (ids, shots used)."""
    ids, used = list(query_ids), 0
    for d in reversed(demos):
        d_ids = reader.tok.encode(d + "\n")
        if len(ids) + len(d_ids) > budget:
            break
        ids, used = d_ids + ids, used + 1
    return ids, used


def score_all(reader, prompt_ids: list[list[int]], batch_size: int = 16) -> np.ndarray:
    """(N, n_labels) answer log-probabilities, in batches of similar length."""
    was = reader.model.training
    reader.model.eval()
    order = np.argsort([len(p) for p in prompt_ids], kind="stable")
    out = np.zeros((len(prompt_ids), len(reader.answers)), dtype=np.float32)
    for i in range(0, len(order), batch_size):
        idx = order[i: i + batch_size]
        out[idx] = reader.scores([prompt_ids[j] for j in idx]).cpu().numpy()
    reader.model.train(was)
    return out


def budget(model, reader, max_length: int) -> int:
    """Most prompt tokens: the task's max_length, and for GPT room for the answer in the context."""
    if isinstance(reader, Seq2SeqReader):
        return max_length
    return min(max_length, model.cfg.max_seq_len - max(len(a) for a in reader.answers))


class ShuffledBatches:
    """Resumable training batches: a fresh seeded order every epoch."""

    def __init__(self, examples: list, collate, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.examples, self.collate = examples, collate
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.epoch, self.index = 0, 0

    def next_batch(self) -> dict[str, Tensor]:
        size = self.batch_size * self.world_size
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.examples))
        if (self.index + 1) * size > len(order):
            self.epoch, self.index = self.epoch + 1, 0
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.examples))
        start = self.index * size + self.rank * self.batch_size
        self.index += 1
        picked = [self.examples[i] for i in order[start: start + self.batch_size]]
        return self.collate([p for p, _ in picked], [y for _, y in picked])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def generative_family(path: Optional[Path]) -> Optional[str]:
    """'t5' or 'gpt' when `path` is a tfcli run (or checkpoint) of that family, else None."""
    from .. import checkpoint
    from .. import recipe as recipes

    if path is None or not Path(path).exists():
        return None
    try:
        config = checkpoint.run_dir_of(checkpoint.find(Path(path))) / "config.yaml"
    except UserError:
        return None
    if not config.is_file():
        return None
    family = recipes.load_resolved(config).model.family
    return family if family in GENERATIVE else None


def is_generative_run(path: Optional[Path]) -> bool:
    """Whether `path` is a tfcli run (or checkpoint) of a t5 or gpt model."""
    return generative_family(path) is not None


# --- finetune and evaluate --------------------------------------------------------------------

def _rows(task, data: str, split: str, limit: int) -> list:
    rows = task.load_split(data, split).rows
    rows = rows[:limit] if limit > 0 else rows
    if not rows:
        raise UserError(f"{task.name} {split}: no usable rows")
    return rows


def _default_data(task) -> str:
    """The task's own data source (its default recipe's task.data) for runs that name none."""
    from .. import recipe as recipes
    from .. import tasks

    return recipes.load(tasks.get(task.name).DEFAULT_RECIPE).task.data


def _tokens(batch: dict[str, Tensor]) -> int:
    """Tokens a training batch counts for: encoder and decoder tokens (T5) or the sequence (GPT)."""
    return int(batch["input_ids"].numel() + (batch["labels"].numel() if "labels" in batch else 0))


def _flops_per_token(family: str, model, examples: list, reader) -> float:
    """The pretraining objectives' FLOP counts at the mean prompt and answer lengths, for MFU."""
    prompt = int(np.mean([len(p) for p, _ in examples]))
    answer = int(np.mean([len(a) for a in reader.answers]))
    if family == "t5":
        return span_corruption.flops_per_token(model, prompt, answer)
    return next_token.flops_per_token(model, prompt + answer)


def finetune(task, recipe, from_: Optional[Path], out: Optional[Path] = None, quiet: bool = False) -> Path:
    """Text-to-text finetuning of a t5 or gpt run: the label word is the target; the dev splits are
    scored (label word with the highest log-probability) as training goes, the best kept."""
    from ..inference import load_run
    from ..objectives import Prepared
    from ..pretrain import open_run_dir
    from ..train import Evaluation, fit, setup_runtime, teardown

    tc, t = recipe.train, recipe.task
    rt = setup_runtime(tc.device, tc.threads)
    try:
        loaded = load_run(Path(from_))
        model, tok = loaded.model.train(), loaded.tokenizer
        family = loaded.recipe.model.family
        reader = make_reader(family, model, tok, task.labels)
        if recipe.model.family not in GENERATIVE:  # a BERT recipe (the task's default) lends its training settings
            recipe.name = f"{task.name}-{family}-text-to-text"
        recipe.model, recipe.tokenizer = loaded.recipe.model, loaded.recipe.tokenizer  # the run describes itself
        n_tokens = budget(model, reader, t.max_length)
        encode = lambda rows: [(fit_pair(reader, task.name, a, b, n_tokens, family == "gpt"), y)  # noqa: E731
                               for a, b, y in rows]
        train_ex = encode(_rows(task, t.data, task.train_split, t.limit))
        evals = {s: encode(_rows(task, t.data, s, t.eval_limit)) for s in task.eval_splits}
        if t.epochs > 0:
            tc.steps = max(1, math.ceil(t.epochs * len(train_ex) / (tc.batch_size * tc.grad_accum * rt.world_size)))
        if t.warmup_fraction > 0:
            recipe.schedule.warmup_steps = max(1, round(t.warmup_fraction * tc.steps))

        def run_eval(module) -> dict[str, float]:
            reader.model = module.model
            return {f"{s}_acc": float((score_all(reader, [p for p, _ in ex]).argmax(1) == [y for _, y in ex]).mean())
                    for s, ex in evals.items()}

        first = evals[task.eval_splits[0]]
        val = [reader.batch([p for p, _ in first[i: i + tc.batch_size]], [y for _, y in first[i: i + tc.batch_size]])
               for i in range(0, min(len(first), tc.batch_size * tc.eval_batches), tc.batch_size)]
        n_params = sum(p.numel() for p in model.parameters())
        prepared = Prepared(
            train=ShuffledBatches(train_ex, reader.batch, tc.batch_size, tc.seed, rt.rank, rt.world_size),
            val=lambda: iter(val), loss=reader.loss, items_per_batch=_tokens,
            flops_per_item=_flops_per_token(family, model, train_ex, reader), item_name="tok")
        run_dir = open_run_dir(recipe, out, rt, tok)
        if not quiet:
            from ..display import console

            console.print(f"[bold]{recipe.name}[/]: {task.name} text-to-text on a {n_params / 1e6:.2f}M-parameter "
                          f"{family} from {from_}, {tc.steps} steps, run directory [green]{run_dir}[/]")
        fit(model, prepared, recipe, run_dir, rt, evaluation=Evaluation(run_eval, task.best_key), quiet=quiet)
    finally:
        teardown(rt)
    return run_dir


def evaluate(task, checkpoint: Path, options) -> dict:
    """Accuracy of the highest-scoring label word on the eval splits, beside the majority-class
    baseline: a text-to-text finetuned run as it is, any t5/gpt run with --few-shot K (K >= 0)."""
    from ..display import console
    from ..inference import load_run

    loaded = load_run(Path(checkpoint), "best")
    family, finetuned = loaded.recipe.model.family, loaded.recipe.task.name == task.name
    k = options.few_shot
    if k < 0 and not finetuned:
        raise UserError(f"{loaded.checkpoint} was not finetuned on {task.name}; score it with --few-shot K "
                        f"(K solved examples in the prompt, 0 for none)")
    reader = make_reader(family, loaded.model, loaded.tokenizer, task.labels)
    cue = family == "gpt" or not finetuned
    data = options.data or loaded.recipe.task.data or _default_data(task)
    longest = loaded.model.cfg.max_seq_len
    if family == "t5":  # relative positions: k-shot prompts may outgrow the pretraining length
        longest = max(longest, T5_PROMPT_TOKENS)
    n_tokens = budget(loaded.model, reader, longest)
    demos = []
    if k > 0:
        train = _rows(task, data, task.train_split, 0)
        shots = prompts.balanced_shots([r[2] for r in train], k, len(task.labels), options.seed)
        demos = prompts.few_shot_prefix(task.name, train, shots, task.labels)
    if options.premise is not None:
        ids, _ = k_shot(reader, demos, fit_pair(reader, task.name, options.premise, options.hypothesis,
                                                n_tokens, cue), n_tokens)
        probs = torch.from_numpy(score_all(reader, [ids])[0]).softmax(-1)
        for name, p in zip(task.labels, probs.tolist()):
            console.print(f"{name:>14}  {p:.4f}")
        return {}
    results = {}
    for split in task.eval_splits:
        rows = _rows(task, data, split, options.limit)
        built = [k_shot(reader, demos, fit_pair(reader, task.name, a, b, n_tokens // 2 if demos else n_tokens, cue),
                        n_tokens) for a, b, _ in rows]
        gold = np.array([y for _, _, y in rows])
        pred = score_all(reader, [ids for ids, _ in built]).argmax(1)
        results[split] = {"n": len(rows), "acc": float((pred == gold).mean()),
                          "majority": prompts.majority_baseline(gold, len(task.labels)),
                          "shots": float(np.mean([used for _, used in built]))}
        r = results[split]
        console.print(f"{split}: accuracy {100 * r['acc']:.2f}% on {r['n']} rows (majority class "
                      f"{100 * r['majority']:.2f}%)" + (f", {r['shots']:.3g} of {k} shots fit in the context on average"
                                                        if k > 0 else ""))
    return results
