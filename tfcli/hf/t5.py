"""T5 <-> transformers' T5ForConditionalGeneration: config translation and state-dict renaming.

tfcli fuses q, k, v of self-attention into one `qkv` matrix and k, v of cross-attention into
`kv`; transformers keeps them apart. Both sides are plain dicts of tensors, so the functions
below are pure and round-trip exactly.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ..errors import UserError
from ..models.t5 import T5, T5Config

_MLP_GATED = {"gate": "wi_0", "up": "wi_1", "down": "wo"}
_MLP_PLAIN = {"up": "wi", "down": "wo"}


def config_from_hf(hf: dict) -> T5Config:
    """A transformers T5 config (config.json as a dict) -> T5Config."""
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in ("relu", "gated-gelu"):
        raise UserError(f"T5 feed_forward_proj {proj!r} is not supported (relu or gated-gelu)")
    return T5Config(
        n_layer=hf["num_layers"], n_decoder_layer=hf.get("num_decoder_layers") or hf["num_layers"],
        n_head=hf["num_heads"], d_model=hf["d_model"], d_kv=hf["d_kv"], d_ff=hf["d_ff"], feed_forward=proj,
        relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
        dropout=float(hf.get("dropout_rate", 0.0)), layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        tie_word_embeddings=hf.get("tie_word_embeddings", True) is not False,
        max_seq_len=hf.get("n_positions", 512) or 512, vocab_size=hf["vocab_size"])


def config_to_hf(cfg: T5Config, pad_id: int = 0, eos_id: int = 1) -> dict:
    """T5Config -> the dict of a transformers config.json (decoder starts from the pad id, as T5)."""
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
        "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "d_kv": cfg.d_kv, "d_ff": cfg.d_ff,
        "num_layers": cfg.n_layer, "num_decoder_layers": cfg.n_decoder_layer, "num_heads": cfg.n_head,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "dropout_rate": cfg.dropout, "layer_norm_epsilon": cfg.layer_norm_eps,
        "feed_forward_proj": cfg.feed_forward, "tie_word_embeddings": cfg.tie_word_embeddings,
        "n_positions": cfg.max_seq_len, "is_encoder_decoder": True,
        "pad_token_id": pad_id, "eos_token_id": eos_id, "decoder_start_token_id": pad_id,
    }


def _pairs(cfg: T5Config):
    """(tfcli name, transformers name) of every weight that maps one to one."""
    mlp = _MLP_GATED if cfg.feed_forward == "gated-gelu" else _MLP_PLAIN
    yield "shared.weight", "shared.weight"
    yield "encoder_bias.embedding.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    yield "decoder_bias.embedding.weight", "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    yield "encoder_norm.weight", "encoder.final_layer_norm.weight"
    yield "decoder_norm.weight", "decoder.final_layer_norm.weight"
    for stack, n in (("encoder", cfg.n_layer), ("decoder", cfg.n_decoder_layer)):
        ff = 2 if stack == "decoder" else 1
        for i in range(n):
            ours, theirs = f"{stack}.{i}", f"{stack}.block.{i}.layer"
            yield f"{ours}.attn.out.weight", f"{theirs}.0.SelfAttention.o.weight"
            yield f"{ours}.norm_attn.weight", f"{theirs}.0.layer_norm.weight"
            yield f"{ours}.norm_mlp.weight", f"{theirs}.{ff}.layer_norm.weight"
            for a, b in mlp.items():
                yield f"{ours}.mlp.{a}.weight", f"{theirs}.{ff}.DenseReluDense.{b}.weight"
            if stack == "decoder":
                yield f"{ours}.cross_attn.q.weight", f"{theirs}.1.EncDecAttention.q.weight"
                yield f"{ours}.cross_attn.out.weight", f"{theirs}.1.EncDecAttention.o.weight"
                yield f"{ours}.norm_cross.weight", f"{theirs}.1.layer_norm.weight"


def _fused(cfg: T5Config):
    """(tfcli fused name, [transformers names concatenated along the output dimension])."""
    for stack, n in (("encoder", cfg.n_layer), ("decoder", cfg.n_decoder_layer)):
        for i in range(n):
            theirs = f"{stack}.block.{i}.layer"
            yield f"{stack}.{i}.attn.qkv.weight", [f"{theirs}.0.SelfAttention.{p}.weight" for p in "qkv"]
            if stack == "decoder":
                yield f"{stack}.{i}.cross_attn.kv.weight", [f"{theirs}.1.EncDecAttention.{p}.weight" for p in "kv"]


def state_dict_from_hf(sd: dict[str, Tensor], cfg: T5Config) -> dict[str, Tensor]:
    """transformers T5ForConditionalGeneration weights -> tfcli T5 weights."""
    try:
        out = {ours: sd[theirs] for ours, theirs in _pairs(cfg)}
        for ours, parts in _fused(cfg):
            out[ours] = torch.cat([sd[p] for p in parts], dim=0)  # (3*inner, D) or (2*inner, D)
    except KeyError as e:
        raise UserError(f"T5 checkpoint lacks weight {e.args[0]}") from None
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd.get("lm_head.weight", sd["shared.weight"])
    return out


def state_dict_to_hf(sd: dict[str, Tensor], cfg: T5Config) -> dict[str, Tensor]:
    """tfcli T5 weights -> transformers T5ForConditionalGeneration weights (tied copies included)."""
    out = {theirs: sd[ours] for ours, theirs in _pairs(cfg)}
    for ours, parts in _fused(cfg):
        for name, chunk in zip(parts, sd[ours].chunk(len(parts), dim=0)):
            out[name] = chunk.contiguous()
    shared = sd["shared.weight"]
    out["encoder.embed_tokens.weight"] = shared
    out["decoder.embed_tokens.weight"] = shared
    out["lm_head.weight"] = shared if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return out


def load_pretrained(directory: Path) -> T5:
    """A local transformers T5 directory (config.json + model.safetensors or pytorch_model.bin) -> T5."""
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise UserError(f"{d}: no config.json; give a local Hugging Face T5 directory (the hub is not used)")
    hf = json.loads((d / "config.json").read_text())
    if hf.get("model_type") != "t5":
        raise UserError(f"{d}: model_type is {hf.get('model_type')!r}, not 't5'")
    cfg = config_from_hf(hf)
    if (d / "model.safetensors").is_file():
        from safetensors.torch import load_file

        sd = load_file(str(d / "model.safetensors"))
    elif (d / "pytorch_model.bin").is_file():
        sd = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UserError(f"{d}: no model.safetensors or pytorch_model.bin")
    model = T5(cfg)
    model.load_state_dict(state_dict_from_hf(sd, cfg))
    return model.eval()


def export_model(model: T5, directory: Path, pad_id: int = 0, eos_id: int = 1) -> Path:
    """Write config.json + model.safetensors that T5ForConditionalGeneration.from_pretrained loads."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    sd = state_dict_to_hf({k: v.detach().cpu() for k, v in model.state_dict().items()}, model.cfg)
    # transformers ties the embeddings itself; store shared.weight once (safetensors refuses aliases)
    sd = {k: v.clone().contiguous() for k, v in sd.items()
          if k not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
          and not (k == "lm_head.weight" and model.cfg.tie_word_embeddings)}
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config_to_hf(model.cfg, pad_id, eos_id), indent=2))
    return d


def export(loaded, out: Path) -> str:
    """A loaded tfcli T5 run -> a transformers directory (T5ForConditionalGeneration + tokenizer.json)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; choose a new --hf directory")
    tok = loaded.tokenizer
    pad, eos = tok.token_id("<pad>"), tok.token_id("</s>")
    if pad is None or eos is None:
        raise UserError("this run's tokenizer has no <pad> or </s>; it was not trained for T5")
    export_model(loaded.model, out, pad_id=pad, eos_id=eos)
    tok.save(out)
    sentinels = [t for t in (f"<extra_id_{i}>" for i in range(100)) if tok.token_id(t) is not None]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "</s>",
        "unk_token": "<unk>", "additional_special_tokens": sentinels,
        "model_max_length": loaded.model.cfg.max_seq_len}, indent=2))
    return "T5ForConditionalGeneration"
