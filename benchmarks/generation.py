"""Greedy generation with a KV cache: tfcli against transformers' `generate` on the same weights.

A decoder (the GPT benchmark's config: 4 layers, width 256, vocab 50,257) and an encoder-decoder
(the T5 benchmark's config), batch 1, fp32, 2 threads. Both sides decode exactly `NEW` tokens
(no EOS stop) and must produce the same ids, which is checked before anything is timed.
"""
from __future__ import annotations

import torch

from benchmarks.common import hf_peer, interleaved, report
from tfcli.generate import generate_seq2seq, generate_tokens
from tfcli.models.gpt import GPT, GPTConfig
from tfcli.models.t5 import T5, T5Config

NEW, PROMPT = 128, 32


def same_ids(name: str, ours: list[int], theirs: list[int]) -> None:
    if ours != theirs:
        raise SystemExit(f"{name}: greedy ids differ at position "
                         f"{next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)}")


def decoder() -> None:
    import transformers

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=256, d_ff=1024, max_seq_len=512, vocab_size=50257, dropout=0.0)
    ours = GPT(cfg).eval()
    peer = hf_peer(transformers.GPT2LMHeadModel, ours).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT))

    def tfcli_ids():
        return list(generate_tokens(ours, prompt, max_new_tokens=NEW, temperature=0.0))

    @torch.no_grad()
    def hf_ids():
        out = peer.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW,
                            min_new_tokens=NEW, use_cache=True, pad_token_id=0)
        return out[0, PROMPT:].tolist()

    same_ids("gpt", tfcli_ids(), hf_ids())
    seconds = interleaved({"tfcli": tfcli_ids, "transformers": hf_ids}, rounds=5, warmup=1)
    report(f"gpt greedy generation ({PROMPT} prompt + {NEW} new tokens, batch 1, KV cache, fp32)", "tok", NEW,
           seconds, target=1.5)


def encoder_decoder() -> None:
    import transformers

    torch.manual_seed(0)
    cfg = T5Config(n_layer=4, n_decoder_layer=4, n_head=4, d_model=256, d_kv=64, d_ff=1024,
                   feed_forward="gated-gelu", dropout=0.0, max_seq_len=512, vocab_size=32128)
    ours = T5(cfg).eval()
    peer = hf_peer(transformers.T5ForConditionalGeneration, ours).eval()
    source = torch.randint(100, cfg.vocab_size - 100, (1, 114))

    def tfcli_ids():
        return list(generate_seq2seq(ours, source, start_id=0, max_new_tokens=NEW, temperature=0.0))

    @torch.no_grad()
    def hf_ids():
        out = peer.generate(source, attention_mask=torch.ones_like(source), do_sample=False, max_new_tokens=NEW,
                            min_new_tokens=NEW, use_cache=True, decoder_start_token_id=0, pad_token_id=0)
        return out[0, 1:].tolist()

    same_ids("t5", tfcli_ids(), hf_ids())
    seconds = interleaved({"tfcli": tfcli_ids, "transformers": hf_ids}, rounds=5, warmup=1)
    report(f"t5 greedy generation (114 source + {NEW} new tokens, batch 1, KV cache, fp32)", "tok", NEW,
           seconds, target=1.5)


def main() -> None:
    decoder()
    encoder_decoder()


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
