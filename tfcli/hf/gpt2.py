"""GPT-2 <-> transformers' GPT2LMHeadModel: config and state-dict translation.

transformers stores GPT-2's linear layers as Conv1D, weight (in, out): every matrix is
transposed on the way in and out. The LM head is tied to wte, so it is not stored twice.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.gpt import GPTConfig

_LAYER = {  # tfcli name in a block -> transformers name in transformer.h.{i}
    "norm_attn": "ln_1",
    "attn.qkv": "attn.c_attn",
    "attn.out": "attn.c_proj",
    "norm_mlp": "ln_2",
    "mlp.up": "mlp.c_fc",
    "mlp.down": "mlp.c_proj",
}
_CONV1D = ("attn.qkv", "attn.out", "mlp.up", "mlp.down")


def config_to_hf(cfg: GPTConfig) -> dict:
    """Keyword arguments for transformers.GPT2Config."""
    return {"vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model,
            "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.d_ff,
            "activation_function": "gelu_new", "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout, "layer_norm_epsilon": cfg.layer_norm_eps, "tie_word_embeddings": True}


def config_from_hf(hf: dict) -> GPTConfig:
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"unsupported GPT-2 activation {hf['activation_function']!r}")
    return GPTConfig(n_layer=hf["n_layer"], n_head=hf["n_head"], d_model=hf["n_embd"],
                     d_ff=hf.get("n_inner") or 4 * hf["n_embd"], max_seq_len=hf["n_positions"],
                     vocab_size=hf["vocab_size"], dropout=hf.get("resid_pdrop", 0.0),
                     layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5))


def state_from_hf(hf_state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state dict -> tfcli GPT state dict."""
    out = {"wte.weight": hf_state["transformer.wte.weight"], "wpe.weight": hf_state["transformer.wpe.weight"],
           "ln_f.weight": hf_state["transformer.ln_f.weight"], "ln_f.bias": hf_state["transformer.ln_f.bias"]}
    for i in range(n_layer):
        for ours, theirs in _LAYER.items():
            for kind in ("weight", "bias"):
                t = hf_state[f"transformer.h.{i}.{theirs}.{kind}"]
                out[f"blocks.{i}.{ours}.{kind}"] = t.t().contiguous() if kind == "weight" and ours in _CONV1D else t
    return out


def state_to_hf(state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """tfcli GPT state dict -> GPT2LMHeadModel state dict (lm_head tied to wte)."""
    out = {"transformer.wte.weight": state["wte.weight"], "transformer.wpe.weight": state["wpe.weight"],
           "transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": state["ln_f.bias"],
           "lm_head.weight": state["wte.weight"]}
    for i in range(n_layer):
        for ours, theirs in _LAYER.items():
            for kind in ("weight", "bias"):
                t = state[f"blocks.{i}.{ours}.{kind}"]
                out[f"transformer.h.{i}.{theirs}.{kind}"] = (
                    t.t().contiguous() if kind == "weight" and ours in _CONV1D else t)
    return out


def export(loaded, out: Path) -> str:
    """A loaded tfcli GPT run -> a directory GPT2LMHeadModel.from_pretrained loads (+ tokenizer files)."""
    from safetensors.torch import save_file

    cfg = loaded.model.cfg
    out.mkdir(parents=True, exist_ok=True)
    state = state_to_hf({k: v.detach().cpu() for k, v in loaded.model.state_dict().items()}, cfg.n_layer)
    state.pop("lm_head.weight")  # tied to wte: transformers ties it again on load
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    eos = loaded.tokenizer.eos_id if loaded.tokenizer is not None else None
    hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **config_to_hf(cfg),
          "bos_token_id": eos, "eos_token_id": eos}
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    if loaded.tokenizer is not None:
        loaded.tokenizer.save(out)
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
            "bos_token": "<|endoftext|>", "model_max_length": cfg.max_seq_len}, indent=2))
    return "GPT2LMHeadModel"
