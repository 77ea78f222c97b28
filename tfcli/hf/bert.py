"""Hugging Face BERT <-> tfcli Bert: config translation and state-dict renaming, both ways.

Covers BertModel, BertForPreTraining (MLM + NSP heads) and BertForSequenceClassification
(classifier on the pooled [CLS]). transformers' separate query/key/value become our fused qkv.
tfcli head names: MLM `mlm.dense/mlm.norm/mlm.bias` and `nsp` (objectives.mlm_nsp), `classifier`
(tasks.sequence_classification); the MLM decoder weight is always the tied token embedding.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from ..errors import UserError
from ..models.bert import BertConfig

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def config_from_hf(hf: dict) -> BertConfig:
    """A transformers config.json (as a dict) -> BertConfig."""
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise UserError(f"unsupported BERT activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
    return BertConfig(n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"], d_model=hf["hidden_size"],
                      d_ff=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 512),
                      type_vocab_size=hf.get("type_vocab_size", 2), vocab_size=hf["vocab_size"],
                      dropout=hf.get("hidden_dropout_prob", 0.1), layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
                      activation=ACTIVATIONS[act])


def config_to_hf(cfg: BertConfig, num_labels: int = 2, architecture: str = "BertForPreTraining",
                 id2label: Optional[dict[int, str]] = None) -> dict:
    """BertConfig -> a transformers config.json dict."""
    act = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}[cfg.activation]
    out = {"architectures": [architecture], "model_type": "bert", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
           "intermediate_size": cfg.d_ff, "hidden_act": act, "hidden_dropout_prob": cfg.dropout,
           "attention_probs_dropout_prob": cfg.dropout, "max_position_embeddings": cfg.max_seq_len,
           "type_vocab_size": cfg.type_vocab_size, "layer_norm_eps": cfg.layer_norm_eps, "pad_token_id": 0,
           "initializer_range": 0.02, "num_labels": num_labels}
    if id2label:
        out["id2label"] = {str(i): n for i, n in id2label.items()}
        out["label2id"] = {n: i for i, n in id2label.items()}
    return out


# (ours, theirs) for everything that is a plain rename; {i} is the layer index.
_EMBED = [("wte.weight", "embeddings.word_embeddings.weight"), ("wpe.weight", "embeddings.position_embeddings.weight"),
          ("wse.weight", "embeddings.token_type_embeddings.weight"), ("ln_emb.weight", "embeddings.LayerNorm.weight"),
          ("ln_emb.bias", "embeddings.LayerNorm.bias"), ("pooler.weight", "pooler.dense.weight"),
          ("pooler.bias", "pooler.dense.bias")]
_LAYER = [("attn.out", "attention.output.dense"), ("norm_attn", "attention.output.LayerNorm"),
          ("mlp.up", "intermediate.dense"), ("mlp.down", "output.dense"), ("norm_mlp", "output.LayerNorm")]
_HEADS = [("mlm.dense", "cls.predictions.transform.dense"), ("mlm.norm", "cls.predictions.transform.LayerNorm"),
          ("nsp", "cls.seq_relationship"), ("classifier", "classifier")]
_QKV = ("query", "key", "value")


def _strip_prefix(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Accept BertModel keys (no prefix) and the heads' keys ('bert.' prefix) alike."""
    return {k[len("bert."):] if k.startswith("bert.") else k: v for k, v in sd.items()}


def from_hf(sd: dict[str, Tensor], n_layer: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """transformers state dict -> (our model's state dict, our heads' state dict).
    Heads present in `sd` (MLM, NSP, classifier) are returned; absent ones are simply not there."""
    sd = _strip_prefix(sd)
    model: dict[str, Tensor] = {}
    for ours, theirs in _EMBED:
        if theirs in sd:
            model[ours] = sd[theirs]
    missing = [t for o, t in _EMBED[:5] if t not in sd]
    if missing:
        raise UserError(f"not a BERT state dict: missing {missing[0]}")
    for i in range(n_layer):
        p = f"encoder.layer.{i}."
        for w in ("weight", "bias"):
            model[f"blocks.{i}.attn.qkv.{w}"] = torch.cat([sd[f"{p}attention.self.{n}.{w}"] for n in _QKV], 0)
            for ours, theirs in _LAYER:
                model[f"blocks.{i}.{ours}.{w}"] = sd[f"{p}{theirs}.{w}"]
    heads: dict[str, Tensor] = {}
    for ours, theirs in _HEADS:
        for w in ("weight", "bias"):
            if f"{theirs}.{w}" in sd:
                heads[f"{ours}.{w}"] = sd[f"{theirs}.{w}"]
    bias = sd.get("cls.predictions.bias", sd.get("cls.predictions.decoder.bias"))
    if bias is not None:
        heads["mlm.bias"] = bias
    return model, heads


def to_hf(model_sd: dict[str, Tensor], heads_sd: dict[str, Tensor], n_layer: int) -> dict[str, Tensor]:
    """(our model's, our heads' state dicts) -> transformers keys (BertForPreTraining or
    BertForSequenceClassification, whichever heads are given)."""
    out: dict[str, Tensor] = {}
    for ours, theirs in _EMBED:
        out[f"bert.{theirs}"] = model_sd[ours]
    for i in range(n_layer):
        p = f"bert.encoder.layer.{i}."
        for w in ("weight", "bias"):
            for n, t in zip(_QKV, model_sd[f"blocks.{i}.attn.qkv.{w}"].chunk(3, 0)):
                out[f"{p}attention.self.{n}.{w}"] = t
            for ours, theirs in _LAYER:
                out[f"{p}{theirs}.{w}"] = model_sd[f"blocks.{i}.{ours}.{w}"]
    for ours, theirs in _HEADS:
        for w in ("weight", "bias"):
            if f"{ours}.{w}" in heads_sd:
                out[f"{theirs}.{w}"] = heads_sd[f"{ours}.{w}"]
    if "mlm.bias" in heads_sd:
        out["cls.predictions.bias"] = heads_sd["mlm.bias"]
        out["cls.predictions.decoder.weight"] = model_sd["wte.weight"]
        out["cls.predictions.decoder.bias"] = heads_sd["mlm.bias"]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def is_hf_dir(path: Path) -> bool:
    return (Path(path) / "config.json").is_file()


def read_hf_dir(path: Path) -> tuple[BertConfig, dict[str, Tensor], dict[str, Tensor], dict]:
    """A transformers BERT directory -> (config, model state dict, heads state dict, raw config).
    Weights from model.safetensors, else pytorch_model.bin loaded with weights_only=True."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type", "bert") != "bert":
        raise UserError(f"{path}: model_type {raw.get('model_type')!r} is not a BERT")
    cfg = config_from_hf(raw)
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        sd = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").is_file():
        sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UserError(f"{path}: no model.safetensors or pytorch_model.bin")
    model_sd, heads_sd = from_hf(sd, cfg.n_layer)
    return cfg, model_sd, heads_sd, raw


def write_hf_dir(out: Path, cfg: BertConfig, model_sd: dict[str, Tensor], heads_sd: dict[str, Tensor],
                 tokenizer=None, id2label: Optional[dict[int, str]] = None) -> None:
    """Write config.json, model.safetensors (and tokenizer.json/vocab.txt) that transformers loads."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    classify = "classifier.weight" in heads_sd
    arch = ("BertForSequenceClassification" if classify else
            "BertForPreTraining" if "nsp.weight" in heads_sd else "BertForMaskedLM")
    n_labels = heads_sd["classifier.weight"].shape[0] if classify else 2
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg, n_labels, arch, id2label), indent=2))
    save_file(to_hf(model_sd, heads_sd, cfg.n_layer), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(out)
        norm = tokenizer.tok.normalizer
        lower = norm is not None and norm.normalize_str("A") == "a"
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "BertTokenizerFast", "do_lower_case": lower, "model_max_length": cfg.max_seq_len}))
        vocab = tokenizer.tok.get_vocab(with_added_tokens=True)
        if tokenizer.tok.model.__class__.__name__ == "WordPiece":
            (out / "vocab.txt").write_text("".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda x: x[1])))


def export(loaded, out: Path) -> str:
    """A loaded tfcli BERT run -> a transformers directory: BertForSequenceClassification for a
    finetuned run (cls pooling), BertForPreTraining for MLM+NSP, BertForMaskedLM for MLM only."""
    if Path(out).exists() and any(Path(out).iterdir()):
        raise UserError(f"{out} exists and is not empty; choose a new --hf directory")
    model_sd = {k: v for k, v in loaded.model.state_dict().items()}
    heads = dict(loaded.heads)
    id2label = None
    if "classifier.weight" in heads:
        task = loaded.recipe.task
        if task.pooling != "cls":
            raise UserError(f"this run classifies from --pooling {task.pooling}; transformers' "
                            f"BertForSequenceClassification uses the pooled [CLS] (cls) only")
        id2label = _labels(task.name)
        heads = {k: v for k, v in heads.items() if k.startswith("classifier.")}
    write_hf_dir(out, loaded.model.cfg, model_sd, heads, loaded.tokenizer, id2label)
    return json.loads((Path(out) / "config.json").read_text())["architectures"][0]


def _labels(task_name: str) -> Optional[dict[int, str]]:
    from .. import tasks

    try:
        labels = getattr(tasks.get(task_name), "LABELS", None)
    except UserError:
        return None
    return dict(enumerate(labels)) if labels else None
