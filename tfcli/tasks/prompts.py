"""Classification as text: the prompt a generative model reads, the label word it answers, and
k-shot prompts (k solved training examples, balanced over the labels and seeded).

Pure string functions, no tokenizer: the same text serves T5 (encoder input, label word as the
target) and GPT (label word as the continuation after "answer:").
"""

from __future__ import annotations

import numpy as np

SENTINEL = "<extra_id_0>"  # a span-corruption T5 answers a prompt ending in a sentinel


def input_text(task: str, fields: tuple[str, ...], texts: tuple[str, ...]) -> str:
    """'mnli premise: <a> hypothesis: <b>' (T5's text-to-text format), one 'field: text' per field."""
    return " ".join([task] + [f"{f}: {t}" for f, t in zip(fields, texts)])


def question(task: str, fields: tuple[str, ...], texts: tuple[str, ...]) -> str:
    """The input followed by the cue whose answer is the label word."""
    return f"{input_text(task, fields, texts)} answer:"


def demonstration(task: str, fields: tuple[str, ...], texts: tuple[str, ...], label: str) -> str:
    """A solved example for a k-shot prompt."""
    return f"{question(task, fields, texts)} {label}"


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


def few_shot_prefix(
    task: str, fields: tuple[str, ...], rows: list, shots: list[int], label_words: tuple[str, ...]
) -> list[str]:
    """The demonstrations of a k-shot prompt, one string each (they are joined with newlines)."""
    return [demonstration(task, fields, rows[i][0], label_words[rows[i][1]]) for i in shots]
