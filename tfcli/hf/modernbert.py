"""ModernBERT <-> transformers' ModernBertModel / ModernBertForSequenceClassification: the weight table
and config map. Its fused Wqkv is tfcli's qkv; its Wi holds the GeGLU's two halves (the first
activated, tfcli's `gate`; the second, `up`); its prediction head (dense, GELU, norm) is the model's
`head`, which a [CLS] classifier reads, and `classifier` the task's.
"""

from __future__ import annotations

from ..errors import UserError
from ..models.modernbert import ModernBertConfig
from . import positions
from .convert import Export, Rule, refuse_classifier, rule

ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}


def config_from_hf(raw: dict, state=None) -> ModernBertConfig:
    act = raw.get("hidden_activation", "gelu")
    if act not in ACTIVATIONS or raw.get("classifier_activation", act) != act:
        raise UserError(f"unsupported modernbert activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
    if bool(raw.get("attention_bias", False)) != bool(raw.get("mlp_bias", False)):
        raise UserError("modernbert: biases on attention but not on the MLP (or the reverse) are not supported")
    n = raw["num_hidden_layers"]
    every = raw.get("global_attn_every_n_layers", 3)
    if not isinstance(every, int) or every < 1:
        raise UserError(f"modernbert: config.json's global_attn_every_n_layers must be >= 1, not {every!r}")
    types = positions.layer_kinds(raw, ["sliding_attention" if i % every else "full_attention" for i in range(n)])
    return ModernBertConfig(
        n_layer=n,
        n_head=raw["num_attention_heads"],
        d_model=raw["hidden_size"],
        d_ff=raw["intermediate_size"],
        max_seq_len=raw.get("max_position_embeddings", 8192),
        vocab_size=raw["vocab_size"],
        dropout=raw.get("attention_dropout", 0.0),
        layer_norm_eps=raw.get("norm_eps", 1e-5),
        bias=bool(raw.get("attention_bias", False)),
        norm_bias=bool(raw.get("norm_bias", False)),
        head_bias=bool(raw.get("classifier_bias", False)),
        activation=ACTIVATIONS[act],
        local_window=raw.get("local_attention", 128),
        layer_types=types,
        global_rope_theta=positions.layer_rope_theta(raw, "full", "global_rope_theta", 160000.0),
        local_rope_theta=positions.layer_rope_theta(raw, "sliding", "local_rope_theta", 10000.0),
    )


def config_to_hf(cfg: ModernBertConfig) -> dict:
    return {
        "model_type": "modernbert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_activation": next(k for k, v in ACTIVATIONS.items() if v == cfg.activation),
        "classifier_activation": next(k for k, v in ACTIVATIONS.items() if v == cfg.activation),
        "norm_eps": cfg.layer_norm_eps,
        "norm_bias": cfg.norm_bias,
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "classifier_bias": cfg.head_bias,
        "attention_dropout": cfg.dropout,
        "embedding_dropout": cfg.dropout,
        "mlp_dropout": cfg.dropout,
        "classifier_dropout": 0.0,
        "local_attention": cfg.local_window,
        "layer_types": [f"{t}_attention" for t in cfg.layer_types],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": cfg.global_rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta},
        },
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "cls_token_id": None,
        "sep_token_id": None,
    }


def rules(cfg: ModernBertConfig) -> list[Rule]:
    norm = lambda ours, theirs, optional=False: [  # noqa: E731
        rule(f"{ours}.{w}", f"{theirs}.{w}", optional=optional)
        for w in ("weight", "bias")
        if w == "weight" or cfg.norm_bias
    ]
    linear = lambda ours, theirs, bias, **kw: [  # noqa: E731
        rule(f"{ours}.{w}", f"{theirs}.{w}", **kw) for w in ("weight", "bias") if w == "weight" or bias
    ]
    out = [rule("model.wte.weight", "model.embeddings.tok_embeddings.weight")]
    out += norm("model.ln_emb", "model.embeddings.norm") + norm("model.ln_f", "model.final_norm")
    for i in range(cfg.n_layer):
        ours, theirs = f"model.blocks.{i}", f"model.layers.{i}"
        out += linear(f"{ours}.attn.qkv", f"{theirs}.attn.Wqkv", cfg.bias)
        out += linear(f"{ours}.attn.out", f"{theirs}.attn.Wo", cfg.bias)
        for j, part in enumerate(("gate", "up")):
            out += linear(f"{ours}.mlp.{part}", f"{theirs}.mlp.Wi", cfg.bias, part=(j, 2))
        out += linear(f"{ours}.mlp.down", f"{theirs}.mlp.Wo", cfg.bias)
        out += (norm(f"{ours}.norm_attn", f"{theirs}.attn_norm") if i else []) + norm(
            f"{ours}.norm_mlp", f"{theirs}.mlp_norm"
        )
    out += linear("model.head.dense", "head.dense", cfg.head_bias, optional=True)
    out += norm("model.head.norm", "head.norm", optional=True)
    out += linear("heads.classifier", "classifier", True, optional=True)
    out.append(rule("heads.mlm.bias", "decoder.bias", optional=True))  # ModernBertForMaskedLM's output bias
    return out


def normalize(state: dict) -> dict:
    """A bare ModernBertModel's keys get the `model.` prefix of the models with heads."""
    heads = ("model.", "head.", "classifier.", "decoder.")
    return {k if k.startswith(heads) else f"model.{k}": v for k, v in state.items()}


def export(backbone, recipe) -> Export:
    """ModernBertForSequenceClassification for a [CLS] classifier run, ModernBertForMaskedLM for a
    model with its masked-LM output (read from such a checkpoint), ModernBertModel otherwise."""
    heads, cfg = backbone.heads, backbone.cfg
    config = config_to_hf(cfg)
    if "classifier.weight" not in heads:
        masked_lm = "mlm.bias" in heads
        return Export({"architectures": ["ModernBertForMaskedLM" if masked_lm else "ModernBertModel"], **config})
    pooling = getattr(recipe.settings if recipe is not None else None, "pooling", "cls")
    if pooling not in ("cls", "auto"):
        refuse_classifier("modernbert", pooling, "finetune with --pooling cls (ModernBertForSequenceClassification)")
    labels = backbone.labels or [str(i) for i in range(heads["classifier.weight"].shape[0])]
    config.update(
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={n: i for i, n in enumerate(labels)},
        classifier_pooling="cls",
    )
    return Export({"architectures": ["ModernBertForSequenceClassification"], **config})
