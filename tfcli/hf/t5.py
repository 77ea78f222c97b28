"""T5 (v1 ReLU and v1.1 gated-GELU) <-> transformers' T5ForConditionalGeneration: the weight
table and config map.

tfcli fuses q, k, v of self-attention into one `qkv` matrix and k, v of cross-attention into `kv`;
transformers keeps them apart. Each stack's relative position bias lives in its first block there.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from ..errors import UserError
from ..models.t5 import T5Config
from .convert import Export, Rule, json_text, refuse_classifier, rule

_MLP = {"gated-gelu": {"gate": "wi_0", "up": "wi_1", "down": "wo"}, "relu": {"up": "wi", "down": "wo"}}


def config_from_hf(raw: dict, state=None) -> T5Config:
    proj = raw.get("feed_forward_proj", "relu")
    if proj not in _MLP:
        raise UserError(f"T5 feed_forward_proj {proj!r} is not supported (relu or gated-gelu)")
    return T5Config(
        n_layer=raw["num_layers"],
        n_decoder_layer=raw.get("num_decoder_layers") or raw["num_layers"],
        n_head=raw["num_heads"],
        d_model=raw["d_model"],
        d_kv=raw["d_kv"],
        d_ff=raw["d_ff"],
        feed_forward=proj,
        relative_attention_num_buckets=raw.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=raw.get("relative_attention_max_distance", 128),
        dropout=float(raw.get("dropout_rate", 0.0)),
        layer_norm_eps=raw.get("layer_norm_epsilon", 1e-6),
        tie_word_embeddings=_scaled_and_tied(raw),
        max_seq_len=raw.get("n_positions", 512) or 512,
        vocab_size=raw["vocab_size"],
    )


def _scaled_and_tied(raw: dict) -> bool:
    """T5 1.0 ties the LM head to the embedding and scales the decoder output by d_model**-0.5;
    T5 1.1 does neither. transformers 4.x says which by tie_word_embeddings, 5.x by
    scale_decoder_outputs (it always ties the head itself)."""
    if "scale_decoder_outputs" in raw:
        return bool(raw["scale_decoder_outputs"])
    return raw.get("tie_word_embeddings", True) is not False


def config_to_hf(cfg: T5Config, pad_id: int = 0, eos_id: int = 1) -> dict:
    """The decoder starts from the pad id, as in T5."""
    return {
        "model_type": "t5",
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_kv": cfg.d_kv,
        "d_ff": cfg.d_ff,
        "num_layers": cfg.n_layer,
        "num_decoder_layers": cfg.n_decoder_layer,
        "num_heads": cfg.n_head,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "dropout_rate": cfg.dropout,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "feed_forward_proj": cfg.feed_forward,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "scale_decoder_outputs": cfg.tie_word_embeddings,
        "n_positions": cfg.max_seq_len,
        "is_encoder_decoder": True,
        "pad_token_id": pad_id,
        "eos_token_id": eos_id,
        "decoder_start_token_id": pad_id,
    }


def rules(cfg: T5Config) -> list[Rule]:
    out = [
        rule("model.shared.weight", "shared.weight"),
        rule(
            "model.encoder_bias.embedding.weight",
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        ),
        rule(
            "model.decoder_bias.embedding.weight",
            "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        ),
        rule("model.encoder_norm.weight", "encoder.final_layer_norm.weight"),
        rule("model.decoder_norm.weight", "decoder.final_layer_norm.weight"),
    ]
    for stack, n in (("encoder", cfg.n_layer), ("decoder", cfg.n_decoder_layer)):
        ff = 2 if stack == "decoder" else 1
        for i in range(n):
            ours, theirs = f"model.{stack}.{i}", f"{stack}.block.{i}.layer"
            out += [
                rule(f"{ours}.attn.qkv.weight", *(f"{theirs}.0.SelfAttention.{p}.weight" for p in "qkv")),
                rule(f"{ours}.attn.out.weight", f"{theirs}.0.SelfAttention.o.weight"),
                rule(f"{ours}.norm_attn.weight", f"{theirs}.0.layer_norm.weight"),
                rule(f"{ours}.norm_mlp.weight", f"{theirs}.{ff}.layer_norm.weight"),
            ]
            out += [
                rule(f"{ours}.mlp.{a}.weight", f"{theirs}.{ff}.DenseReluDense.{b}.weight")
                for a, b in _MLP[cfg.feed_forward].items()
            ]
            if stack == "decoder":
                out += [
                    rule(f"{ours}.cross_attn.q.weight", f"{theirs}.1.EncDecAttention.q.weight"),
                    rule(f"{ours}.cross_attn.kv.weight", *(f"{theirs}.1.EncDecAttention.{p}.weight" for p in "kv")),
                    rule(f"{ours}.cross_attn.out.weight", f"{theirs}.1.EncDecAttention.o.weight"),
                    rule(f"{ours}.norm_cross.weight", f"{theirs}.1.layer_norm.weight"),
                ]
    if not cfg.tie_word_embeddings:
        out.append(rule("model.lm_head.weight", "lm_head.weight"))
    return out


def normalize(state: dict) -> dict:
    """Checkpoints that keep the embedding only as encoder.embed_tokens still have a shared one; a
    head transformers tied (5.x ties every T5's, and then does not store it) is the shared embedding."""
    if "shared.weight" not in state and "encoder.embed_tokens.weight" in state:
        state = {**state, "shared.weight": state["encoder.embed_tokens.weight"]}
    if "lm_head.weight" not in state and "shared.weight" in state:
        state = {**state, "lm_head.weight": state["shared.weight"]}
    return state


def export(backbone, recipe) -> Export:
    """T5ForConditionalGeneration: a pretrained or text-to-text run (a classifier on T5 features has no
    transformers class: T5ForSequenceClassification pools the decoder's end-of-text through a dense layer)."""
    if "classifier.weight" in backbone.heads:
        pooling = getattr(recipe.settings if recipe is not None else None, "pooling", "encoder-mean")
        refuse_classifier("t5", pooling, "finetune with --head text (T5ForConditionalGeneration) to export")
    tok = backbone.tokenizer
    if tok is None:  # a model without its tokenizer: T5's own ids
        return Export({"architectures": ["T5ForConditionalGeneration"], **config_to_hf(backbone.cfg)})
    pad, eos = tok.token_id("<pad>"), tok.token_id("</s>")
    if pad is None or eos is None:
        raise UserError("this run's tokenizer has no <pad> or </s>; it was not trained for T5")
    sentinels = [t for t in (f"<extra_id_{i}>" for i in range(100)) if tok.token_id(t) is not None]
    files = {
        "tokenizer.json": _appending_eos(tok.tok, eos),
        "tokenizer_config.json": json_text(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "<pad>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "additional_special_tokens": sentinels,
                "model_max_length": backbone.cfg.max_seq_len,
            }
        ),
    }
    return Export(
        {"architectures": ["T5ForConditionalGeneration"], **config_to_hf(backbone.cfg, pad, eos)}, files=files
    )


def _appending_eos(tokenizer: Tokenizer, eos: int) -> str:
    """tokenizer.json that ends every encoded text with </s>, as transformers' T5 tokenizers do."""
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.post_processor = TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)])
    return tok.to_str()
