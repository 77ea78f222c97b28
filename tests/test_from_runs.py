"""Finetuning from a finetuning run: `--from` an adapter run is its base with the adapters
merged (SFT -> DPO with new adapters over the merged SFT model, whose reference is that model; SFT ->
full finetuning), said in one note line; a run that fails before its first checkpoint leaves no
directory; and every method that creates parameters (adapters, heads) creates the same ones in two
runs of the same command."""

from __future__ import annotations

import pytest
import torch

from tfcli import adapters
from tfcli.engine import model_source
from tfcli.engine.backbone import from_run
from tfcli.errors import UserError

from .conftest import invoke, read_metrics, train_losses, write_jsonl
from .test_dpo import PAIRS
from .test_gguf import chat_gguf_file

ROWS = [{"prompt": f"What is {a} plus {b}?", "completion": f"It is {a + b}."} for a in range(1, 5) for b in range(1, 5)]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return chat_gguf_file(tmp_path_factory)


@pytest.fixture(scope="module")
def sft_lora(tmp_path_factory, chat_model):
    """Two LoRA SFT steps on the tiny chat model."""
    tmp = tmp_path_factory.mktemp("sft-lora")
    data = write_jsonl(tmp / "rows.jsonl", ROWS)
    result = invoke(
        "finetune",
        "sft",
        "--from",
        chat_model,
        "--data",
        data,
        "--train",
        "lora",
        "--steps",
        2,
        "--batch-size",
        4,
        "--lr",
        5e-2,
        "--out",
        tmp / "run",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    return tmp / "run"


def logits_of(model, ids=None):
    ids = torch.arange(3, 19).view(2, 8) if ids is None else ids
    with torch.no_grad():
        return model.logits(model(ids))


def test_an_adapter_run_as_from_is_its_base_with_the_adapters_merged(sft_lora):
    from tfcli import recipe as recipes
    from tfcli.driver import make_plugin
    from tfcli.engine.backbone import load
    from tfcli.engine.runtime import setup_runtime

    adapted = from_run(sft_lora, which="best").model
    assert any(isinstance(m, adapters.LoRALinear) for m in adapted.modules())
    assert (
        float(next(m for m in adapted.modules() if isinstance(m, adapters.LoRALinear)).lora_b.detach().abs().sum()) > 0
    )
    rt = setup_runtime("cpu")
    plugin = make_plugin("task", "sft", rt, quiet=True)
    merged = load(model_source.resolve(sft_lora), recipes.load_resolved(sft_lora / "config.yaml"), plugin, rt).model
    assert not any(isinstance(m, (adapters.LoRALinear, adapters.IA3Linear)) for m in merged.modules())
    assert torch.allclose(logits_of(merged.eval()), logits_of(adapted), atol=1e-5)


def test_sft_lora_then_dpo_lora_trains_new_adapters_over_the_merged_sft_model(sft_lora, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 2)
    result = invoke(
        "finetune",
        "dpo",
        "--from",
        sft_lora,
        "--data",
        data,
        "--train",
        "lora",
        "--steps",
        2,
        "--batch-size",
        4,
        "--out",
        tmp_path / "dpo",
        "--set",
        "train.log_interval=1",
        "--set",
        "data.val_fraction=0.25",
    )
    assert result.exit_code == 0, result.output
    assert (
        "note:" in result.output and "LoRA adapters (" in result.output and "merged into its base" in result.output
    ), result.output
    # the reference is the adapter-free model, i.e. the merged SFT model: at step 1 policy == reference
    first = [m for m in read_metrics(tmp_path / "dpo") if m["split"] == "train"][0]
    assert first["loss"] == pytest.approx(0.693147, abs=1e-5)
    weights = from_run(tmp_path / "dpo", which="latest")
    assert any(isinstance(m, adapters.LoRALinear) for m in weights.model.modules())


def test_sft_lora_then_full_finetuning_trains_every_parameter_and_loads(sft_lora, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    result = invoke(
        "finetune",
        "sft",
        "--from",
        sft_lora,
        "--data",
        data,
        "--train",
        "all",
        "--steps",
        2,
        "--batch-size",
        4,
        "--out",
        tmp_path / "full",
    )
    assert result.exit_code == 0, result.output
    assert "(100.00%, all)" in result.output, result.output
    model = from_run(tmp_path / "full").model
    assert not any(isinstance(m, adapters.LoRALinear) for m in model.modules())
    assert (
        invoke(
            "generate",
            "--checkpoint",
            tmp_path / "full",
            "--prompt",
            "What is 1 plus 2?",
            "--chat",
            "--greedy",
            "--max-new-tokens",
            3,
        ).exit_code
        == 0
    )


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_directory(chat_model, tmp_path, monkeypatch):
    from tfcli.engine import trainer as trainer

    def fail(self):
        raise UserError("the loss was poisoned")

    monkeypatch.setattr(trainer.Trainer, "_fit", fail)
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    result = invoke(
        "finetune",
        "sft",
        "--from",
        chat_model,
        "--data",
        data,
        "--train",
        "lora",
        "--steps",
        2,
        "--out",
        tmp_path / "run",
        "--quiet",
    )
    assert result.exit_code == 2 and "the loss was poisoned" in result.output, result.output
    assert not (tmp_path / "run").exists()


# --- two runs of the same command create the same parameters ----------------------------------------


@pytest.mark.parametrize(
    "method", ["all", "lora", *(pytest.param(s, marks=pytest.mark.slow) for s in ("head", "ia3", "bitfit"))]
)
def test_two_runs_of_a_classifier_from_a_pretrained_model_give_the_same_losses(method, hf_bert, mnli_dir, tmp_path):
    losses = []
    for n in range(2):
        torch.manual_seed(n)  # what a fresh process starts with differs from run to run
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
            tmp_path / f"run{n}",
            "--quiet",
            "--set",
            "train.log_interval=1",
            "--set",
            "finetune.eval_limit=4",
            "--set",
            "adapter.dropout=0.1",
        )
        assert result.exit_code == 0, result.output
        losses.append(train_losses(tmp_path / f"run{n}"))
    assert losses[0] == losses[1]


@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_two_dpo_runs_with_new_adapters_give_the_same_losses(method, chat_model, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    losses = []
    for n in range(2):
        torch.manual_seed(n)
        result = invoke(
            "finetune",
            "dpo",
            "--from",
            chat_model,
            "--data",
            data,
            "--train",
            method,
            "--steps",
            3,
            "--batch-size",
            4,
            "--lr",
            1e-2,
            "--out",
            tmp_path / f"run{n}",
            "--quiet",
            "--set",
            "train.log_interval=1",
            "--set",
            "data.val_fraction=0.25",
        )
        assert result.exit_code == 0, result.output
        losses.append(train_losses(tmp_path / f"run{n}"))
    assert losses[0] == losses[1] and losses[0][2] != losses[0][1]
