"""Greedy generation with a KV cache: tfcli against transformers' `generate` on the same weights.

A decoder (the GPT benchmark's config: 4 layers, width 256, vocab 50,257) and an encoder-decoder
(the T5 benchmark's config), batch 1, fp32, 2 threads; on a CUDA device as well when there is one.
Both sides decode exactly `NEW` tokens (no EOS stop) and must produce the same ids, which is checked
before anything is timed; then each side is timed in a process of its own (common.isolated), one
step = one whole generation.
"""

from __future__ import annotations

import torch

from benchmarks.common import Contenders, hf_peer, isolated, report
from tfcli.generate import generate_seq2seq, generate_tokens
from tfcli.models.gpt import GPT, GPTConfig
from tfcli.models.t5 import T5, T5Config

NEW, PROMPT = 128, 32
GPT_CONFIG = GPTConfig(n_layer=4, n_head=4, d_model=256, d_ff=1024, max_seq_len=512, vocab_size=50257, dropout=0.0)
T5_CONFIG = T5Config(
    n_layer=4,
    n_decoder_layer=4,
    n_head=4,
    d_model=256,
    d_kv=64,
    d_ff=1024,
    feed_forward="gated-gelu",
    dropout=0.0,
    max_seq_len=512,
    vocab_size=32128,
)


@torch.no_grad()
def greedy_ids(peer, inputs: torch.Tensor, new: int, keep_from: int, **extra) -> list[list[int]]:
    """transformers' generate: exactly `new` greedy tokens per row (no EOS stop), with its cache ->
    each row's ids from `keep_from` (a decoder's prompt length; 1 past an encoder-decoder's start)."""
    out = peer.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        use_cache=True,
        pad_token_id=0,
        **extra,
    )
    return out[:, keep_from:].tolist()


def hf_generate(class_name: str, ours: torch.nn.Module, inputs: torch.Tensor, keep_from: int, **extra):
    """transformers' generate on `ours`' weights: exactly NEW greedy tokens with its cache -> their ids."""
    import transformers

    device = inputs.device
    peer = hf_peer(getattr(transformers, class_name), ours.cpu()).eval().to(device)
    ours.to(device)
    return lambda: greedy_ids(peer, inputs, NEW, keep_from, **extra)[0]


def decoder(device: str = "cpu") -> Contenders:
    torch.manual_seed(0)
    ours = GPT(GPT_CONFIG).eval().to(device)
    prompt = torch.randint(0, GPT_CONFIG.vocab_size, (1, PROMPT)).to(device)
    return {
        "tfcli": lambda: lambda: list(generate_tokens(ours, prompt, max_new_tokens=NEW, temperature=0.0)),
        "transformers": lambda: hf_generate("GPT2LMHeadModel", ours, prompt, PROMPT),
    }


def encoder_decoder(device: str = "cpu") -> Contenders:
    torch.manual_seed(0)
    ours = T5(T5_CONFIG).eval().to(device)
    source = torch.randint(100, T5_CONFIG.vocab_size - 100, (1, 114)).to(device)
    return {
        "tfcli": lambda: lambda: list(generate_seq2seq(ours, source, start_id=0, max_new_tokens=NEW, temperature=0.0)),
        "transformers": lambda: hf_generate("T5ForConditionalGeneration", ours, source, 1, decoder_start_token_id=0),
    }


def decoder_cuda() -> Contenders:
    return decoder("cuda")


def encoder_decoder_cuda() -> Contenders:
    return encoder_decoder("cuda")


def same_ids(name: str, contenders: Contenders) -> None:
    ours, theirs = contenders["tfcli"]()(), contenders["transformers"]()()
    if ours != theirs:
        raise SystemExit(
            f"{name}: greedy ids differ at position {next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)}"
        )


def main() -> None:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        where = "" if device == "cpu" else f", {torch.cuda.get_device_name()}"
        suffix = "" if device == "cpu" else "_cuda"
        for name, builders, what in (("gpt", "decoder", f"{PROMPT} prompt"), ("t5", "encoder_decoder", "114 source")):
            same_ids(f"{name} on {device}", globals()[builders + suffix]())
            seconds = isolated(f"generation:{builders}{suffix}", ["tfcli", "transformers"], warmup=1, steps=5)
            report(
                f"{name} greedy generation ({what} + {NEW} new tokens, batch 1, KV cache, fp32{where})",
                "tok",
                NEW,
                seconds,
                target=1.5,
            )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
