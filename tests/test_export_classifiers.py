"""Every classifier `export` accepts loads as its config.json says, with tfcli's logits (< 1e-5);
every one it cannot express is refused in one line and nothing is written: no export may load
with a random head.

For each family x pooling it declares (and a LoRA-adapted BERT, merged on export): a
tiny model with random weights (norms and biases too) and a random classifier with a bias.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tfcli import adapters
from tfcli.data.tokenizers import load_tokenizer_files
from tfcli.errors import UserError
from tfcli.hf import interop as hf
from tfcli.hf.convert import auto_class
from tfcli.models import FAMILIES, model_class
from tfcli.models.bert import Bert, BertConfig
from tfcli.models.gpt import GPT, GPTConfig
from tfcli.models.llama import Llama, LlamaConfig
from tfcli.models.modernbert import ModernBert, ModernBertConfig
from tfcli.models.t5 import T5, T5Config
from tfcli.models.vit import ViT, ViTConfig
from tfcli.plugin import Backbone
from tfcli.recipe import AdapterConfig
from tfcli.tasks.heads import feature_dim, features

from .conftest import close
from .test_hf import jiggle_

POOLINGS = {family: model_class(family).poolings for family in FAMILIES if not family.startswith(("generic", "vlm"))}
# (the generic families export no classifier: tests/test_generic.py says so; nor does a vision-language model,
# which no transformers class scores as a classifier: tests/test_vlm.py)


transformers = pytest.importorskip("transformers")
LABELS = ("entailment", "neutral", "contradiction")


def tiny(family: str):
    torch.manual_seed(0)
    if family == "bert":
        return Bert(BertConfig(n_layer=4, n_head=2, d_model=32, d_ff=64, max_seq_len=32, vocab_size=120, dropout=0.0))
    if family == "gpt":
        tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
        model = GPT(GPTConfig(n_layer=4, n_head=2, d_model=32, d_ff=64, max_seq_len=32, vocab_size=tok.vocab_size))
        return model, tok
    if family == "llama":  # LlamaForSequenceClassification scores without a bias: every pooling refused
        return Llama(LlamaConfig(n_layer=4, n_head=2, n_kv_head=1, d_model=32, d_ff=64, max_seq_len=32, vocab_size=120))
    if family == "t5":
        return T5(T5Config(n_layer=2, n_decoder_layer=2, n_head=2, d_model=32, d_ff=64, vocab_size=120))
    if family == "modernbert":
        return ModernBert(ModernBertConfig(n_layer=3, n_head=2, d_model=32, d_ff=48, vocab_size=120, local_window=4))
    return ViT(ViTConfig(image_size=16, patch_size=4, n_layer=2, n_head=2, d_model=32, d_ff=64))


def batch_for(family: str, pad: int = 0) -> dict:
    """Two inputs, the second right-padded (ids avoid the pad id)."""
    g = torch.Generator().manual_seed(1)
    if family == "vit":
        return {"pixels": torch.randn(2, 3, 16, 16, generator=g)}
    ids = torch.randint(5, 100, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    ids[1, 6:] = pad
    out = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    if family == "t5":
        out["decoder_input_ids"] = torch.zeros(2, 1, dtype=torch.long)
    return out


def theirs(family: str, arch: str, out, batch) -> torch.Tensor:
    """The exported directory loaded as its config says, every weight from the file -> logits (B, n)."""
    model, info = getattr(transformers, auto_class(arch)).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]  # nothing initialised at random
    model.eval()
    if family == "vit":
        return model(pixel_values=batch["pixels"]).logits
    inputs = {
        k: batch[k]
        for k in ("input_ids", "attention_mask", "token_type_ids")
        if family == "bert" or k != "token_type_ids"  # token types: BERT's alone
    }
    if arch != "BertModel":
        return model(**inputs).logits
    # sentence-transformers' pipeline as its folders say: mean pooling, then the Dense layer
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"]
    from safetensors.torch import load_file

    dense = load_file(str(out / "2_Dense" / "model.safetensors"))
    hidden, m = model(**inputs).last_hidden_state, batch["attention_mask"][..., None].float()
    return ((hidden * m).sum(1) / m.sum(1)) @ dense["linear.weight"].T + dense["linear.bias"]


CASES = [(family, pooling, False) for family, poolings in POOLINGS.items() for pooling in poolings] + [
    ("bert", "mean", True),
    ("bert", "cls", True),
]


@pytest.mark.parametrize("family,pooling,lora", CASES, ids=[f"{f}-{p}{'-lora' if lo else ''}" for f, p, lo in CASES])
def test_a_classifier_export_loads_with_its_logits_or_is_refused(family, pooling, lora, tmp_path):
    made = tiny(family)
    model, tok = made if isinstance(made, tuple) else (made, None)
    jiggle_(model)
    if lora:
        adapters.apply(model, "lora", AdapterConfig(targets=("q", "k", "v", "o", "up", "down")))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora" in name:
                    p.normal_(0, 0.1)
    model.eval()
    head = torch.nn.Linear(feature_dim(model.cfg, pooling), len(LABELS))
    torch.nn.init.normal_(head.bias, 0, 0.5)
    batch = batch_for(family, pad=tok.eos_id if tok is not None else 0)
    with torch.no_grad():
        ours = head(features(model, batch, pooling))
    backbone = Backbone(model, tok, heads={f"classifier.{k}": v for k, v in head.state_dict().items()}, labels=LABELS)
    recipe = SimpleNamespace(finetune=SimpleNamespace(), settings=SimpleNamespace(pooling=pooling))
    out = tmp_path / "hf"
    exportable = (family, pooling) in {
        ("bert", "cls"),
        ("bert", "mean"),
        ("modernbert", "cls"),
        ("gpt", "last"),
        ("vit", "cls"),
        ("vit", "mean"),
    }
    if not exportable:
        with pytest.raises(UserError, match="no transformers class computes"):
            hf.export(backbone, recipe, out)
        assert not out.exists()
        return
    arch, loads_with = hf.export(backbone, recipe, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    if arch == "BertModel":  # labels in the config would make AutoModelForSequenceClassification load a random head
        assert "id2label" not in config and "num_labels" not in config and "SentenceTransformer" in loads_with
        assert json.loads((out / "labels.json").read_text()) == list(LABELS)
    else:
        assert auto_class(arch) in loads_with and config["id2label"]["2"] == "contradiction"
    with torch.no_grad():
        assert close(theirs(family, arch, out, batch), ours, 1e-5)
