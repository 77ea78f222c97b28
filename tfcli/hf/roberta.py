"""RoBERTa and XLM-RoBERTa <-> transformers' RobertaModel / RobertaForMaskedLM /
RobertaForSequenceClassification (and XLMRoberta*): BERT's blocks and table under the `roberta.`
prefix, positions counted from pad id + 1 (`model.position_offset`), one token type (a pair's second
text is type 0 too: `model.segments` off), no next-sentence head. Its classification head (dense, tanh, out_proj on <s>) is BERT's pooler and classifier: the
pooler is `classifier.dense`, the classifier `classifier.out_proj`.
"""

from __future__ import annotations

from dataclasses import replace

from ..models.bert import BertConfig
from . import bert
from .convert import Export, Rule, refuse_classifier, rule

PREFIX = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta"}
_MLM = [("mlm.dense", "lm_head.dense"), ("mlm.norm", "lm_head.layer_norm")]


def config_from_hf(raw: dict, state=None) -> BertConfig:
    cfg = bert.config_from_hf({**raw, "type_vocab_size": raw.get("type_vocab_size", 1)}, state)
    return replace(cfg, position_offset=raw.get("pad_token_id", 1) + 1, segments=False, hf_model_type=raw["model_type"])


def config_to_hf(cfg: BertConfig) -> dict:
    pad = cfg.position_offset - 1
    return {**bert.config_to_hf(cfg), "model_type": cfg.hf_model_type, "pad_token_id": pad, "bos_token_id": 0}


def rules(cfg: BertConfig, classifier: bool = False) -> list[Rule]:
    """The table; `classifier`: the pooler as the classification head's dense layer (an export of a
    classifier), else as RobertaModel's pooler."""
    out = bert.encoder_rules(cfg, "roberta")
    for w in ("weight", "bias"):
        out.append(
            rule(
                f"model.pooler.{w}",
                f"{'classifier.dense' if classifier else 'roberta.pooler.dense'}.{w}",
                optional=True,
            )
        )
        out += [rule(f"heads.{ours}.{w}", f"{theirs}.{w}", optional=True) for ours, theirs in _MLM]
        out.append(rule(f"heads.classifier.{w}", f"classifier.out_proj.{w}", optional=True))
    out.append(rule("heads.mlm.bias", "lm_head.bias", optional=True))
    return out


def normalize(state: dict) -> dict:
    """A bare RobertaModel's keys get the `roberta.` prefix; a classifier's head dense layer is read as
    the pooler (the same dense + tanh on <s>)."""
    out = {k if k.startswith(("roberta.", "lm_head.", "classifier.")) else f"roberta.{k}": v for k, v in state.items()}
    if "classifier.dense.weight" in out:
        for w in ("weight", "bias"):
            out[f"roberta.pooler.dense.{w}"] = out.pop(f"classifier.dense.{w}")
    return out


def export(backbone, recipe) -> Export:
    """*ForSequenceClassification for a classifier run (cls pooling), *ForMaskedLM for an MLM run,
    *Model for an encoder alone."""
    heads, cfg = backbone.heads, backbone.cfg
    config, extra, table = config_to_hf(cfg), {}, None
    name = PREFIX[cfg.hf_model_type]
    if "classifier.weight" in heads:
        labels = backbone.labels or [str(i) for i in range(heads["classifier.weight"].shape[0])]
        config.update(
            num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)}
        )
        pooling = getattr(recipe.settings if recipe is not None else None, "pooling", "cls")
        if pooling not in ("cls", "auto"):
            refuse_classifier(
                cfg.hf_model_type, pooling, f"finetune with --pooling cls ({name}ForSequenceClassification)"
            )
        arch, table = f"{name}ForSequenceClassification", rules(cfg, classifier=True)
    elif "mlm.bias" in heads:
        arch = f"{name}ForMaskedLM"
        extra = {"lm_head.decoder.weight": backbone.model.wte.weight, "lm_head.decoder.bias": heads["mlm.bias"]}
    else:
        arch = f"{name}Model"
    return Export({"architectures": [arch], **config}, extra_tensors=extra, rules=table)
