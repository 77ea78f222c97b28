"""GPT training step vs transformers' GPT2LMHeadModel at the same config, and generation speed.

Config (issue 2): 4 layers, width 256, 4 heads, context 256, batch 16, vocab 50257, fp32,
2 threads, no dropout. Both sides use the same weights and torch's fused AdamW; each is timed in
a process of its own (common.isolated).
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import Contenders, hf_peer, isolated, report, train_step
from tfcli.generate import generate_tokens
from tfcli.models.gpt import GPT, GPTConfig
from tfcli.objectives.next_token import loss as next_token_loss

BATCH, CONTEXT = 16, 256
CONFIG = GPTConfig(n_layer=4, n_head=4, d_model=256, d_ff=1024, max_seq_len=CONTEXT, vocab_size=50257, dropout=0.0)


def peer_loss(peer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """GPT2LMHeadModel's next-token loss (it shifts the labels itself)."""
    return peer(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def training() -> Contenders:
    torch.manual_seed(0)
    block = torch.randint(0, CONFIG.vocab_size, (BATCH, CONTEXT + 1))
    batch = {"input_ids": block[:, :-1], "targets": block[:, 1:]}

    def tfcli():
        torch.manual_seed(1)
        ours = GPT(CONFIG).train()
        return train_step(
            lambda: next_token_loss(ours, None, batch)[0], torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=True)
        )

    def transformers():
        import transformers

        torch.manual_seed(1)
        peer = hf_peer(transformers.GPT2LMHeadModel, GPT(CONFIG)).train()
        return train_step(lambda: peer_loss(peer, batch), torch.optim.AdamW(peer.parameters(), lr=1e-4, fused=True))

    return {"tfcli": tfcli, "transformers": transformers}


def main() -> None:
    seconds = isolated("gpt:training", ["tfcli", "transformers"], warmup=3, steps=8)
    report("gpt train step (L4 d256 h4 ctx256 b16 V50257 fp32)", "tok", BATCH * CONTEXT, seconds)
    torch.manual_seed(0)
    generation(GPT(CONFIG).eval())


def generation(model: GPT, new_tokens: int = 200) -> None:
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 16))
    rates = {}
    for use_cache in (True, False):
        t0 = time.perf_counter()
        n = sum(
            1 for _ in generate_tokens(model, prompt, max_new_tokens=new_tokens, temperature=0.0, use_cache=use_cache)
        )
        rates[use_cache] = n / (time.perf_counter() - t0)
    print(
        f"gpt generation: {rates[True]:,.1f} tok/s with the KV cache, {rates[False]:,.1f} tok/s without "
        f"({rates[True] / rates[False]:.1f}x)"
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
