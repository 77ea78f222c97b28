"""Every architecture tfcli exports to GGUF, loaded by llama.cpp itself (issue 69): a tiny random model
that transformers writes, read by tfcli, exported with `tfcli export --gguf` (f32), then opened with
llama-cpp-python and asked for 12 greedy tokens after a 6-token prompt, against transformers'
`generate` on the same weights, and for the prompt's logits (the largest difference from
transformers', against the logits' own spread: random weights leave near-ties, so the logits say more
than where the greedy tokens part). A file llama.cpp refuses is a row with its error; the settings
llama.cpp's graphs fix (Gemma 2's tied output layer, OLMoE's full-width key norm) are refused by the
export in one line, and their rows say so.

Needs llama-cpp-python (`pip install llama-cpp-python`, a ~15-minute build from source on 2 cores):
a benchmark-tier check, not part of `make test`.

    python -m benchmarks llamacpp
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

PROMPT = [464, 3290, 286, 262, 1578, 318]  # GPT-2 ids: "The history of the world is"
NEW = 12
BASE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=256, bos_token_id=50256, eos_token_id=50256, pad_token_id=None,
)  # fmt: skip
ARCHITECTURES = {  # transformers model_type -> what sets it apart, within what llama.cpp's graph runs
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "gemma2": dict(num_hidden_layers=4, query_pre_attn_scalar=16, sliding_window=32),
    "gemma3_text": dict(num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=32),
    "olmo2": {},
    "phi3": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
    "smollm3": dict(num_hidden_layers=4),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, num_key_value_heads=4, intermediate_size=32),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4, tie_word_embeddings=False),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_key_value_heads=4,
        n_group=2,
        topk_group=1,
    ),
}
REFUSED = {  # settings llama.cpp's graph fixes: the export refuses them (the row checks that it does)
    "gemma2 untied": ("gemma2", dict(num_hidden_layers=4, query_pre_attn_scalar=16, tie_word_embeddings=False)),
    "olmoe grouped kv": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32)),
}


def spread(model: torch.nn.Module) -> None:
    """Weights wide enough that greedy tokens do not hang on near-ties (a random model's logits are
    nearly flat), norms around 1."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and not name.endswith("bias"):
                p.copy_(
                    1.0
                    + 0.1 * torch.randn(p.shape, generator=g)
                    - (1.0 if "gemma" in type(model).__name__.lower() else 0.0)
                )
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def directory(model_type: str, extra: dict, root: Path):
    """(a transformers model of `model_type` saved with GPT-2's tokenizer, its greedy tokens)."""
    import transformers

    from tfcli.data.tokenizers import load_tokenizer_files

    tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, "vocab_size": tok.vocab_size, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    spread(model)
    path = root / model_type
    model.save_pretrained(path)
    tok.tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        logits = model(torch.tensor([PROMPT])).logits[0]
    return path, out[0, len(PROMPT) :].tolist(), logits


def export(path: Path, out: Path) -> str:
    """`tfcli export --gguf` of the directory; "" or the one line it refused with."""
    from typer.testing import CliRunner

    from tfcli.cli import app

    result = CliRunner().invoke(app, ["export", "--checkpoint", str(path), "--gguf", str(out), "--gguf-type", "f32"])
    return "" if result.exit_code == 0 else result.output.strip().splitlines()[-1]


def llama_cpp_run(gguf: Path) -> tuple[list[int], torch.Tensor]:
    """(llama.cpp's greedy tokens after PROMPT, its logits at the prompt's positions)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=64, n_threads=2, verbose=False, logits_all=True)
    llm.eval(PROMPT)
    logits = torch.tensor(llm.scores[: len(PROMPT)]).float()
    tokens = []
    for token in llm.generate(PROMPT, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == NEW:
            break
    return tokens, logits


def main() -> None:
    try:
        import llama_cpp
    except ImportError:
        print("llamacpp: needs llama-cpp-python (pip install llama-cpp-python); skipped")
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for model_type, extra in ARCHITECTURES.items():
            path, want, logits = directory(model_type, extra, root)
            refused = export(path, root / f"{model_type}.gguf")
            if refused:
                rows.append((model_type, "export refused", refused))
                continue
            try:
                got, theirs = llama_cpp_run(root / f"{model_type}.gguf")
            except Exception as e:  # llama.cpp's refusal to load, as it words it
                rows.append((model_type, "llama.cpp refused", str(e).splitlines()[0][:100]))
                continue
            same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
            diff = (theirs - logits).abs().max().item() / logits.std().item()
            detail = f"{same}/{NEW} greedy tokens as transformers'; logits within {diff:.1e} of their spread"
            rows.append((model_type, "loads", detail))
        for name, (model_type, extra) in REFUSED.items():
            path, _, _ = directory(model_type, extra, root / name.replace(" ", "-"))
            refused = export(path, root / "refused.gguf")
            rows.append((name, "export refused" if refused else "EXPORTED", refused[:100] or "should be refused"))
    print(f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) reading tfcli's f32 GGUF exports:")
    print("| architecture | result | detail |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
