"""GPT-2 <-> transformers' GPT2LMHeadModel: the weight table and config map.

transformers stores GPT-2's linear layers as Conv1D, weight (in, out): every matrix is transposed.
The LM head is tied to wte, so it is not stored; transformers ties it again on load.
"""

from __future__ import annotations

from ..errors import UserError
from ..models.gpt import GPTConfig
from .convert import Export, Rule, json_text, refuse_classifier, rule

_LAYER = [
    ("norm_attn", "ln_1", False),
    ("attn.qkv", "attn.c_attn", True),
    ("attn.out", "attn.c_proj", True),
    ("norm_mlp", "ln_2", False),
    ("mlp.up", "mlp.c_fc", True),
    ("mlp.down", "mlp.c_proj", True),
]


def config_from_hf(raw: dict, state=None) -> GPTConfig:
    if raw.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"unsupported GPT-2 activation {raw['activation_function']!r} (tfcli's GPT uses tanh-GELU)")
    return GPTConfig(
        n_layer=raw["n_layer"],
        n_head=raw["n_head"],
        d_model=raw["n_embd"],
        d_ff=raw.get("n_inner") or 4 * raw["n_embd"],
        max_seq_len=raw["n_positions"],
        vocab_size=raw["vocab_size"],
        dropout=raw.get("resid_pdrop", 0.0),
        layer_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
    )


def config_to_hf(cfg: GPTConfig) -> dict:
    return {
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.d_ff,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "tie_word_embeddings": True,
    }


def rules(cfg: GPTConfig) -> list[Rule]:
    out = [
        rule("model.wte.weight", "transformer.wte.weight"),
        rule("model.wpe.weight", "transformer.wpe.weight"),
        rule("model.ln_f.weight", "transformer.ln_f.weight"),
        rule("model.ln_f.bias", "transformer.ln_f.bias"),
    ]
    for i in range(cfg.n_layer):
        for ours, theirs, conv1d in _LAYER:
            out.append(rule(f"model.blocks.{i}.{ours}.weight", f"transformer.h.{i}.{theirs}.weight", transpose=conv1d))
            out.append(rule(f"model.blocks.{i}.{ours}.bias", f"transformer.h.{i}.{theirs}.bias"))
    return out


def normalize(state: dict) -> dict:
    """A bare GPT2Model's keys ('h.0.ln_1.weight') get the LM model's 'transformer.' prefix."""
    return {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in state.items()}


def export(backbone, recipe) -> Export:
    """GPT2LMHeadModel (a pretrained or text-to-text run), or GPT2ForSequenceClassification for a
    classifier on the last token."""
    eos = backbone.tokenizer.eos_id if backbone.tokenizer is not None else None
    config = {
        "architectures": ["GPT2LMHeadModel"],
        **config_to_hf(backbone.cfg),
        "bos_token_id": eos,
        "eos_token_id": eos,
    }
    extra, rules_ = {}, None
    if "classifier.weight" in backbone.heads:
        config, extra, rules_ = _sequence_classifier(backbone, recipe, config, eos)
    files = {}
    if backbone.tokenizer is not None:
        files["tokenizer_config.json"] = json_text(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "bos_token": "<|endoftext|>",
                "model_max_length": backbone.cfg.max_seq_len,
            }
        )
    return Export(config, extra_tensors=extra, files=files, rules=rules_)


def _sequence_classifier(backbone, recipe, config: dict, pad: int):
    """GPT2ForSequenceClassification reads the last token that is not padding (tfcli's `last` pooling:
    tfcli pads with end-of-text too) through `score`, a linear layer without a bias. tfcli's classifier
    has one; it goes into the final LayerNorm's bias, which feeds only the classifier: ln_f.bias + d with
    W d = b (least squares; exact while the labels are fewer than the width), so the logits match."""
    import torch

    pooling = getattr(recipe.settings if recipe is not None else None, "pooling", "last")
    if pooling not in ("last", "auto"):
        refuse_classifier("gpt", pooling, "finetune with --pooling last (GPT2ForSequenceClassification) to export")
    w, b = backbone.heads["classifier.weight"].float(), backbone.heads["classifier.bias"].float()  # (n, D), (n,)
    shift = torch.linalg.lstsq(w.double(), b.double()[:, None]).solution[:, 0].float()  # (D,)
    labels = backbone.labels or [str(i) for i in range(w.shape[0])]
    config = {
        **config,
        "architectures": ["GPT2ForSequenceClassification"],
        "pad_token_id": pad,
        "num_labels": len(labels),
        "id2label": dict(enumerate(labels)),
        "label2id": {n: i for i, n in enumerate(labels)},
    }
    table = [r for r in rules(backbone.cfg) if r.ours != "model.ln_f.bias"]
    extra = {"score.weight": w, "transformer.ln_f.bias": backbone.model.ln_f.bias.detach().float() + shift}
    return config, extra, table
