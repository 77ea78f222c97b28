"""Parameter-efficient finetuning through one adapter module for every family: LoRA and IA3 leave the
outputs exactly as they were at initialisation; each method trains only its parameters; merging
gives the adapted model's outputs; a LoRA run saves only its adapters and head, resumes bit for bit,
evaluates, and exports a plain transformers model with the same logits."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from tfcli import adapters
from tfcli.engine import checkpoint
from tfcli.errors import UserError
from tfcli.models.bert import Bert, BertConfig
from tfcli.models.gpt import GPT, GPTConfig
from tfcli.models.t5 import T5, T5Config
from tfcli.models.vit import ViT, ViTConfig
from tfcli.recipe import AdapterConfig

from .conftest import close, invoke, train_losses


def tiny(family: str):
    torch.manual_seed(0)
    return {
        "gpt": lambda: GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, vocab_size=50, max_seq_len=16)),
        "bert": lambda: Bert(BertConfig(n_layer=2, n_head=2, d_model=16, vocab_size=50, dropout=0.0)),
        "t5": lambda: T5(T5Config(n_layer=2, n_head=2, d_model=16, d_ff=32, vocab_size=50)),
        "vit": lambda: ViT(
            ViTConfig(
                image_size=8,
                patch_size=4,
                n_layer=2,
                n_head=2,
                d_model=16,
                d_ff=32,
                decoder_d_model=16,
                decoder_n_head=2,
            )
        ),
    }[family]().eval()


def run(model, family: str) -> torch.Tensor:
    torch.manual_seed(1)
    if family == "vit":
        return model(torch.randn(2, 3, 8, 8))
    ids = torch.randint(0, 50, (2, 7))
    return model(ids, None, ids) if family == "t5" else model(ids)


FAMILIES = ["gpt", "bert", "t5", "vit"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_adapters_at_initialisation_change_nothing(family, method):
    base = tiny(family)
    adapted = copy.deepcopy(base)
    n = adapters.apply(adapted, method, AdapterConfig(targets=("q", "k", "v", "o", "up", "down")))
    assert n > 0
    with torch.no_grad():
        assert torch.equal(run(base, family), run(adapted, family))


EXPECTED = {  # which parameters train (a predicate on the name)
    "all": lambda n: True,
    "head": lambda n: False,
    "lora": lambda n: "lora_" in n,
    "ia3": lambda n: n.endswith(".ia3"),
    "bitfit": lambda n: n.endswith("bias") or "norm" in n or n.startswith("ln_"),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", sorted(EXPECTED))
def test_only_the_intended_parameters_receive_gradients(family, method):
    model = tiny(family).train()
    adapters.apply(model, method, AdapterConfig())
    if method == "head":
        assert not any(p.requires_grad for p in model.parameters())
        return
    run(model, family).float().pow(2).mean().backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None}
    want = {n for n, p in model.named_parameters() if EXPECTED[method](n)}
    assert got <= want and got, (sorted(got - want), sorted(want - got)[:5])
    assert all(not p.requires_grad for n, p in model.named_parameters() if not EXPECTED[method](n))
    if method == "lora":  # q and v only, of the fused projection: the adapter knows its slices
        lora = next(m for m in model.modules() if isinstance(m, adapters.LoRALinear) and m.parts == ("q", "k", "v"))
        assert lora.enabled == [True, False, True]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_merging_gives_the_adapted_outputs(family, method):
    model = tiny(family)
    adapters.apply(model, method, AdapterConfig(targets=("q", "v", "o", "up", "gate", "down")))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_b" in n or n.endswith(".ia3"):
                p.add_(torch.randn_like(p) * 0.3)
        adapted = run(model, family)
        adapters.merge(model)
        assert not any(isinstance(m, (adapters.LoRALinear, adapters.IA3Linear)) for m in model.modules())
        assert close(run(model, family), adapted, 1e-5)


def finetune_lora(hf_bert, mnli_dir, out, *extra):
    return invoke(
        "finetune",
        "mnli",
        "--from",
        hf_bert,
        "--data",
        mnli_dir,
        "--train",
        "lora",
        "--steps",
        6,
        "--batch-size",
        8,
        "--out",
        out,
        "--quiet",
        "--set",
        "train.ckpt_interval=3",
        "--set",
        "train.eval_interval=3",
        "--set",
        "train.log_interval=1",
        "--set",
        "train.keep_checkpoints=5",
        "--set",
        "finetune.eval_limit=6",
        "--set",
        "adapter.rank=4",
        *extra,
    )


def test_a_lora_run_saves_only_adapters_resumes_evaluates_and_exports_merged(hf_bert, mnli_dir, tmp_path):
    whole = tmp_path / "whole"
    result = finetune_lora(hf_bert, mnli_dir, whole, "--pooling", "cls")  # exports as BertForSequenceClassification
    assert result.exit_code == 0, result.output
    weights = checkpoint.load_weights(checkpoint.find(whole))
    assert set(weights) == {k for k in weights if "lora_" in k or k.startswith("heads.")}
    assert any("lora_a" in k for k in weights) and "heads.classifier.weight" in weights
    assert json.loads((whole / "run.json").read_text())["from"] == str(hf_bert)
    # resumed from its step-3 checkpoint, the same losses
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step-0000006")
    for name in ("latest", "best"):
        (cut / "checkpoints" / name).write_text("step-0000003")
    result = invoke("finetune", "mnli", "--resume", cut, "--quiet")
    assert result.exit_code == 0, result.output
    a, b = train_losses(whole), train_losses(cut)
    assert [b[s] for s in (4, 5, 6)] == [a[s] for s in (4, 5, 6)]
    result = invoke("eval", "--checkpoint", whole)
    assert result.exit_code == 0 and "dev_matched: accuracy" in result.output, result.output
    # export folds the adapters in: transformers loads a plain classifier with the same logits
    transformers = pytest.importorskip("transformers")
    assert invoke("export", "--checkpoint", whole, "--hf", tmp_path / "hf").exit_code == 0
    hf = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    from tfcli.engine.backbone import from_run
    from tfcli.tasks.heads import features

    ours = from_run(whole, which="best")
    ids = torch.randint(1000, 5000, (2, 12))
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        logits = (
            features(ours.model, batch, "cls") @ ours.heads["classifier.weight"].t() + ours.heads["classifier.bias"]
        )
        assert close(logits, hf(**batch).logits, 1e-5)


@pytest.mark.parametrize("method", ["ia3", "bitfit", "head"])
def test_every_method_trains_and_reports_what_it_trains(method, hf_bert, mnli_dir, tmp_path):
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        hf_bert,
        "--data",
        mnli_dir,
        "--train",
        method,
        "--steps",
        2,
        "--batch-size",
        8,
        "--out",
        tmp_path / "run",
        "--set",
        "finetune.eval_limit=6",
    )
    assert result.exit_code == 0, result.output
    assert f", {method})" in result.output and "training " in result.output
    weights = checkpoint.load_weights(checkpoint.find(tmp_path / "run"))
    assert "model.wte.weight" not in weights  # only what trained, and the head


@pytest.mark.slow  # whole suite only: other fast tests exercise its modules
def test_a_partial_run_reads_its_base_again_and_names_it_when_gone(small_text, mnli_dir, tmp_path):
    from .conftest import pretrained_run

    (tmp_path / "pre").mkdir()
    base = pretrained_run(
        tmp_path / "pre",
        small_text,
        "mlm",
        {"family": "bert", "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 64},
        tokenizer={"kind": "wordpiece", "vocab_size": 400, "train_chars": 30_000},
        mlm={"documents": "paragraphs"},
    )
    run = tmp_path / "lora"
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        base,
        "--data",
        mnli_dir,
        "--train",
        "lora",
        "--steps",
        2,
        "--batch-size",
        4,
        "--out",
        run,
        "--quiet",
        "--set",
        "finetune.eval_limit=6",
    )
    assert result.exit_code == 0, result.output
    record = json.loads((run / "run.json").read_text())
    assert (
        record["from_checkpoint"].endswith("step-0000002")
        and record["parameters"]["trained"] < record["parameters"]["total"]
    )
    assert invoke("eval", "--checkpoint", run, "--limit", 6).exit_code == 0
    shutil.rmtree(base)
    result = invoke("eval", "--checkpoint", run, "--limit", 6)
    assert result.exit_code == 2 and "its base model" in result.output and "is not found" in result.output


@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_disabled_adapters_give_the_base_model_and_come_back(method):
    """adapters.disabled(model): the base model's outputs exactly inside the block, the adapted ones
    after it (the DPO reference without a second copy); a model without adapters is refused."""
    from tfcli.recipe import AdapterConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=16, vocab_size=50)).eval()
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        base = model(ids)
        adapters.apply(model, method, AdapterConfig(targets=("q", "k", "v", "o", "up", "down")))
        for name, p in model.named_parameters():
            if "lora" in name or "ia3" in name:
                p.add_(torch.randn_like(p) * 0.1)
        adapted = model(ids)
        with adapters.disabled(model):
            assert torch.equal(model(ids), base)
        assert torch.equal(model(ids), adapted) and not torch.allclose(adapted, base)
    plain = GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, d_ff=64, max_seq_len=16, vocab_size=50))
    with pytest.raises(UserError, match="no LoRA or IA3 adapters"):
        with adapters.disabled(plain):
            pass


@pytest.mark.parametrize("pooling,trains_pooler", [("cls", True), ("mean", False)])
def test_the_pooler_trains_only_when_the_classifier_reads_it(pooling, trains_pooler, hf_bert, mnli_dir, tmp_path):
    """BERT's pooler is read by [CLS] pooling alone: with mean pooling BitFit leaves its bias out of
    what trains (and so out of the checkpoint and the optimizer)."""
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        hf_bert,
        "--data",
        mnli_dir,
        "--train",
        "bitfit",
        "--pooling",
        pooling,
        "--steps",
        1,
        "--batch-size",
        4,
        "--out",
        tmp_path / "run",
        "--quiet",
        "--set",
        "finetune.eval_limit=4",
    )
    assert result.exit_code == 0, result.output
    weights = checkpoint.load_weights(checkpoint.find(tmp_path / "run"))
    assert ("model.pooler.bias" in weights) == trains_pooler
    assert any(k.endswith(".bias") and "pooler" not in k for k in weights)  # the other biases train
