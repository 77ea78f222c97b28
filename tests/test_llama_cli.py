"""The llama family through the whole tool, as GPT goes: pretraining on the built-in-style corpus with
a falling loss, bit-exact resume, FSDP equal to one process, generate, every finetuning method on
MNLI, classifier heads on the last token and the mean, and export --hf loaded by transformers with
the same logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from tfcli import recipe as recipes
from tfcli.driver import RunRequest, train
from tfcli.engine import checkpoint

from .conftest import close, invoke, near, read_metrics, tiny_gpt_recipe, train_losses
from .test_ddp import run_tfcli, train_rows

TINY_LLAMA = {
    "family": "llama",
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "d_model": 32,
    "d_ff": 64,
    "max_seq_len": 48,
}


def pretrain(recipe, out=None, resume=None, quiet=True):
    return train(RunRequest(recipe, out=out, resume=resume, quiet=quiet))[0]


def llama_recipe(data, **train) -> dict:
    raw = tiny_gpt_recipe(data, train=train)
    raw.update(
        name="tiny-llama",
        model=dict(TINY_LLAMA),
        data={**raw["data"], "seq_len": 48},
        tokenizer={"kind": "bpe", "vocab_size": 300, "train_chars": 30_000},
    )
    return raw


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, small_text):
    """20 steps of clm pretraining of a tiny llama (checkpoints at 10 and 20)."""
    tmp = tmp_path_factory.mktemp("llama")
    rec = recipes.from_dict(llama_recipe(small_text, steps=20, ckpt_interval=10, eval_interval=10))
    return pretrain(rec, out=tmp / "run", quiet=True)


def test_pretraining_learns_and_resumes_bit_for_bit(llama_run, tmp_path):
    losses = train_losses(llama_run)
    assert sum(losses[s] for s in (18, 19, 20)) < sum(losses[s] for s in (1, 2, 3)) - 0.5
    crashed = tmp_path / "crashed"
    shutil.copytree(llama_run, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step-0000020")
    (crashed / "checkpoints" / "latest").write_text("step-0000010")
    lines = (crashed / "metrics.jsonl").read_text().splitlines()
    (crashed / "metrics.jsonl").write_text("\n".join(l for l in lines if json.loads(l)["step"] <= 10) + "\n")
    pretrain(recipes.load_resolved(crashed / "config.yaml"), resume=crashed, quiet=True)
    resumed = train_losses(crashed)
    assert [resumed[s] for s in range(11, 21)] == [losses[s] for s in range(11, 21)]


def test_the_shipped_recipe_pretrains_on_the_built_in_corpus(tmp_path):
    result = invoke(
        "pretrain",
        "--objective",
        "clm",
        "--recipe",
        "llama-mini",
        "--steps",
        3,
        "--batch-size",
        4,
        "--set",
        "train.eval_interval=3",
        "--set",
        "train.eval_batches=1",
        "--out",
        tmp_path / "run",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    saved = recipes.load_resolved(tmp_path / "run" / "config.yaml").model
    assert saved.family == "llama" and saved.n_kv_head == 2 and saved.vocab_size > 0


@pytest.mark.slow
def test_fsdp_on_two_processes_matches_one(tmp_path, small_text):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(llama_recipe(small_text, steps=4, eval_interval=4, ckpt_interval=4)))
    run_tfcli(["pretrain", "--recipe", recipe, "--out", tmp_path / "one", "--batch-size", 8, "--quiet"], nproc=1)
    run_tfcli(
        [
            "pretrain",
            "--recipe",
            recipe,
            "--out",
            tmp_path / "fsdp",
            "--batch-size",
            4,
            "--quiet",
            "--set",
            "train.strategy=fsdp",
            "--set",
            "train.activation_checkpointing=true",
        ],
        nproc=2,
    )
    one, fsdp = train_rows(tmp_path / "one"), train_rows(tmp_path / "fsdp")
    assert sorted(one) == sorted(fsdp) == [1, 2, 3, 4]
    assert all(near(one[s], fsdp[s], 1e-5) for s in one), (one, fsdp)


def test_generate_streams_greedy_text(llama_run):
    args = ["generate", "--checkpoint", llama_run, "--prompt", "The", "--max-new-tokens", 8, "--greedy"]
    first, second = invoke(*args), invoke(*args)
    assert first.exit_code == 0, first.output
    assert first.output == second.output and first.output.startswith("The") and len(first.output) > 4


def test_export_loads_in_transformers_as_llama_with_the_same_logits(llama_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tfcli.engine.backbone import for_inference

    result = invoke("export", "--checkpoint", llama_run, "--hf", tmp_path / "hf")
    assert result.exit_code == 0, result.output
    assert "AutoModelForCausalLM" in result.output
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "LlamaForCausalLM" and theirs.config.num_key_value_heads == 2
    ours = for_inference(llama_run, device="cpu").model.eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert close(theirs(ids).logits, ours.logits(ours(ids)), 1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.decode(tok("The answer is").input_ids) == "The answer is"
    from .conftest import transformers_runs_the_export

    transformers_runs_the_export(tmp_path / "hf")


@pytest.mark.parametrize(
    "method", ["all", "lora", *(pytest.param(m, marks=pytest.mark.slow) for m in ("ia3", "bitfit"))]
)
def test_every_method_finetunes_mnli_as_text(method, llama_run, mnli_dir, tmp_path):
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        llama_run,
        "--data",
        mnli_dir,
        "--train",
        method,
        "--steps",
        3,
        "--batch-size",
        4,
        "--out",
        tmp_path / "run",
        "--quiet",
        "--set",
        "finetune.eval_limit=6",
    )
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    trained, total = record["parameters"]["trained"], record["parameters"]["total"]
    assert (trained == total) if method == "all" else (0 < trained < total / 4), (method, trained, total)
    assert invoke("eval", "--checkpoint", tmp_path / "run", "--limit", 6).exit_code == 0


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_classifier_head_pools_the_last_token_or_the_mean(pooling, llama_run, mnli_dir, tmp_path):
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        llama_run,
        "--data",
        mnli_dir,
        "--head",
        "classifier",
        "--pooling",
        pooling,
        "--train",
        "head",
        "--steps",
        3,
        "--batch-size",
        4,
        "--out",
        tmp_path / "run",
        "--quiet",
        "--set",
        "finetune.eval_limit=6",
    )
    assert result.exit_code == 0, result.output
    weights = checkpoint.load_weights(checkpoint.find(tmp_path / "run"))
    assert weights["heads.classifier.weight"].shape == (3, TINY_LLAMA["d_model"])
    losses = [m["loss"] for m in read_metrics(tmp_path / "run") if m.get("split") == "train"]
    assert losses and all(l == l for l in losses)  # finite
    refused = invoke("export", "--checkpoint", tmp_path / "run", "--hf", tmp_path / "hf")
    assert refused.exit_code == 2 and "without a bias" in refused.output and not (tmp_path / "hf").exists()
