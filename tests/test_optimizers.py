"""Low-bit optimizer states (optim.name adamw8bit / adamw4bit, torchao): the moments take at most 30%
(8-bit) and 20% (4-bit) of fp32 AdamW's memory, training follows fp32 AdamW closely, a run resumes bit
for bit (the states stored as plain tensors, nothing pickled), and a checkpoint holding anything else is
refused."""

from __future__ import annotations

import pytest
import torch

from tfcli.engine import optimizers
from tfcli.errors import UserError
from tfcli.recipe import OptimConfig

from .conftest import invoke, read_metrics
from .test_resume_matrix import assert_resumes_exactly

pytest.importorskip("torchao")

LLAMA = {"family": "llama", "n_layer": 2, "n_head": 2, "n_kv_head": 1, "d_model": 64, "d_ff": 128, "max_seq_len": 32}


def tiny_llama_recipe(data, **train) -> dict:
    from .conftest import tiny_gpt_recipe

    raw = tiny_gpt_recipe(data)
    raw["model"] = dict(LLAMA)
    raw["train"].update(train)
    return raw


def model_and_step(name: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = optimizers.build([{"params": list(model.parameters())}], OptimConfig(name=name, lr=1e-3))
    for seed in range(3):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(seed))
        model(x).pow(2).mean().backward()
        optimizers.step(opt, torch.tensor(0.0))
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("name, most", [("adamw8bit", 0.30), ("adamw4bit", 0.20)])
def test_low_bit_moments_take_a_fraction_of_fp32_memory(name, most):
    _, fp32 = model_and_step("adamw")
    _, low = model_and_step(name)
    fp32_bytes = optimizers.state_bytes(fp32) - 4 * len(fp32.state)  # without the step counters
    assert optimizers.state_bytes(low) <= most * fp32_bytes


def test_a_non_finite_step_is_skipped_by_the_low_bit_optimizer_too():
    model, opt = model_and_step("adamw8bit")
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(8, 256)).pow(2).mean().backward()
    optimizers.step(opt, torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_states_round_trip_through_plain_tensors_and_a_foreign_class_is_refused():
    model, opt = model_and_step("adamw4bit")
    stored = optimizers.plain(opt.state_dict())
    state = next(iter(stored["state"].values()))["exp_avg"]
    assert state["__lowbit__"] == "OptimState4bit" and all(type(t) is torch.Tensor for t in state["parts"].values())
    again = optimizers.rebuilt(stored)
    first = next(iter(again["state"].values()))["exp_avg"]
    assert type(first).__name__ == "OptimState4bit"
    assert torch.equal(first.dequantize(), next(iter(opt.state.values()))["exp_avg"].dequantize())
    with pytest.raises(UserError, match="does not rebuild"):
        optimizers.rebuilt({"__lowbit__": "Evil", "parts": {}, "ctx": [], "shape": [], "stride": []})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_a_low_bit_run_resumes_bit_for_bit(name, small_text, write_recipe, tmp_path):
    recipe = write_recipe(tiny_llama_recipe(small_text))
    assert_resumes_exactly("pretrain", ["--recipe", recipe, "--set", f"optim.name={name}"], tmp_path)


@pytest.mark.slow
def test_eight_bit_training_follows_fp32_adamw(small_text, write_recipe, tmp_path):
    """30 steps of a small llama: the held-out loss falls and ends within 2% of fp32 AdamW's (the
    200-step llama-mini comparison is `python -m benchmarks lowbit`)."""
    recipe = write_recipe(tiny_llama_recipe(small_text, eval_interval=30))
    final = {}
    for name in ("adamw", "adamw8bit"):
        run = tmp_path / name
        args = ("--recipe", recipe, "--steps", 30, "--lr", 3e-3, "--set", f"optim.name={name}", "--out", run, "--quiet")
        result = invoke("pretrain", *args)
        assert result.exit_code == 0, result.output
        val = [m for m in read_metrics(run) if m.get("split") == "val"]
        train = [m["loss"] for m in read_metrics(run) if m.get("split") == "train"]
        assert train[-1] < train[0]
        final[name] = val[-1]["loss"]
    assert abs(final["adamw8bit"] - final["adamw"]) <= 0.02 * final["adamw"]


def test_unequal_shares_under_fsdp_compile_their_own_step_instead_of_reading_inductors_cache():
    """Rows that do not split evenly over the processes (61 over 2: 31 and 30) give shares of two
    shapes, and inductor's on-disk graph cache handed one process the step compiled for the other's
    (a size assertion at the first step, torch 2.13): such a run turns the cache off in its process;
    one whose trained rows all split keeps it, and what does not train does not count."""
    import torch._inductor.config as inductor

    even = torch.nn.Sequential(torch.nn.Embedding(62, 64), torch.nn.Linear(64, 62))
    odd = torch.nn.Sequential(torch.nn.Embedding(62, 64), torch.nn.Linear(64, 61))
    before = inductor.fx_graph_cache
    try:
        inductor.fx_graph_cache = True
        assert not optimizers.for_unequal_shares(even, 2) and inductor.fx_graph_cache
        assert not optimizers.for_unequal_shares(odd.requires_grad_(False), 2) and inductor.fx_graph_cache
        assert optimizers.for_unequal_shares(odd.requires_grad_(True), 2) and not inductor.fx_graph_cache
    finally:
        inductor.fx_graph_cache = before
