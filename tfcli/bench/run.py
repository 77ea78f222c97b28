"""`tfcli eval piqa,mmlu --checkpoint M`: every named benchmark scored on one model, printed as a
table and written as JSON in lm-evaluation-harness's layout (results, n-samples, config), so tools that
read its output read tfcli's."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ..display import console, phase
from ..errors import UserError
from ..models import kinds
from . import loglik, report, spec


@dataclass(frozen=True)
class BenchRequest:
    names: list[str]
    checkpoint: Path
    data: str | None = None
    few_shot: int = 0
    limit: int = 0
    batch_size: int = 16  # 0: auto, the largest the free memory holds (loglik.auto_batch_size)
    out: Path | None = None
    device: str = "cpu"
    quiet: bool = False
    tasks: dict | None = None  # results of tasks scored alongside (gsm8k, mnli), in the same layout
    log_samples: bool = False  # every question's log-likelihoods and prediction, a file per benchmark


def plan(req: BenchRequest) -> list:
    """Every benchmark's questions, read and checked before anything is scored or written:
    [(benchmark, [(part, questions, rows in its split)])]."""
    out = []
    for b in [spec.load(n) for n in req.names]:
        root = spec.data_root(b, req.data)
        parts = []
        for part in b.parts:
            questions = spec.questions(part, root, req.few_shot, req.limit)
            parts.append(
                (part, questions, len(spec.read_rows(part, root, part.split)) if req.limit else len(questions))
            )
        out.append((b, parts))
    return out


@dataclass
class Prepared:
    """Every benchmark of a request read, encoded for its model and checked to fit: nothing left to fail
    but scoring."""

    backbone: object
    scored: list  # (benchmark, [(part, questions, requests)])
    original: dict  # part -> the rows of its split (before --limit)


def prepare(req: BenchRequest, jobs: list | None = None) -> Prepared:
    """The model read and every benchmark's questions encoded and checked against it (a decoder or an
    encoder-decoder; no question longer than its positions), before anything is scored or written."""
    from ..engine.backbone import for_inference

    jobs = plan(req) if jobs is None else jobs
    backbone = for_inference(req.checkpoint, device=req.device)
    model, tok = backbone.model, backbone.tokenizer
    if model.kind not in kinds.GENERATIVE:
        raise UserError(
            f"{req.checkpoint} holds a {model.kind} ({backbone.family}); benchmarks score the "
            f"log-likelihood of each choice, which needs a decoder or an encoder-decoder"
        )
    scored = []
    for bench, parts in jobs:
        part_requests = [(part, qs, loglik.requests(tok, qs, part.target_delimiter)) for part, qs, _ in parts]
        every = [r for _, _, reqs in part_requests for r in reqs]
        loglik.check_fits(model, every, bench.name, "fewer --few-shot, or a model with a longer context")
        scored.append((bench, part_requests))
    return Prepared(backbone, scored, {part.name: n for _, parts in jobs for part, _, n in parts})


def run(req: BenchRequest, prepared: Prepared | None = None) -> dict:
    """Check every benchmark's files and sizes first (prepare), then score; nothing is written on an error."""
    prepared = prepare(req) if prepared is None else prepared
    model, scored = prepared.backbone.model, prepared.scored
    pad = type(model).pad_id(prepared.backbone.tokenizer)
    batch_size = req.batch_size or loglik.auto_batch_size(model, [r for _, p in scored for _, _, rs in p for r in rs])
    scored_sections, logged, started = [], {}, time.time()
    for bench, part_requests in scored:
        total = sum(len(q) for _, q, _ in part_requests)
        rows = {}
        with phase(f"{bench.name}: scoring", total=total, unit="questions") as advance:
            for part, qs, reqs in part_requests:
                per_choice = len(reqs) / max(len(qs), 1)
                scores, batch_size = _score(model, reqs, pad, batch_size, not req.batch_size, advance, per_choice)
                rows[part.name] = report.per_question(qs, scores)
                logged[part.name] = report.samples(qs, rows[part.name])
        scored_sections.append(report.benchmark(bench, rows, prepared.original, req.few_shot))
    payload = report.joined(req.tasks or {}, *scored_sections)
    payload["config"] = {
        "model": str(req.checkpoint),
        "num_fewshot": req.few_shot,
        "limit": req.limit or None,
        "batch_size": req.batch_size or "auto",
        "batch_sizes": [batch_size],
        "device": req.device,
        "seconds": round(time.time() - started, 1),
    }
    out = req.out or _default_out(req)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    written = [out]
    if req.log_samples:  # lm-eval's --log_samples: a file of every question of each task beside the results
        for name, lines in logged.items():
            path = out.with_name(f"{out.stem}_samples_{name}.jsonl")
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            written.append(path)
    if not req.quiet:
        show({k: v for s in scored_sections for k, v in s["results"].items()}, req.names)
        console.print(
            f"wrote {', '.join(map(str, written[:3]))}" + (f" and {len(written) - 3} more" if len(written) > 3 else "")
        )
    return payload


def _score(model, reqs, pad: int, batch_size: int, auto: bool, advance, per_choice: float):
    """Score one part; out of memory, `auto` halves the batch and starts the part again (as
    lm-evaluation-harness's auto does), a given batch size is one line naming it."""
    import torch

    while True:
        done = 0

        def step(n):
            nonlocal done
            done += n
            advance(n / per_choice)

        try:
            return loglik.score(model, reqs, pad, batch_size, step), batch_size
        except torch.OutOfMemoryError:
            advance(-done / per_choice)
            if not auto or batch_size == 1:
                raise UserError(
                    f"out of memory scoring {batch_size} rows at once; give a smaller --batch-size"
                ) from None
            batch_size //= 2
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _default_out(req: BenchRequest) -> Path:
    from ..engine import model_source

    name = f"eval-{'-'.join(Path(n).stem for n in req.names)}{f'-{req.few_shot}shot' if req.few_shot else ''}.json"
    source = model_source.local(req.checkpoint)
    return source.run_dir / name if source is not None and source.run_dir is not None else Path(name)


def show(results: dict, names: list[str]) -> None:
    from rich.table import Table

    table = Table("benchmark", "acc", "±", "acc_norm", "±")
    for r in results.values():
        if r["alias"].startswith("  - ") and len(results) > 12:
            continue  # subjects of a whole benchmark: in the JSON, not on the screen
        table.add_row(
            r["alias"], *(_pct(r[k]) for k in ("acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"))
        )
    console.print(table)


def _pct(value) -> str:
    return f"{100 * value:.2f}" if isinstance(value, (int, float)) else str(value)
