"""Benchmark metrics as lm-evaluation-harness computes them, and its `results` layout.

acc: the choice with the highest log-likelihood is the answer; acc_norm: the highest log-likelihood
divided by the choice's length in characters (the choice's text, without the delimiter). Each with
its standard error: the sample standard deviation over questions / sqrt(n). A benchmark with subjects
reports each subject, each category and the whole, averaged over questions (lm-evaluation-harness's
weight_by_size) and, as `acc_subjects`, over subjects.
"""

from __future__ import annotations

import math
from collections import defaultdict

from .loglik import Score


def stderr(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return float("nan")
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def per_question(questions, scores: list[Score]) -> list[dict]:
    """Each question's log-likelihoods, its predictions and whether they are right."""
    lls = defaultdict(dict)
    for s in scores:
        lls[s.question][s.choice] = s.loglikelihood
    out = []
    for q, question in enumerate(questions):
        ll = [lls[q][c] for c in range(len(question.choices))]
        normed = [v / len(text) for v, text in zip(ll, question.choices)]
        pred, pred_norm = max(range(len(ll)), key=ll.__getitem__), max(range(len(ll)), key=normed.__getitem__)
        out.append(
            {
                "gold": question.gold,
                "loglikelihoods": ll,
                "pred": pred,
                "pred_norm": pred_norm,
                "acc": float(pred == question.gold),
                "acc_norm": float(pred_norm == question.gold),
            }
        )
    return out


def metrics(rows: list[dict]) -> dict[str, float]:
    """lm-evaluation-harness's keys: `acc,none`, `acc_stderr,none`, `acc_norm,none`, ..."""
    out = {}
    for name in ("acc", "acc_norm"):
        values = [r[name] for r in rows]
        out[f"{name},none"] = sum(values) / len(values) if values else float("nan")
        out[f"{name}_stderr,none"] = stderr(values)
    return out


def grouped(name: str, parts: dict[str, list[dict]], categories: dict[str, str]) -> dict[str, dict]:
    """The results of a benchmark with subjects: each subject, each category and the whole (over
    questions, and `acc_subjects` over subjects)."""
    results = {part: {"alias": f"  - {part}", **metrics(rows)} for part, rows in parts.items()}
    by_category = defaultdict(list)
    for part, rows in parts.items():
        by_category[categories[part]].append(part)
    for category, members in sorted(by_category.items()):
        rows = [r for m in members for r in parts[m]]
        results[f"{name}_{category}"] = {"alias": f" - {category}", **metrics(rows)}
    every = [r for rows in parts.values() for r in rows]
    whole = {"alias": name, **metrics(every)}
    for metric in ("acc", "acc_norm"):
        means = [results[p][f"{metric},none"] for p in parts]
        whole[f"{metric}_subjects,none"] = sum(means) / len(means)
    results[name] = whole
    return results


def task_results(name: str, report: dict) -> dict:
    """A task's own report (gsm8k's exact match, mnli's accuracy: split -> metrics) in the same layout,
    so one results file holds the tasks and the benchmarks of one `tfcli eval a,b,c`."""
    splits = {k: v for k, v in report.items() if isinstance(v, dict)}
    out = {}
    for split, metrics in splits.items():
        key = name if len(splits) == 1 else f"{name}_{split}"
        numbers = {
            f"{m},none": v for m, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        out[key] = {"alias": key, **numbers}
    return out
