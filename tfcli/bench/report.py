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

SECTIONS = ("results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")
METRIC_LIST = [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")]


def sections() -> dict[str, dict]:
    """lm-evaluation-harness's results file, empty: each section maps a task (or group) to its part."""
    return {k: {} for k in SECTIONS}


def joined(*parts: dict) -> dict[str, dict]:
    out = sections()
    for part in parts:
        for key in SECTIONS:
            out[key].update(part.get(key, {}))
    return out


def stderr(values: list[float]):
    """The sample standard deviation over questions / sqrt(n); "N/A" for fewer than two, as lm-eval writes."""
    n = len(values)
    if n < 2:
        return "N/A"
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def per_question(questions, scores: list[Score]) -> list[dict]:
    """Each question's log-likelihoods, its predictions and whether they are right."""
    lls, greedy = defaultdict(dict), defaultdict(dict)
    for s in scores:
        lls[s.question][s.choice], greedy[s.question][s.choice] = s.loglikelihood, s.greedy
    out = []
    for q, question in enumerate(questions):
        ll = [lls[q][c] for c in range(len(question.choices))]
        normed = [v / len(text) for v, text in zip(ll, question.choices)]
        pred, pred_norm = max(range(len(ll)), key=ll.__getitem__), max(range(len(ll)), key=normed.__getitem__)
        out.append(
            {
                "gold": question.gold,
                "loglikelihoods": ll,
                "greedy": [greedy[q][c] for c in range(len(question.choices))],
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
        out[f"{name},none"] = sum(values) / len(values) if values else "N/A"
        out[f"{name}_stderr,none"] = stderr(values)
    return out


def benchmark(bench, rows: dict[str, list[dict]], original: dict[str, int], few_shot: int) -> dict[str, dict]:
    """One benchmark's sections (its subjects, their categories and the whole for one with subjects):
    results, configs, versions, n-shot, higher_is_better and n-samples as lm-evaluation-harness writes them."""
    parts = {p.name: p for p in bench.parts if p.name in rows}
    if bench.subjects and not bench.subject:
        results = grouped(bench.name, rows, {f"{bench.name}_{s}": c for s, c in bench.subjects.items()})
        groups = sorted({c for c in bench.subjects.values()})
        subtasks = {bench.name: [f"{bench.name}_{c}" for c in groups]}
        subtasks.update(
            {
                f"{bench.name}_{c}": [n for n in parts if results.get(n) and bench.subjects[parts[n].subject] == c]
                for c in groups
            }
        )
    else:
        results, subtasks = {bench.name: {"alias": bench.name, **metrics(rows[bench.name])}}, {bench.name: []}
    return {
        "results": results,
        "group_subtasks": subtasks,
        "configs": {n: config(p, few_shot) for n, p in parts.items()},
        "versions": {n: bench.version for n in results},
        "n-shot": {n: few_shot for n in parts},
        "higher_is_better": {n: {"acc": True, "acc_norm": True} for n in results},
        "n-samples": {n: {"original": original[n], "effective": len(rows[n])} for n in parts},
    }


def config(part, few_shot: int) -> dict:
    """A benchmark's task config in lm-evaluation-harness's fields (its YAML, as it was scored)."""
    return {
        "task": part.name,
        "output_type": "multiple_choice",
        "test_split": part.split,
        "fewshot_split": part.fewshot_split or None,
        "doc_to_text": part.context,
        "doc_to_choice": list(part.choices),
        "doc_to_target": part.answer,
        "description": part.description,
        "target_delimiter": part.target_delimiter,
        "fewshot_delimiter": part.fewshot_delimiter,
        "num_fewshot": few_shot,
        "metric_list": METRIC_LIST,
        "metadata": {"version": part.version},
    }


def samples(questions, rows: list[dict]) -> list[dict]:
    """Each question as lm-evaluation-harness's --log_samples writes it: the row, the target, each
    choice's (context, continuation), its (log-likelihood, is greedy), and the question's metrics."""
    return [
        {
            "doc_id": i,
            "doc": q.doc,
            "target": q.gold,
            "arguments": [[q.context, q.delimiter + c] for c in q.choices],
            "resps": [[[ll, greedy]] for ll, greedy in zip(r["loglikelihoods"], r["greedy"])],
            "filtered_resps": [[ll, greedy] for ll, greedy in zip(r["loglikelihoods"], r["greedy"])],
            "acc": r["acc"],
            "acc_norm": r["acc_norm"],
        }
        for i, (q, r) in enumerate(zip(questions, rows))
    ]


def grouped(name: str, parts: dict[str, list[dict]], categories: dict[str, str]) -> dict[str, dict]:
    """The results of a benchmark with subjects: each subject, each category and the whole (over
    questions, and `acc_subjects` over subjects)."""
    results = {part: {"alias": f"  - {part}", **metrics(rows)} for part, rows in parts.items()}
    by_category = defaultdict(list)
    for part in parts:
        by_category[categories[part]].append(part)
    for category, members in sorted(by_category.items()):
        rows = [r for m in members for r in parts[m]]
        results[f"{name}_{category}"] = {"alias": f" - {category}", **metrics(rows)}
    every = [r for rows in parts.values() for r in rows]
    whole = {"alias": name, **metrics(every)}
    for metric in ("acc", "acc_norm"):
        means = [results[p][f"{metric},none"] for p in parts if isinstance(results[p][f"{metric},none"], float)]
        whole[f"{metric}_subjects,none"] = sum(means) / len(means) if means else "N/A"
    results[name] = whole
    return results


FILTERS = {"exact_match": "flexible-extract", "strict_exact_match": "strict-match"}  # GSM8K's, as lm-eval names them
SHARES = ("acc", "exact_match", "strict_exact_match", "contains_match")  # means of a 0/1 score per question
LOWER_IS_BETTER = ("loss", "ppl")


def task_results(name: str, report: dict, few_shot: int = 0) -> dict[str, dict]:
    """A task's own report (gsm8k's exact match, mnli's accuracy: split -> metrics) as the sections of
    lm-evaluation-harness's results, so one file holds the tasks and the benchmarks of `tfcli eval
    a,b,c`. GSM8K's final-number scores are its filters: exact_match,flexible-extract (the final number,
    after '####' where the reply wrote one) and exact_match,strict-match (only '#### N' counts)."""
    splits = {k: v for k, v in report.items() if isinstance(v, dict)}
    out = sections()
    for split, scored in splits.items():
        key = name if len(splits) == 1 else f"{name}_{split}"
        n = int(scored.get("generated") or scored.get("n") or 0)
        gsm8k = scored.get("metric") == "final-number"
        numbers = {}
        for m, v in scored.items():
            if m in ("n", "generated") or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            metric, where = ("exact_match", FILTERS[m]) if gsm8k and m in FILTERS else (m, "none")
            numbers[f"{metric},{where}"] = v
            if m in SHARES:  # a mean of 0/1 scores: its standard error from the mean alone
                numbers[f"{metric}_stderr,{where}"] = math.sqrt(v * (1 - v) / (n - 1)) if n > 1 else "N/A"
        out["results"][key] = {"alias": key, **numbers}
        out["group_subtasks"][key] = []
        metrics = sorted({k.split(",")[0] for k in numbers if "_stderr" not in k})
        out["higher_is_better"][key] = {m: m not in LOWER_IS_BETTER for m in metrics}
        out["n-samples"][key] = {"original": n, "effective": n}
        out["n-shot"][key] = few_shot
        out["versions"][key] = 1.0
        out["configs"][key] = {
            "task": key,
            "output_type": "generate_until" if "generated" in scored else "multiple_choice",
            "test_split": split,
            "num_fewshot": few_shot,
            "metric_list": [
                {"metric": m, "aggregation": "mean", "higher_is_better": m not in LOWER_IS_BETTER} for m in metrics
            ],
            **({"filter_list": [{"name": f} for f in ("strict-match", "flexible-extract")]} if gsm8k else {}),
            "metadata": {"version": 1.0},
        }
    return out
