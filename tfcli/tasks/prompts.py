"""Sentence-pair tasks as text: the prompt a generative model reads, the label word it answers,
and k-shot prompts (k solved training examples, balanced over the labels and seeded).

Pure string functions, no tokenizer: the same text serves T5 (encoder input, label word as the
target) and GPT (label word as the continuation after "answer:").
"""
from __future__ import annotations

import numpy as np

FIELDS = {"mnli": ("premise", "hypothesis")}  # how each task names its two texts in the prompt
SENTINEL = "<extra_id_0>"  # a span-corruption T5 answers a prompt ending in a sentinel


def pair_text(task: str, a: str, b: str) -> str:
    """'mnli premise: <a> hypothesis: <b>' (T5's text-to-text MNLI format)."""
    first, second = FIELDS.get(task, ("sentence1", "sentence2"))
    return f"{task} {first}: {a} {second}: {b}"


def question(task: str, a: str, b: str) -> str:
    """The pair followed by the cue whose answer is the label word."""
    return f"{pair_text(task, a, b)} answer:"


def demonstration(task: str, a: str, b: str, label: str) -> str:
    """A solved example for a k-shot prompt."""
    return f"{question(task, a, b)} {label}"


def balanced_shots(labels: list[int], k: int, n_labels: int, seed: int) -> list[int]:
    """Indices of k training rows: k // n_labels of each label (the remainder to labels picked at
    random), drawn at random without replacement and shuffled; the same for the same seed."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    per = np.full(n_labels, k // n_labels)
    per[rng.permutation(n_labels)[: k % n_labels]] += 1
    picked = []
    for label, count in enumerate(per):
        pool = np.flatnonzero(labels == label)
        if len(pool) < count:
            raise ValueError(f"only {len(pool)} training rows of label {label}, {count} needed")
        picked += rng.choice(pool, size=count, replace=False).tolist()
    return [picked[i] for i in rng.permutation(len(picked))]


def few_shot_prefix(task: str, rows: list, shots: list[int], label_words: tuple[str, ...]) -> list[str]:
    """The demonstrations of a k-shot prompt, one string each (they are joined with newlines)."""
    return [demonstration(task, rows[i][0], rows[i][1], label_words[rows[i][2]]) for i in shots]


def majority_baseline(gold: np.ndarray, n_labels: int) -> float:
    """Accuracy of always answering the split's most frequent label."""
    return float(np.bincount(gold, minlength=n_labels).max() / max(len(gold), 1))
