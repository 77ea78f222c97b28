"""T5 span-corruption training step vs transformers' T5ForConditionalGeneration, same config.

Config (issue 4): d_model 256, FFN 1024 (gated-GELU, T5 v1.1), 4+4 layers, 4 heads of 64,
vocabulary 32,128, encoder length 114, decoder length 32, batch 32, fp32, 2 threads, no dropout.
Batches are real span corruption of random token blocks (114 input tokens fill the encoder
exactly; the 26 target tokens are padded to 32 with ignored labels). Same weights, fused AdamW;
each side timed in a process of its own (common.isolated).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.common import Contenders, hf_peer, isolated, report, train_step
from tfcli.generate import generate_seq2seq
from tfcli.models.t5 import T5, T5Config
from tfcli.objectives import span_corruption as sc
from tfcli.objectives.losses import IGNORE

BATCH, ENCODER_LEN, DECODER_LEN, VOCAB = 32, 114, 32, 32128
CONFIG = dict(
    n_layer=4,
    n_decoder_layer=4,
    n_head=4,
    d_model=256,
    d_kv=64,
    d_ff=1024,
    feed_forward="gated-gelu",
    dropout=0.0,
    max_seq_len=512,
    vocab_size=VOCAB,
)


def span_batch(
    batch_size: int = BATCH, encoder_len: int = ENCODER_LEN, decoder_len: int = DECODER_LEN, vocab: int = VOCAB
) -> dict[str, torch.Tensor]:
    """Span corruption of random token blocks: input_ids (B, encoder_len), labels and decoder_input_ids
    (B, decoder_len), the targets padded with ignored labels (0: exactly the targets' length)."""
    raw_len, targets_len = sc.compute_input_and_target_lengths(encoder_len)
    rng = np.random.default_rng(0)
    raw = rng.integers(103, vocab - 100, size=(batch_size, raw_len))
    corruptor = sc.SpanCorruptor(np.arange(vocab - 1, vocab - 101, -1), eos_id=1, start_id=0)  # T5's sentinel ids
    batch = corruptor(raw, [rng] * batch_size)
    labels = torch.full((batch_size, decoder_len or targets_len), IGNORE, dtype=torch.long)
    labels[:, : batch["labels"].size(1)] = batch["labels"]
    return {"input_ids": batch["input_ids"], "labels": labels, "decoder_input_ids": sc.shift_right(labels, 0)}


def peer_loss(peer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """T5ForConditionalGeneration's loss on a span_batch (it shifts the labels right itself)."""
    return peer(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def models() -> tuple[T5, torch.nn.Module]:
    """tfcli's T5 (seed 0) and transformers' T5ForConditionalGeneration with its weights."""
    import transformers

    torch.manual_seed(0)
    ours = T5(T5Config(**CONFIG)).train()
    return ours, hf_peer(transformers.T5ForConditionalGeneration, ours).train()


def training() -> Contenders:
    batch = span_batch()

    def tfcli():
        torch.manual_seed(0)
        model = T5(T5Config(**CONFIG)).train()
        return train_step(
            lambda: sc.loss(model, None, batch)[0], torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        )

    def transformers():
        peer = models()[1]
        return train_step(lambda: peer_loss(peer, batch), torch.optim.AdamW(peer.parameters(), lr=1e-4, fused=True))

    return {"tfcli": tfcli, "transformers": transformers}


def main() -> None:
    ours, peer = models()
    batch = span_batch()
    with torch.no_grad():  # same weights, same batch: the same loss
        a = sc.loss(ours, None, batch)[0]
        b = peer_loss(peer, batch)
    print(f"t5 loss check: tfcli {float(a):.5f}, transformers {float(b):.5f}")
    seconds = isolated("t5:training", ["tfcli", "transformers"])
    report(
        f"t5 span-corruption train step (L4+4 d256 ff1024 h4 enc{ENCODER_LEN} dec{DECODER_LEN} b{BATCH} V{VOCAB} fp32)",
        "tok",
        BATCH * (ENCODER_LEN + DECODER_LEN),
        seconds,
    )
    generation(ours.eval(), batch["input_ids"][:1])


def generation(model: T5, prompt: torch.Tensor, new_tokens: int = 64) -> None:
    """Greedy decoding speed after one encoding, with and without the KV cache."""
    rates = {}
    for use_cache in (True, False):
        t0 = time.perf_counter()
        n = sum(
            1
            for _ in generate_seq2seq(
                model, prompt, start_id=0, max_new_tokens=new_tokens, temperature=0.0, use_cache=use_cache
            )
        )
        rates[use_cache] = n / (time.perf_counter() - t0)
    print(
        f"t5 generation: {rates[True]:,.1f} tok/s with the KV cache, {rates[False]:,.1f} tok/s without "
        f"({rates[True] / rates[False]:.1f}x)"
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
