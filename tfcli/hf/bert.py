"""BERT <-> transformers' BertModel / BertForPreTraining / BertForMaskedLM /
BertForSequenceClassification: the weight table and config map.

transformers' separate query/key/value become tfcli's fused qkv. tfcli head names: MLM
`mlm.dense/mlm.norm/mlm.bias` and `nsp` (objectives.mlm_nsp), `classifier` (tasks.classify);
the MLM decoder weight is always the tied token embedding.
"""

from __future__ import annotations

from ..errors import UserError
from ..models.bert import BertConfig
from .convert import Export, Rule, json_text, refuse_classifier, rule

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_EMBED = [
    ("wte.weight", "embeddings.word_embeddings.weight"),
    ("wpe.weight", "embeddings.position_embeddings.weight"),
    ("wse.weight", "embeddings.token_type_embeddings.weight"),
    ("ln_emb.weight", "embeddings.LayerNorm.weight"),
    ("ln_emb.bias", "embeddings.LayerNorm.bias"),
]
_LAYER = [
    ("attn.out", "attention.output.dense"),
    ("norm_attn", "attention.output.LayerNorm"),
    ("mlp.up", "intermediate.dense"),
    ("mlp.down", "output.dense"),
    ("norm_mlp", "output.LayerNorm"),
]
_HEADS = [
    ("mlm.dense", "cls.predictions.transform.dense"),
    ("mlm.norm", "cls.predictions.transform.LayerNorm"),
    ("nsp", "cls.seq_relationship"),
    ("classifier", "classifier"),
]


def config_from_hf(raw: dict, state=None) -> BertConfig:
    act = raw.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise UserError(f"unsupported BERT activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
    return BertConfig(
        n_layer=raw["num_hidden_layers"],
        n_head=raw["num_attention_heads"],
        d_model=raw["hidden_size"],
        d_ff=raw["intermediate_size"],
        max_seq_len=raw.get("max_position_embeddings", 512),
        type_vocab_size=raw.get("type_vocab_size", 2),
        vocab_size=raw["vocab_size"],
        dropout=raw.get("hidden_dropout_prob", 0.1),
        layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
        activation=ACTIVATIONS[act],
    )


def config_to_hf(cfg: BertConfig) -> dict:
    act = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}[cfg.activation]
    return {
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "intermediate_size": cfg.d_ff,
        "hidden_act": act,
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.layer_norm_eps,
        "pad_token_id": 0,
        "initializer_range": 0.02,
    }


def encoder_rules(cfg: BertConfig, prefix: str) -> list[Rule]:
    """The encoder's table under transformers' `prefix` (bert, roberta): embeddings and blocks."""
    out = [rule(f"model.{ours}", f"{prefix}.{theirs}") for ours, theirs in _EMBED]
    for w in ("weight", "bias"):
        for i in range(cfg.n_layer):
            p = f"{prefix}.encoder.layer.{i}."
            out.append(
                rule(
                    f"model.blocks.{i}.attn.qkv.{w}", *(f"{p}attention.self.{n}.{w}" for n in ("query", "key", "value"))
                )
            )
            out += [rule(f"model.blocks.{i}.{ours}.{w}", f"{p}{theirs}.{w}") for ours, theirs in _LAYER]
    return out


def rules(cfg: BertConfig) -> list[Rule]:
    out = encoder_rules(cfg, "bert")
    for w in ("weight", "bias"):
        out.append(rule(f"model.pooler.{w}", f"bert.pooler.dense.{w}", optional=True))
        out += [rule(f"heads.{ours}.{w}", f"{theirs}.{w}", optional=True) for ours, theirs in _HEADS]
    out.append(rule("heads.mlm.bias", "cls.predictions.bias", optional=True))
    return out


def normalize(state: dict) -> dict:
    """BertModel keys (no prefix) get the 'bert.' prefix of the models with heads; old TF-era
    LayerNorm names (gamma/beta) become weight/bias; the MLM bias may sit on the decoder."""
    out = {}
    for k, v in state.items():
        if not k.startswith(("bert.", "cls.", "classifier.")):
            k = f"bert.{k}"
        out[k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")] = v
    if "cls.predictions.bias" not in out and "cls.predictions.decoder.bias" in out:
        out["cls.predictions.bias"] = out["cls.predictions.decoder.bias"]
    return out


def export(backbone, recipe) -> Export:
    """BertForSequenceClassification for a classifier run (cls pooling), BertForPreTraining for
    MLM + NSP, BertForMaskedLM for MLM only, BertModel for an encoder alone (e.g. ELECTRA's)."""
    heads, cfg = backbone.heads, backbone.cfg
    config, extra = config_to_hf(cfg), {}
    if "classifier.weight" in heads:
        labels = backbone.labels or [str(i) for i in range(heads["classifier.weight"].shape[0])]
        config.update(
            num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)}
        )
        pooling = getattr(recipe.settings if recipe is not None else None, "pooling", "cls")
        if pooling == "mean":
            return _sentence_transformers(backbone, config_to_hf(cfg), labels)
        if pooling not in ("cls", "auto"):
            refuse_classifier(
                "bert",
                pooling,
                "finetune with --pooling cls (BertForSequenceClassification) or mean (sentence-transformers) to export",
            )
        arch = "BertForSequenceClassification"
    elif "mlm.bias" in heads:
        arch = "BertForPreTraining" if "nsp.weight" in heads else "BertForMaskedLM"
        extra = {
            "cls.predictions.decoder.weight": backbone.model.wte.weight,
            "cls.predictions.decoder.bias": heads["mlm.bias"],
        }
    else:
        arch = "BertModel"
    return Export({"architectures": [arch], **config}, extra_tensors=extra, files=_tokenizer_files(backbone))


def _sentence_transformers(backbone, config: dict, labels: list[str]) -> Export:
    """A mean-pooled classifier: the encoder as transformers' BertModel, and the sentence-transformers
    layout on top (mean pooling, then a Dense layer with no activation holding the classifier), so
    SentenceTransformer(dir).encode(texts) gives the logits. config.json names no labels: with them,
    AutoModelForSequenceClassification would load it with a random [CLS] classifier, silently."""
    from safetensors.torch import save

    cfg, heads = backbone.cfg, backbone.heads
    n = heads["classifier.weight"].shape[0]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    files = {
        "modules.json": json_text(modules),
        "sentence_bert_config.json": json_text({"max_seq_length": cfg.max_seq_len, "do_lower_case": False}),
        "1_Pooling/config.json": json_text(
            {
                "word_embedding_dimension": cfg.d_model,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
            }
        ),
        "2_Dense/config.json": json_text(
            {
                "in_features": cfg.d_model,
                "out_features": n,
                "bias": True,
                "activation_function": "torch.nn.modules.linear.Identity",
            }
        ),
        "2_Dense/model.safetensors": save(
            {
                "linear.weight": heads["classifier.weight"].contiguous(),
                "linear.bias": heads["classifier.bias"].contiguous(),
            }
        ),
        "labels.json": json_text(list(labels)),
        **_tokenizer_files(backbone),
    }
    encoder = [r for r in rules(cfg) if r.ours.startswith("model.")]
    how = (
        "sentence_transformers.SentenceTransformer(dir).encode(texts) gives the logits (labels.json names them); "
        "transformers.AutoModel loads the encoder alone"
    )
    return Export({"architectures": ["BertModel"], **config}, files=files, rules=encoder, loads_with=how)


def _tokenizer_files(backbone) -> dict[str, str]:
    tok = backbone.tokenizer
    if tok is None:
        return {}
    norm = tok.tok.normalizer
    lower = norm is not None and norm.normalize_str("A") == "a"
    files = {
        "tokenizer_config.json": json_text(
            {
                "tokenizer_class": "BertTokenizerFast",
                "do_lower_case": lower,
                "model_max_length": backbone.cfg.max_seq_len,
            }
        )
    }
    if tok.tok.model.__class__.__name__ == "WordPiece":
        vocab = tok.tok.get_vocab(with_added_tokens=True)
        files["vocab.txt"] = "".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda x: x[1]))
    return files
