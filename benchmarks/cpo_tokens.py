"""What CPO trains on each side (issue 73): the reply tokens tfcli's pairs train and CPOTrainer's
labels (TRL 1.16, its legacy tokenization) on the reference_free benchmark's first HH pairs, counted
pair by pair; explains CPO's per-step loss gap in that benchmark (docs/results/measured.md).

    python -m benchmarks cpo_tokens      (BENCH_CPO_PAIRS, default 32)
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.dpo import data_file, pair_builder
from benchmarks.smollm2 import gguf_file
from benchmarks.trl_peer import missing, plain_copy

PAIRS = int(os.environ.get("BENCH_CPO_PAIRS", 32))


def main() -> None:
    if why := missing("cpo_tokens"):
        print(why)
        return
    import datasets
    import torch
    import transformers
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    from tfcli.data.preferences import PairFields, split_pair

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = [json.loads(line) for line in data_file(tmp).read_text().splitlines()][:PAIRS]
        build = pair_builder()
        ours = [build.pair(r) for r in rows]
        plain = plain_copy(gguf_file(), tmp / "smollm2-hf")
        tokenizer = transformers.AutoTokenizer.from_pretrained(plain)
        model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
        turn = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
        split = [split_pair(r, PairFields()) for r in rows]
        dataset = datasets.Dataset.from_list(
            [{"prompt": p, "chosen": turn(c), "rejected": turn(j)} for p, c, j in split]
        )
        args = CPOConfig(output_dir=str(tmp / "trl"), report_to=[], use_cpu=True, loss_type="sigmoid", cpo_alpha=1.0)
        labelled = CPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train_dataset
    extra, prefix, tails = Counter(), 0, Counter()
    for i, pair in enumerate(ours):
        for side in ("chosen", "rejected"):
            mine = getattr(pair, side)
            mine = mine.ids[mine.trained > 0].tolist()
            theirs = [t for t in labelled[i][f"{side}_labels"] if t != -100]
            extra[len(theirs) - len(mine)] += 1
            prefix += theirs[: len(mine)] == mine
            tails[repr(tokenizer.decode(theirs[len(mine) :]))] += 1
    print(
        f"cpo tokens ({PAIRS} HH pairs, {2 * PAIRS} replies): TRL's CPOTrainer trains (extra tokens: replies) "
        f"{dict(extra)} beyond tfcli's; tfcli's a prefix of TRL's in {prefix}; TRL's extra text {dict(tails)}"
    )
