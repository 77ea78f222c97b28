"""The memory plan: tensors counted as they live, the probes' extrapolation equal to the
full model's own count, --dry-run (no weight read, nothing written), train.memory_limit choosing
recomputation and micro-batches (the same losses), and one-line errors."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tfcli.engine import memory
from tfcli.errors import UserError

from .conftest import DEVICE, REPO, invoke, read_metrics, tiny_gpt_recipe, train_losses
from .test_optimizers import tiny_llama_recipe
from .test_resume_matrix import assert_resumes_exactly


def dry_run_plan(*args):
    import typer

    from tfcli.cli import app

    return typer.main.get_command(app)([str(a) for a in args] + ["--dry-run", "--quiet"], standalone_mode=False)


def set_pairs(sets) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def test_live_bytes_counts_what_is_alive_and_its_peak():
    with memory.LiveBytes() as counter:
        a = torch.empty(1000, dtype=torch.float32)  # 4,000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4,000 bytes
        view = a[:10]  # shares a's storage: nothing more
        del b
        c = torch.empty(250)  # 1,000 bytes
    assert counter.peak == 8000 and counter.live == 5000
    del a, view, c


@pytest.mark.parametrize(
    "text, expected",
    [("auto", None), ("0", 0.0), ("4GB", 4 * 2**30), ("4g", 4 * 2**30), ("3.5GiB", 3.5 * 2**30), ("512MB", 2**29)],
)
def test_memory_limits_read_as_sizes(text, expected):
    assert memory.parse_limit(text) == expected


def test_a_bad_memory_limit_is_one_line(small_text, write_recipe, tmp_path):
    recipe = write_recipe(tiny_gpt_recipe(small_text))
    result = invoke("pretrain", "--recipe", recipe, "--set", "train.memory_limit=lots", "--out", tmp_path / "r")
    assert result.exit_code == 2
    assert "train.memory_limit must be auto, 0 or a size such as 4GB" in result.output
    assert not (tmp_path / "r").exists()


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused(small_text, write_recipe, tmp_path):
    recipe = write_recipe(tiny_gpt_recipe(small_text))
    result = invoke("pretrain", "--recipe", recipe, "--set", "train.micro_batch_size=3", "--out", tmp_path / "r")
    assert (
        result.exit_code == 2
        and "train.micro_batch_size must be 0 or a divisor of train.batch_size (8)" in result.output
    )


def test_the_old_boolean_checkpointing_setting_still_reads():
    from tfcli import recipe as recipes

    raw = recipes.load_raw("llama-mini")
    for value, word in ((True, "blocks"), (False, "none")):
        raw["train"]["activation_checkpointing"] = value
        assert recipes.from_dict(raw).train.activation_checkpointing == word


def plan(step=1.0, weights=1.0, optimizer=2.0, runtime=1.0, checkpointing=False, micro=8) -> memory.Plan:
    figures = memory.Figures(weights=weights * 2**30, frozen=0.0, optimizer=optimizer * 2**30, step=step * 2**30)
    return memory.Plan(figures, float("nan"), 0.0, runtime * 2**30, 0.0, checkpointing, micro, 32, 2**36, "cpu")


def test_auto_keeps_recomputation_off_when_it_fits_and_activations_do_not_dominate():
    chosen, note = memory.choose(lambda ckpt, micro: plan(), 8, "auto", 0, 10 * 2**30)
    assert not chosen.checkpointing and chosen.micro_batch == 8 and note == ""


def test_auto_recomputes_when_activations_dominate_even_if_the_run_fits():
    def plans(ckpt, micro):
        return plan(step=0.5 if ckpt else 6.0, checkpointing=ckpt, micro=micro)

    chosen, note = memory.choose(plans, 8, "auto", 0, 100 * 2**30)
    assert chosen.checkpointing and chosen.micro_batch == 8
    assert note.startswith("recomputation on (the step's activations (6.00 GB) outweigh the weights and states)")


def test_a_limit_takes_recomputation_then_ever_smaller_micro_batches():
    def plans(ckpt, micro):  # the step shrinks with the micro-batch; recomputation halves it
        return plan(step=micro * (0.25 if ckpt else 0.5), checkpointing=ckpt, micro=micro)

    chosen, note = memory.choose(plans, 8, "auto", 0, 5.5 * 2**30)  # 4 GB of weights, states and process
    assert chosen.checkpointing and chosen.micro_batch == 4
    assert "micro-batches of 4 (2 per batch of 8, accumulated)" in note
    chosen, _ = memory.choose(plans, 8, "none", 0, 5.5 * 2**30)  # recomputation kept off: smaller micro-batches
    assert not chosen.checkpointing and chosen.micro_batch == 2
    with pytest.raises(UserError, match=r"does not fit train.memory_limit 3.00 GB: with recomputation on and "):
        memory.choose(plans, 8, "auto", 0, 3 * 2**30)


def test_the_probes_extrapolate_to_the_full_models_own_count(small_text):
    """Weights and optimizer states are exact; the step's peak within 2% of running the real depth."""
    from tfcli import recipe as recipes
    from tfcli.engine.trainer import ObjectiveModule, build_optimizer
    from tfcli.models import build_model, transformer_blocks
    from tfcli.objectives.losses import next_token_loss

    rec = recipes.from_dict(tiny_llama_recipe(small_text))
    cfg = dataclasses.replace(rec.model, n_layer=6, vocab_size=300)
    ids = torch.randint(0, 300, (8, 32), generator=torch.Generator().manual_seed(0))
    step = memory.Step(
        cfg=cfg,
        blocks=6,
        make_trained=lambda m: ObjectiveModule(m, torch.nn.ModuleDict(), next_token_loss),
        frozen={},
        batch={"input_ids": ids, "targets": ids},
        optimizer=lambda m: build_optimizer(m, rec),
        device=torch.device("cpu"),
        autocast=contextlib.nullcontext,
    )
    for ckpt in (False, True):
        planned, _ = memory.plan_step(step, ckpt)
        direct, _ = memory.probe_figures(step, 6, ckpt)
        assert len(transformer_blocks(build_model(cfg))) == 6
        assert planned.weights == pytest.approx(direct.weights, rel=1e-9)
        assert planned.optimizer == pytest.approx(direct.optimizer, rel=1e-9)
        assert planned.step == pytest.approx(direct.step, rel=0.02)
    off, on = memory.plan_step(step, False)[0], memory.plan_step(step, True)[0]
    assert on.step < off.step  # recomputation keeps less


@pytest.mark.parametrize("tied", [True, False])
def test_a_large_vocabulary_is_allocated_not_computed_and_counts_the_same(small_text, monkeypatch, tied):
    """A Gemma-3-270M-shaped --dry-run took minutes: its probes computed the 262k-vocabulary output
    layer and loss for every chunk of rows. Those ops now run once each and are otherwise allocated
    with their shapes alone: the probe counts the very same bytes, for both settings of recomputation
    (the time it saves is measured in the results page, not here)."""
    from tfcli import recipe as recipes
    from tfcli.engine.trainer import ObjectiveModule, build_optimizer
    from tfcli.objectives.losses import next_token_loss

    rec = recipes.from_dict(tiny_llama_recipe(small_text))
    cfg = dataclasses.replace(rec.model, n_layer=2, vocab_size=40000, tie_word_embeddings=tied)
    ids = torch.randint(0, 40000, (64, 32), generator=torch.Generator().manual_seed(0))  # loss chunks: 838 x 2 + 372
    step = memory.Step(
        cfg=cfg,
        blocks=2,
        make_trained=lambda m: ObjectiveModule(m, torch.nn.ModuleDict(), next_token_loss),
        frozen={},
        batch={"input_ids": ids, "targets": ids},
        optimizer=lambda m: build_optimizer(m, rec),
        device=torch.device("cpu"),
        autocast=contextlib.nullcontext,
    )
    assert memory.large_vocab(cfg) == 40000
    allocated = []
    original = memory.LiveBytes._allocated_only

    def counted(self, func, args, kwargs):
        out = original(self, func, args, kwargs)
        allocated.append(out is not None)
        return out

    for ckpt in (False, True):
        monkeypatch.setattr(memory.LiveBytes, "_allocated_only", counted)
        fast, fast_grads = memory.probe_figures(step, 1, ckpt)
        monkeypatch.setattr(memory, "LARGE_VOCAB", 10**9)  # every op computed, as before
        full, full_grads = memory.probe_figures(step, 1, ckpt)
        monkeypatch.undo()
        assert fast == full and fast_grads == full_grads
        assert sum(allocated) > 5  # the second chunk's products and passes were not computed
        allocated.clear()


def test_a_factory_op_in_the_losss_repeated_loop_is_counted_not_lost():
    """The fused loss's reused logits buffer grows with torch.empty(n) inside its repeated loop: an op
    with no tensor among its inputs. A probe let the first run and, at the second of the same shape,
    asked its (absent) first input for a device: an IndexError that stopped an ORPO run on SmolLM2."""
    from tfcli.engine import scratch

    with memory.LiveBytes(shapes_only_at=40000) as counter, scratch.repeated_ops():
        first = torch.empty(1000)
        second = torch.empty(1000)
    assert first.shape == second.shape == (1000,) and counter.peak >= 2 * 4000


def test_a_probe_costs_one_forward_and_backward_and_starts_from_the_first_steps_states(small_text):
    """Every run plans, so the probes' cost is paid by every run: one counted pass per probe depth; the
    optimizer's states (as a first step leaves them) come from a step on zero gradients, not a pass."""
    from tfcli import recipe as recipes
    from tfcli.engine.trainer import ObjectiveModule, build_optimizer
    from tfcli.objectives.losses import next_token_loss

    rec = recipes.from_dict(tiny_llama_recipe(small_text))
    cfg = dataclasses.replace(rec.model, n_layer=6, vocab_size=300)
    ids = torch.randint(0, 300, (8, 32), generator=torch.Generator().manual_seed(0))
    passes, states = [], []

    def counted(model):
        module = ObjectiveModule(model, torch.nn.ModuleDict(), next_token_loss)
        module.register_forward_hook(lambda *_: passes.append(1))
        return module

    def optimizer(model):
        opt = build_optimizer(model, rec)
        opt.register_step_post_hook(lambda o, *_: states.append(optimizers.state_bytes(o)))
        return opt

    from tfcli.engine import optimizers

    step = memory.Step(
        cfg=cfg,
        blocks=6,
        make_trained=counted,
        frozen={},
        batch={"input_ids": ids, "targets": ids},
        optimizer=optimizer,
        device=torch.device("cpu"),
        autocast=contextlib.nullcontext,
    )
    figures, _ = memory.probe_figures(step, 2, False)
    assert len(passes) == 1
    assert states[0] == states[-1] == figures.optimizer > 0  # the counted pass found the states there


def test_a_dry_run_prints_the_plan_and_writes_nothing(small_text, write_recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tiny_llama_recipe(small_text))
    result = invoke("pretrain", "--recipe", recipe, "--dry-run", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "planned peak" in result.output and "step peak, recomputation on" in result.output
    assert "memory plan: " in result.output and "nothing trained" in result.output
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_a_dry_run_of_a_pretrained_model_reads_no_weights(tmp_path, monkeypatch, small_text, write_recipe):
    """--from a Hugging Face directory: the model is built on the meta device from the header's shapes."""
    from tfcli.engine import backbone as backbones
    from tfcli.hf import convert

    run = tmp_path / "base"
    recipe = write_recipe(tiny_llama_recipe(small_text))
    assert invoke("pretrain", "--recipe", recipe, "--steps", 2, "--out", run, "--quiet").exit_code == 0
    assert invoke("export", "--checkpoint", run, "--hf", tmp_path / "hf").exit_code == 0

    def no_weights(*args, **kwargs):
        raise AssertionError("a dry run read the weights")

    monkeypatch.setattr(convert, "_load_safetensors", no_weights)
    result = invoke("pretrain", "--from", tmp_path / "hf", "--dry-run", "--set", f"data.source={small_text}")
    assert result.exit_code == 0, result.output
    assert "reading the weights" in result.output
    shapes = convert.read_state(tmp_path / "hf", shapes_only=True)
    assert shapes and all(t.is_meta for t in shapes.values())
    monkeypatch.undo()
    assert backbones.from_hf(tmp_path / "hf", [], shapes_only=True).model.lm_head_weight.is_meta


def test_every_run_prints_its_plan_and_its_measured_peak(small_text, write_recipe, tmp_path):
    recipe = write_recipe(tiny_llama_recipe(small_text))
    result = invoke("pretrain", "--recipe", recipe, "--steps", 2, "--out", tmp_path / "r")
    assert result.exit_code == 0, result.output
    assert "memory plan: " in result.output and "peak memory: " in result.output and "(planned " in result.output
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    plan = run["memory_plan"]
    assert plan["peak"] > plan["runtime"] >= 0 and plan["micro_batch"] == 8
    assert (plan["runtime"] > 0) == (run["device"] == "cpu")  # CUDA's count has no process in it


def test_with_a_limit_the_probes_run_under_the_allocator_setting_and_give_their_memory_back(
    small_text, write_recipe, tmp_path, monkeypatch
):
    """glibc's allocator is told to map large blocks before the plan's probes run (set after them, the
    probes' activations stayed resident in its heap under the training step: SmolLM2 LoRA DPO with
    recomputation peaked 32% above its plan), and what they freed is given back before training."""
    calls = []
    for name in ("follow_the_plan", "probe_figures", "returned_to_os"):
        real = getattr(memory, name)
        monkeypatch.setattr(
            memory, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1]
        )
    recipe = write_recipe(tiny_llama_recipe(small_text))
    result = invoke(
        "pretrain", "--recipe", recipe, "--steps", 1, "--set", "train.memory_limit=64GB", "--out", tmp_path / "r",
        "--set", "train.device=cpu",  # glibc's allocator: the CPU's
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    probes = [i for i, c in enumerate(calls) if c == "probe_figures"]
    assert probes and calls.index("follow_the_plan") < probes[0]
    assert "returned_to_os" in calls[probes[-1] :]


@pytest.mark.slow
def test_micro_batches_give_the_same_losses_as_the_whole_batch(small_text, write_recipe, tmp_path):
    """train.micro_batch_size 2 of a batch of 8: the same examples, accumulated to the same gradient."""
    recipe = write_recipe(tiny_llama_recipe(small_text))
    losses = {}
    for micro in (0, 2):
        run = tmp_path / f"m{micro}"
        args = ("--recipe", recipe, "--steps", 6, "--set", f"train.micro_batch_size={micro}", "--out", run, "--quiet")
        args += ("--set", "train.device=cpu")  # fp32 arithmetic, to compare after updates (bf16 rounds apart)
        assert invoke("pretrain", *args).exit_code == 0
        losses[micro] = train_losses(run)
    assert losses[0][1] == pytest.approx(losses[2][1], abs=1e-5)
    assert all(losses[0][s] == pytest.approx(losses[2][s], abs=1e-4) for s in losses[0])


@pytest.mark.slow
def test_a_memory_limit_splits_the_batch_and_keeps_the_losses(small_text, write_recipe, tmp_path, monkeypatch):
    """A limit between the plan of micro-batches of 2 and of the whole batch: the run says what it chose
    and trains the same losses as without a limit; config.yaml records the choice (a resume keeps it).
    The process's own memory is held constant: this test process's grows from one run to the next."""
    monkeypatch.setattr(memory, "resident_bytes", lambda: 300.0 * 2**20)
    recipe = write_recipe(tiny_llama_recipe(small_text, batch_size=8))

    def planned(*sets):
        return dry_run_plan("pretrain", "--recipe", recipe, "--set", "train.memory_limit=0", *set_pairs(sets))

    whole = planned("train.activation_checkpointing=none")
    micro = planned("train.activation_checkpointing=none", "train.micro_batch_size=2")
    assert micro.training < whole.training
    limit = int((micro.training + whole.training) / 2)
    free, limited = tmp_path / "free", tmp_path / "limited"
    base = ("--recipe", recipe, "--steps", 4, "--set", "train.activation_checkpointing=none")
    assert invoke("pretrain", *base, "--set", "train.memory_limit=0", "--out", free, "--quiet").exit_code == 0
    result = invoke("pretrain", *base, "--set", f"train.memory_limit={limit}", "--out", limited)
    assert result.exit_code == 0, result.output
    assert "micro-batches of " in result.output
    assert "micro_batch_size: 0" not in (limited / "config.yaml").read_text()
    a, b = train_losses(free), train_losses(limited)
    assert a[1] == pytest.approx(b[1], abs=1e-5) and all(a[s] == pytest.approx(b[s], abs=1e-4) for s in a)


def test_a_limit_nothing_meets_is_one_line_before_anything_is_written(small_text, write_recipe, tmp_path):
    """Weights and states that fit, a step that does not at any micro-batch: the plan runs on one batch
    of the data, so the text is tokenized first (its progress line, when no earlier run cached it: it
    depended on the tests' order); then the one-line error, before the run directory exists."""
    recipe = write_recipe(tiny_llama_recipe(small_text))
    result = invoke("pretrain", "--recipe", recipe, "--set", "train.memory_limit=50MB", "--out", tmp_path / "r")
    assert result.exit_code == 2
    *before, error = result.output.strip().splitlines()
    assert error.startswith("error: this run does not fit train.memory_limit 50 MB: with recomputation on and micro")
    assert all(line.startswith("tokenized ") for line in before) and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "task,train,sets,limit,held",
    [
        (
            "sft",
            "all",
            [],
            "1MB",
            r"its weights \(6 MB\), their gradients \(6 MB\) and optimizer states \(12 MB\) take 25 MB",
        ),
        ("sft", "lora", [], "1MB", r"its weights take 6 MB"),
        (
            "dpo",
            "lora",
            ["dpo.reference=copy"],
            "8MB",
            r"its weights \(6 MB\) and the frozen reference copy \(6 MB\) take 12 MB",
        ),
    ],
    ids=["all", "lora", "dpo-reference-copy"],
)
def test_weights_and_states_beyond_the_limit_are_refused_before_the_weights_or_data_are_read(
    tmp_path, monkeypatch, task, train, sets, limit, held
):
    """A model whose weights (and, training them all, gradients and AdamW's states; a reference model's
    copy of them) pass the limit is refused from its config alone: one line with those figures, no
    weight, tokenizer or data read, no run directory (a model too large for the machine must not be
    killed while it is read)."""
    from tfcli.engine import backbone
    from tfcli.tasks.dpo import DPO
    from tfcli.tasks.sft import SFT

    from .conftest import hf_llama_dir

    source = hf_llama_dir(tmp_path / "base")  # GPT-2's vocabulary x 32: 1.6M parameters, 6.5 MB in fp32
    for name in ("load_hf_weights", "shared_tokenizer", "load_tokenizer_files"):
        monkeypatch.setattr(backbone, name, lambda *a, **k: pytest.fail("read before the limit was checked"))
    for plugin in (SFT, DPO):
        monkeypatch.setattr(plugin, "setup", lambda *a, **k: pytest.fail("data read before the limit was checked"))
    args = ["finetune", task, "--from", source, "--data", tmp_path / "absent.jsonl", "--train", train]
    args += [a for s in [*sets, f"train.memory_limit={limit}"] for a in ("--set", s)]
    result = invoke(*args, "--out", tmp_path / "r")
    assert result.exit_code == 2, result.output
    *notes, line = result.output.strip().splitlines()  # --train lora notes its defaults first
    assert re.match(
        rf"error: this run does not fit train.memory_limit {limit[:-2]} MB: before any activation, {held}", line
    )
    assert "checked before its weights or data were read" in line and all(n.startswith("note:") for n in notes)
    if task == "dpo":  # the way out it names: the model with its adapters off needs no copy
        assert line.endswith("try dpo.reference base (the model with its adapters off: no copy), or --train qlora")
    assert not (tmp_path / "r").exists()


def test_the_floor_counts_a_reference_copy_only_where_the_run_holds_one():
    """dpo.reference auto is the adapter-free base under LoRA (no copy) and a copy under full
    finetuning; GRPO holds a reference only with its KL term (beta > 0)."""
    from tfcli import recipe as recipes
    from tfcli.driver import make_plugin
    from tfcli.engine.runtime import Runtime

    def copies(task, train, **settings):
        overrides = {"finetune.train": train, **{f"{task}.{k}": v for k, v in settings.items()}}
        plugin = make_plugin("task", task, Runtime(torch.device("cpu")), quiet=True)
        return plugin.frozen_copies(recipes.load(plugin.default_recipe(), overrides))

    assert [copies("dpo", "lora"), copies("dpo", "all"), copies("dpo", "lora", reference="copy")] == [0, 1, 1]
    assert [copies("grpo", "all"), copies("grpo", "all", beta=0.04), copies("grpo", "lora", beta=0.04)] == [0, 1, 0]
    assert copies("sft", "all") == 0


@pytest.mark.slow
def test_a_run_in_micro_batches_resumes_bit_for_bit(small_text, write_recipe, tmp_path):
    recipe = write_recipe(tiny_llama_recipe(small_text))
    assert_resumes_exactly("pretrain", ["--recipe", recipe, "--set", "train.micro_batch_size=4"], tmp_path)


def test_metrics_still_log_the_measured_peak(small_text, write_recipe, tmp_path):
    recipe = write_recipe(tiny_gpt_recipe(small_text))
    assert invoke("pretrain", "--recipe", recipe, "--steps", 2, "--out", tmp_path / "r", "--quiet").exit_code == 0
    assert all(m["peak_mem_mb"] > 0 for m in read_metrics(tmp_path / "r") if m["split"] == "train")


# --- a dry run of every kind of run, the model on the meta device ------------------------------------

from .test_resume_matrix import chat_model, t5_model, vit_model  # noqa: E402, F401  (fixtures)


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["copy", "base", "precompute"])
def test_a_dpo_dry_run_counts_its_reference(reference, chat_model, tmp_path):  # noqa: F811
    from .conftest import write_jsonl
    from .test_dpo import PAIRS

    data = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 4)
    plan = dry_run_plan(
        "finetune",
        "dpo",
        "--from",
        chat_model,
        "--data",
        data,
        "--train",
        "lora",
        "--batch-size",
        4,
        "--set",
        f"dpo.reference={reference}",
    )
    assert (plan.figures.frozen > 0) == (reference == "copy")
    assert plan.figures.weights > 0 and plan.figures.step > 0


def test_a_dpo_plan_follows_its_rows_a_prompt_read_once_costs_less(chat_model, tmp_path):  # noqa: F811
    """Rows of a pair each are planned as wide as the data's longest pair makes one, a row per reply at
    data.seq_len: long prompts read once plan a smaller step."""
    from tfcli.objectives import losses

    from .conftest import write_jsonl
    from .test_dpo import PAIRS

    rows = [{**p, "prompt": "Tell me, please, " * 4 + p["prompt"]} for p in PAIRS * 4]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    steps = {}
    for share in ("true", "false"):
        losses._cpu_chunk["logits"] = torch.empty(0)  # as in a fresh process: an earlier test's buffer counts whole
        args = ["--data", data, "--train", "lora", "--batch-size", 4, "--set", f"dpo.share_prompt={share}"]
        steps[share] = dry_run_plan(
            "finetune", "dpo", "--from", chat_model, *args, "--set", "data.seq_len=64"
        ).figures.step
    assert steps["true"] < 0.8 * steps["false"], steps


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft-t5", "qlora", "mae", "image-classify"])
def test_a_dry_run_plans_every_kind(kind, chat_model, t5_model, vit_model, tmp_path):  # noqa: F811
    from .conftest import mae_overrides, set_args, write_jsonl
    from .test_from_runs import ROWS

    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    args = {
        "sft-t5": ["finetune", "sft", "--from", t5_model, "--data", rows, "--batch-size", 4],
        "qlora": ["finetune", "sft", "--from", chat_model, "--data", rows, "--train", "qlora", "--batch-size", 4],
        "mae": ["pretrain", "--objective", "mae", *set_args(mae_overrides(vit_model[1]))],
        "image-classify": [
            "finetune",
            "image-classify",
            "--from",
            vit_model[0],
            "--data",
            vit_model[1],
            "--batch-size",
            4,
        ],
    }[kind]
    plan = dry_run_plan(*args)
    assert plan.peak > plan.runtime >= 0 and plan.figures.weights > 0 and plan.figures.step > 0
    assert (plan.runtime > 0) == (plan.device == "cpu")  # CUDA's count has no process in it


RESIDENT_PEAK = """
import sys

import torch
from tfcli.engine import memory
from tfcli.objectives.losses import token_logprobs

memory.follow_the_plan()  # blocks of 1 MB and more are mapped and unmapped: resident memory follows them
g = torch.Generator().manual_seed(0)
h = torch.randn(4, 1024, 64, generator=g, requires_grad=True)
w = torch.randn(8192, 64, generator=g)  # 4,096 rows against 8,192 columns, in tiles
t = torch.randint(0, 8192, (4, 1024), generator=g)
if sys.argv[1] == "forward":  # a reference's pass
    run = lambda: torch.no_grad()(token_logprobs)(h, w, t)
else:
    run = lambda: token_logprobs(h, w, t).sum().backward()
run()


def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))


open("/proc/self/clear_refs", "w").write("5")  # resets the resident high-water mark
before = status("VmRSS:")
run()
resident = status("VmHWM:") - before
counter = memory.LiveBytes([h, w, t])
with counter:
    run()
print(resident, counter.peak)
"""


@pytest.mark.slow  # two fresh processes
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="Linux's resident high-water mark")
def test_the_log_probs_allocate_what_the_plan_counts_one_chunk_at_a_time():
    """token_logprobs (DPO's and GRPO's log pi) computed logsumexp over each (c, V) chunk of logits, which
    allocates a copy of the chunk inside the op that no tensor count sees: the plan under-counted a
    reference's pass by a chunk, 128 MB then. Forward and backward hold one tile of logits at a time
    (4,096 rows x 1,024 columns, 16 MB), and the process's resident peak is what the count says."""
    from tfcli.objectives import losses

    rows, cols = losses._tile(4096, 8192)
    chunk = rows * cols * 4
    for what in ("forward", "backward"):
        out = subprocess.run([sys.executable, "-c", RESIDENT_PEAK, what], capture_output=True, text=True, cwd=REPO)
        assert out.returncode == 0, out.stderr
        resident, counted = map(int, out.stdout.split())
        assert chunk < counted < chunk + 24 * 2**20, (what, counted / 2**20)
        assert resident < counted + 24 * 2**20, (what, resident / 2**20, counted / 2**20)


def _block_stack(family: str):
    """(a tiny model's blocks, a forward through it without gradients) of one family."""
    from tfcli.models import FAMILIES

    config, model_class = FAMILIES[family]
    if family == "vit":
        model = model_class(config(d_model=32, n_head=2, d_ff=64, n_layer=4)).eval()
        return model.blocks, lambda: model(torch.randn(2, 3, 32, 32))
    model = model_class(config(vocab_size=64, d_model=32, n_head=2)).eval()
    return model.blocks, lambda: model(torch.randint(0, 64, (2, 16)))


@pytest.mark.parametrize("family", ["gpt", "llama", "bert", "vit"])
def test_a_forward_without_gradients_frees_each_blocks_output_once_the_next_block_has_read_it(family):
    """A frozen reference's pass (DPO, GRPO), evaluation and generation run without gradients: their
    peak is one block's activations, not every block's output kept for a list nobody asked for (which
    put DPO's reference pass, with recomputation, 0.27 GB over its plan on an H100)."""
    import weakref

    blocks, forward = _block_stack(family)
    outputs, alive_at_last_block = [], []
    hooks = [b.register_forward_hook(lambda m, i, out: outputs.append(weakref.ref(out))) for b in blocks]
    hooks.append(
        blocks[-1].register_forward_pre_hook(
            lambda m, i: alive_at_last_block.append(sum(r() is not None for r in outputs))
        )
    )
    with torch.no_grad():
        forward()
    for h in hooks:
        h.remove()
    assert len(outputs) == len(blocks) == 4
    assert alive_at_last_block == [1]  # the last block's input only


def test_writing_a_checkpoint_copies_no_tensor_already_on_the_cpu(tmp_path):
    """A checkpoint's optimizer states (AdamW's two moments: twice the weights) are written from where
    they are: a copy of each, made only to be written, raised a run's peak by the moments' bytes at
    every save (SmolLM2 full SFT: +1.0 GB, above its training steps' peak). Only tensors sharing
    storage with one already stored are copied (safetensors refuses shared storage)."""
    from tfcli.engine import checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    base = torch.arange(10.0)
    state = {"optimizer": opt.state_dict(), "views": (base[:4], base[4:])}
    moments = [s[k] for s in opt.state_dict()["state"].values() for k in ("exp_avg", "exp_avg_sq")]
    steps = [s["step"] for s in opt.state_dict()["state"].values()]
    with memory.LiveBytes(held=[*moments, *steps, base]) as counter:
        checkpoint.write_state(tmp_path, state)
    assert counter.peak <= 6 * 4  # the second view's copy (its 6 floats); no moment copied
    back = checkpoint.load_state(tmp_path)
    assert torch.equal(back["views"][1], base[4:]) and torch.equal(back["views"][0], base[:4])
    for saved, read in zip(
        moments, [s[k] for s in back["optimizer"]["state"].values() for k in ("exp_avg", "exp_avg_sq")]
    ):
        assert torch.equal(saved, read)


def kept_for_backward(fn, module: torch.nn.Module) -> tuple:
    """fn()'s output and {storage: bytes} of what autograd keeps for its backward pass, the module's
    weights left out (a weight's transpose, which a linear keeps, is a view of the weight)."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, kept


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_a_gated_mlp_keeps_its_two_inputs_not_the_activation_and_its_gradients_are_eagers_to_the_bit(
    activation, precision
):
    """act(gate) * up keeps gate, up and act(gate) for backward under autograd; the gated MLP keeps
    gate and up and recomputes the activation (as liger-kernel's SwiGLU does): a quarter less of the
    MLP's activations with the down projection's input (SmolLM2, 8 x 512: 24 MB a block, 0.7 GB over
    30 blocks without recomputation), with the same gradients as eager autograd, bit for bit, in fp32
    and under bf16 autocast (a GPU's default), on the tests' device."""
    from tfcli.models.blocks import ACTIVATIONS, MLP

    torch.manual_seed(0)
    mlp = MLP(16, 64, activation=activation, bias=False, gated=True).to(DEVICE)
    x = torch.randn(4, 8, 16, device=DEVICE, requires_grad=True)
    upstream = torch.randn(4, 8, 16, device=DEVICE)
    act = ACTIVATIONS[activation]
    autocast = torch.autocast(torch.device(DEVICE).type, torch.bfloat16, enabled=precision == "bf16")
    results = []
    for fn in (lambda: mlp(x), lambda: mlp.down(act(mlp.gate(x)) * mlp.up(x))):  # ours, then autograd's
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        with autocast:
            out, kept = kept_for_backward(fn, mlp)
        (out.float() * upstream).sum().backward()
        results.append((out, sum(kept.values()), [x.grad, *(p.grad for p in mlp.parameters())]))
    (out, kept, grads), (eager, eager_kept, eager_grads) = results
    assert torch.equal(out, eager) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads))
    itemsize = 2 if precision == "bf16" else 4
    assert eager_kept - kept == 4 * 8 * 64 * itemsize  # one (B, T, d_ff) tensor less


def test_attention_with_rotary_positions_keeps_its_values_not_the_whole_fused_projection():
    """Rotary positions make q and k new tensors; the values were a view of the fused qkv output, so
    backward kept all of it (SmolLM2 at 8 x 512: 15 MB a block for 3 MB of values). Nothing autograd
    keeps shares the fused projection's storage now (on any device: CUDA's attention kernels keep
    other tensors than the CPU's)."""
    from tfcli.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(n_layer=1, n_head=4, n_kv_head=2, d_model=64, d_ff=192, vocab_size=50, max_seq_len=32)
    model = Llama(cfg).to(DEVICE)
    fused = []  # the projection's output, held so that its memory cannot be reused by what is kept
    model.blocks[0].attn.qkv.register_forward_hook(lambda module, inputs, out: fused.append(out))
    _, kept = kept_for_backward(lambda: model(torch.randint(0, 50, (2, 32), device=DEVICE)), model)
    assert len(fused) == 1 and fused[0].untyped_storage().data_ptr() not in kept


def test_a_tfcli_process_puts_large_cpu_tensors_on_huge_pages_unless_told_not_to():
    """Importing tfcli (every entry point does, before torch) turns on PyTorch's huge-page switch for
    CPU tensors of 2 MB and more; THP_MEM_ALLOC_ENABLE=0 from the user keeps glibc's own pages."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.is_file() or "[never]" in mode.read_text():
        pytest.skip("this kernel has no transparent huge pages")
    code = (
        "import os, re, tfcli, torch; t = torch.ones(64 * 2**20 // 4); "
        "rollup = open('/proc/self/smaps_rollup').read(); "
        "print(os.environ['THP_MEM_ALLOC_ENABLE'], re.search(r'AnonHugePages:\\s+(\\d+)', rollup).group(1))"
    )
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    seen = {}
    for setting in ("default", "0"):
        extra = {} if setting == "default" else {"THP_MEM_ALLOC_ENABLE": setting}
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        flag, huge_kb = out.stdout.split()
        seen[setting] = (flag, int(huge_kb))
    assert seen["default"][0] == "1" and seen["default"][1] >= 32 * 1024  # most of the 64 MB tensor
    if "[madvise]" in mode.read_text():  # only what asks for huge pages gets them
        assert seen["0"] == ("0", 0) or seen["0"][1] < seen["default"][1] // 4


def test_training_blocks_give_the_heaps_free_pages_back_and_evaluation_does_not(monkeypatch):
    """memory.trim_after_each_block: malloc_trim after every block's forward while training (the holes
    glibc's heap keeps between activations are what put a CPU run's peak above its plan); nothing in
    eval mode, where decoding calls each block once a token."""
    from tfcli.models import build_model, transformer_blocks
    from tfcli.models.gpt import GPTConfig

    calls = []

    class FakeLibc:
        def malloc_trim(self, pad):
            calls.append(pad)
            return 1

    monkeypatch.setattr(memory, "_libc", lambda: FakeLibc())
    model = build_model(GPTConfig(vocab_size=64, n_layer=3, n_head=2, d_model=16, max_seq_len=8))
    memory.trim_after_each_block(model)
    ids = torch.randint(0, 64, (2, 8))
    model.train()(ids)
    assert calls == [0] * len(transformer_blocks(model)) == [0, 0, 0]
    model.eval()(ids)
    assert len(calls) == 3


def held(megabytes: int) -> bytearray:
    """Memory this process really holds (every page written), to make it the larger process."""
    ballast = bytearray(megabytes * 2**20)
    ballast[:: 2**12] = b"\1" * len(ballast[:: 2**12])
    return ballast


@pytest.mark.slow  # a process of its own importing torch: the whole suite only
def test_the_peak_a_process_reports_is_its_own_not_the_peak_of_the_process_that_started_it():
    """getrusage's ru_maxrss survives fork and exec: a compare cell, a torchrun worker or a benchmark's
    side reported the larger starting process's peak as its own (every cell of a grid run from pytest
    logged the same 986 MB). A process of some 300 MB is asked, started by one holding 400 MB more
    than a test process's own."""
    ballast = held(400)
    code = "import torch; from tfcli.engine.perf import peak_resident_bytes; print(peak_resident_bytes())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    from tfcli.engine.perf import peak_resident_bytes

    parent, child = peak_resident_bytes() / 2**20, float(out.stdout) / 2**20
    assert 50 < child < parent - 300, (parent, child)  # the ballast alone is 400 MB
    del ballast
