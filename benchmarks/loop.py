"""Loop overhead: a whole `tfcli pretrain` step against the bare model step, gpt-mini on the built-in
corpus, in one process, interleaved round by round.

- whole: `tfcli pretrain --recipe gpt-mini` through the driver (batches from the token store, the
  prefetch thread, device-side metrics read once per log, metrics.jsonl). Its time per step is the
  difference of `elapsed_s` between the first and the last log line, so set-up, evaluation and the
  final checkpoint are left out and everything that happens every step is in.
- bare: the same model shape and batch shape, forward + backward + clip + fused AdamW on batches
  built beforehand.

Run with train.prefetch 0 and 2, which also decides prefetch's default on the CPU.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS
from tfcli import recipe as recipes
from tfcli.driver import RunRequest, train
from tfcli.models.gpt import GPT
from tfcli.objectives.next_token import loss as next_token_loss

STEPS, LOG_EVERY, ROUNDS = 120, 20, 2


def whole_step_seconds(prefetch: int, workdir: Path) -> float:
    rec = recipes.load(
        "gpt-mini",
        {
            "train.steps": STEPS,
            "train.log_interval": LOG_EVERY,
            "train.eval_interval": STEPS,
            "train.ckpt_interval": STEPS,
            "train.prefetch": prefetch,
            "train.device": "cpu",
            "train.threads": 2,
        },
    )
    run, _ = train(RunRequest(rec, out=workdir / f"prefetch{prefetch}-{time.monotonic_ns()}", quiet=True))
    logs = [m for m in read_metrics(run) if m.get("split") == "train"]
    first, last = logs[0], logs[-1]
    return (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def bare_step_seconds(run_config: Path) -> float:
    cfg = recipes.load_resolved(run_config)
    torch.manual_seed(0)
    model = GPT(cfg.model).train()
    b, t = cfg.train.batch_size, cfg.data.seq_len
    blocks = [torch.randint(0, cfg.model.vocab_size, (b, t + 1)) for _ in range(8)]
    batches = [{"input_ids": x[:, :-1], "targets": x[:, 1:]} for x in blocks]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=cfg.optim.betas, weight_decay=0.1, fused=True)

    def step(batch):
        loss, _ = next_token_loss(model, None, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(5):
        step(batches[i % len(batches)])
    n = STEPS - LOG_EVERY
    t0 = time.perf_counter()
    for i in range(n):
        step(batches[i % len(batches)])
    return (time.perf_counter() - t0) / n


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        times: dict[str, list[float]] = {"prefetch 2": [], "prefetch 0": [], "bare": []}
        config = None
        for _ in range(ROUNDS):
            times["prefetch 2"].append(whole_step_seconds(2, work))
            times["prefetch 0"].append(whole_step_seconds(0, work))
            config = config or next(work.glob("prefetch*/config.yaml"))
            times["bare"].append(bare_step_seconds(config))
    med = {k: statistics.median(v) for k, v in times.items()}
    bare = med["bare"]
    for name in ("prefetch 0", "prefetch 2"):
        overhead = med[name] / bare - 1
        verdict = "meets" if overhead < 0.05 else "MISSES"
        print(
            f"loop overhead, gpt-mini, {name}: whole step {1e3 * med[name]:.1f} ms, bare step "
            f"{1e3 * bare:.1f} ms, overhead {100 * overhead:+.1f}% ({verdict} the <5% target)"
        )
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "benchmark": "loop overhead (gpt-mini)",
                    "unit": "s/step",
                    **{k: round(v, 5) for k, v in med.items()},
                    "rounds": {k: [round(x, 5) for x in v] for k, v in times.items()},
                }
            )
            + "\n"
        )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
