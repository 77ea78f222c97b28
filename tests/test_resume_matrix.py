"""Every run resumes bit for bit, whatever its task and method: every task (mnli, classify,
image-classify, sft, gsm8k, dpo) x every method it takes x one family per model kind, and every
pretraining objective, is run for 3 steps with a checkpoint at step 2, cut back to that checkpoint and
resumed; the resumed run logs the uninterrupted run's losses exactly. Resuming must not depend on
which parameters happened to get gradients (a BERT pooler that mean pooling never reads)."""

from __future__ import annotations

import json
import shutil

import pytest

from .conftest import invoke, pretrained_run, set_args, tiny_npz, train_losses, write_jsonl
from .test_dpo import PAIRS
from .test_from_runs import ROWS
from .test_gguf import chat_gguf_file

pytestmark = pytest.mark.slow

EVERY_STEP = [
    "--set",
    "train.log_interval=1",
    "--set",
    "train.ckpt_interval=2",
    "--set",
    "train.eval_interval=2",
    "--set",
    "train.keep_checkpoints=5",
]
METHODS = ["all", "head", "lora", "ia3", "bitfit"]


def cut_and_resume(command: str, whole, tmp_path, *resume_args):
    """The run cut back to its step-2 checkpoint (as a crash would leave it), resumed: its losses."""
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step-0000003")
    for pointer in ("latest", "best"):
        if (cut / "checkpoints" / pointer).is_file():
            (cut / "checkpoints" / pointer).write_text("step-0000002")
    keep = [line for line in (cut / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2]
    (cut / "metrics.jsonl").write_text("\n".join(keep) + "\n")
    result = invoke(command, *resume_args, "--resume", cut, "--quiet")
    assert result.exit_code == 0, result.output
    return train_losses(cut)


def assert_resumes_exactly(command: str, args: list, tmp_path, resume_args: tuple = ()):
    whole = tmp_path / "whole"
    result = invoke(command, *args, "--steps", 3, "--out", whole, "--quiet", *EVERY_STEP)
    assert result.exit_code == 0, result.output
    expected = train_losses(whole)
    assert sorted(expected) == [1, 2, 3]
    assert cut_and_resume(command, whole, tmp_path, *resume_args) == expected


# --- the models, one per kind ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):  # a decoder (llama, ChatML), long enough for GSM8K's solutions
    return chat_gguf_file(tmp_path_factory, max_seq_len=512)


@pytest.fixture(scope="module")
def t5_model(tmp_path_factory, small_text):  # an encoder-decoder
    return pretrained_run(
        tmp_path_factory.mktemp("t5"),
        small_text,
        "span",
        {"family": "t5", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 96},
    )


@pytest.fixture(scope="module")
def vit_model(tmp_path_factory):  # a vision encoder (an MAE run), and its images
    from .conftest import mae_overrides

    root = tmp_path_factory.mktemp("vit")
    npz = tiny_npz(root / "tiny.npz")
    result = invoke(
        "pretrain",
        "--objective",
        "mae",
        "--out",
        root / "mae",
        "--quiet",
        *set_args(mae_overrides(npz, **{"train.steps": 1})),
    )
    assert result.exit_code == 0, result.output
    return root / "mae", npz


# --- tasks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_mnli_on_a_text_encoder(method, pooling, hf_bert, mnli_dir, tmp_path):
    assert_resumes_exactly(
        "finetune",
        [
            "mnli",
            "--from",
            hf_bert,
            "--data",
            mnli_dir,
            "--train",
            method,
            "--pooling",
            pooling,
            "--batch-size",
            4,
            "--set",
            "finetune.eval_limit=4",
        ],
        tmp_path,
    )


def test_parameters_that_never_get_a_gradient_do_not_stop_a_resume(hf_bert, mnli_dir, tmp_path):
    """Features from the first block: the second block trains (--train all) but never gets a gradient,
    so AdamW makes no state for it; the resumed run must not expect any."""
    assert_resumes_exactly(
        "finetune",
        [
            "mnli",
            "--from",
            hf_bert,
            "--data",
            mnli_dir,
            "--train",
            "all",
            "--pooling",
            "mean",
            "--batch-size",
            4,
            "--set",
            "classify.layer=1",
            "--set",
            "finetune.eval_limit=4",
        ],
        tmp_path,
    )


@pytest.mark.parametrize("method", METHODS)
def test_mnli_on_a_decoder(method, chat_model, mnli_dir, tmp_path):
    assert_resumes_exactly(
        "finetune",
        [
            "mnli",
            "--from",
            chat_model,
            "--data",
            mnli_dir,
            "--train",
            method,
            "--batch-size",
            4,
            "--set",
            "finetune.eval_limit=4",
        ],
        tmp_path,
    )


@pytest.mark.parametrize("method", ["all", "lora", "ia3", "bitfit"])
def test_mnli_text_to_text_on_an_encoder_decoder(method, t5_model, mnli_dir, tmp_path):
    assert_resumes_exactly(
        "finetune",
        [
            "mnli",
            "--from",
            t5_model,
            "--data",
            mnli_dir,
            "--train",
            method,
            "--batch-size",
            4,
            "--set",
            "finetune.eval_limit=4",
        ],
        tmp_path,
    )


@pytest.mark.parametrize("method", ["all", "lora"])
def test_classify_on_a_decoder(method, chat_model, tmp_path):
    rows = [
        {"text": f"the number {i} is {'even' if i % 2 == 0 else 'odd'}", "label": ["even", "odd"][i % 2]}
        for i in range(40)
    ]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    assert_resumes_exactly(
        "finetune",
        [
            "classify",
            "--from",
            chat_model,
            "--data",
            data,
            "--train",
            method,
            "--text-fields",
            "text",
            "--batch-size",
            4,
            "--set",
            "finetune.eval_limit=4",
        ],
        tmp_path,
    )


@pytest.mark.parametrize("method", METHODS)
def test_image_classify_on_a_vision_encoder(method, vit_model, tmp_path):
    run, npz = vit_model
    assert_resumes_exactly(
        "finetune",
        [
            "image-classify",
            "--from",
            run,
            "--data",
            npz,
            "--train",
            method,
            "--batch-size",
            8,
            "--set",
            "finetune.eval_limit=8",
        ],
        tmp_path,
    )


@pytest.mark.parametrize("method", ["all", "lora", "ia3", "bitfit"])
def test_sft_on_a_decoder(method, chat_model, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    assert_resumes_exactly(
        "finetune",
        [
            "sft",
            "--from",
            chat_model,
            "--data",
            data,
            "--train",
            method,
            "--batch-size",
            4,
            "--set",
            "sft.generate_limit=2",
            "--set",
            "sft.max_new_tokens=4",
        ],
        tmp_path,
    )


@pytest.mark.parametrize("method", ["all", "lora"])
def test_sft_on_an_encoder_decoder(method, t5_model, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    assert_resumes_exactly(
        "finetune",
        [
            "sft",
            "--from",
            t5_model,
            "--data",
            data,
            "--train",
            method,
            "--batch-size",
            4,
            "--set",
            "sft.generate_limit=2",
            "--set",
            "sft.max_new_tokens=4",
        ],
        tmp_path,
    )


def test_gsm8k_on_a_decoder(chat_model, shared_data, tmp_path):
    data = tmp_path / "gsm8k"
    data.mkdir()
    for split in ("train", "test"):
        lines = (shared_data / "sft" / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[:12]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    assert_resumes_exactly(
        "finetune",
        [
            "gsm8k",
            "--from",
            chat_model,
            "--data",
            data,
            "--train",
            "lora",
            "--batch-size",
            2,
            "--set",
            "sft.generate_limit=2",
            "--set",
            "sft.max_new_tokens=4",
        ],
        tmp_path,
    )


@pytest.mark.parametrize(
    "method,reference", [("lora", "base"), ("ia3", "base"), ("all", "copy"), ("lora", "precompute")]
)
def test_dpo_on_a_decoder(method, reference, chat_model, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 2)
    assert_resumes_exactly(
        "finetune",
        [
            "dpo",
            "--from",
            chat_model,
            "--data",
            data,
            "--train",
            method,
            "--batch-size",
            4,
            "--lr",
            1e-2,
            "--set",
            f"dpo.reference={reference}",
            "--set",
            "data.val_fraction=0.25",
        ],
        tmp_path,
    )


@pytest.mark.parametrize("method", ["all", "lora", "qlora", "ia3", "bitfit"])
def test_grpo_on_a_decoder(method, chat_model, tmp_path):
    """Sampling included: the resumed run draws the same prompts and samples the same completions. With a
    KL term against the reference (copy for all and bitfit, the base with adapters off otherwise)."""
    from .test_grpo import PROMPTS

    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    (tmp_path / "r.py").write_text("def n(completions, **kw):\n    return [float(len(c) % 3) for c in completions]\n")
    assert_resumes_exactly(
        "finetune",
        [
            "grpo", "--from", chat_model, "--data", data, "--reward", f"{tmp_path}/r.py:n", "--train", method,
            "--batch-size", 2, "--lr", 1e-3, "--set", "grpo.num_generations=4", "--set", "grpo.max_completion_length=8",
            "--set", "grpo.beta=0.05", "--set", "grpo.eval_prompts=2", "--set", "data.val_fraction=0.125",
        ],
        tmp_path,
        resume_args=("--reward", f"{tmp_path}/r.py:n"),  # a recorded file reward is imported only when named
    )  # fmt: skip


# --- pretraining objectives -----------------------------------------------------------------------

TEXT_MODELS = {
    "clm": {
        "model.family": "gpt",
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.d_model": 32,
        "model.d_ff": 64,
        "model.max_seq_len": 32,
        "data.seq_len": 32,
    },
    "mlm": {
        "model.family": "bert",
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.d_model": 32,
        "model.d_ff": 64,
        "model.max_seq_len": 64,
        "data.seq_len": 64,
    },
    "span": {
        "model.family": "t5",
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.d_model": 32,
        "model.d_ff": 64,
        "model.max_seq_len": 64,
        "data.seq_len": 64,
    },
    "electra": {
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.d_model": 32,
        "model.d_ff": 64,
        "model.max_seq_len": 64,
        "data.seq_len": 64,
    },
}


@pytest.mark.parametrize("objective", sorted(TEXT_MODELS))
def test_pretraining_a_text_model(objective, small_text, tmp_path):
    settings = {
        **TEXT_MODELS[objective],
        "tokenizer.vocab_size": 400,
        "tokenizer.train_chars": 30_000,
        "train.batch_size": 4,
        "train.eval_batches": 1,
        "data.val_fraction": 0.1,
    }
    text = tmp_path / "text.txt"
    text.write_text(small_text.read_text()[:30_000])
    assert_resumes_exactly("pretrain", ["--objective", objective, "--data", text, *set_args(settings)], tmp_path)


def test_pretraining_mae(tmp_path):
    from .conftest import mae_overrides

    npz = tiny_npz(tmp_path / "tiny.npz")
    overrides = {
        k: v
        for k, v in mae_overrides(npz).items()
        if k not in ("train.steps", "train.log_interval", "train.eval_interval", "train.ckpt_interval")
    }
    assert_resumes_exactly("pretrain", ["--objective", "mae", *set_args(overrides)], tmp_path)


def test_pretraining_igpt(tmp_path):
    npz = tiny_npz(tmp_path / "tiny.npz")
    settings = {
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.d_model": 32,
        "model.d_ff": 64,
        "igpt.image_size": 8,
        "igpt.palette": 16,
        "igpt.kmeans_pixels": 4000,
        "train.batch_size": 4,
        "train.eval_batches": 1,
    }
    assert_resumes_exactly("pretrain", ["--objective", "igpt", "--data", npz, *set_args(settings)], tmp_path)
