"""engine/runtime.py: what a run sets in torch for itself (deterministic kernels, CPU threads), and
gives back to the process after it."""

from __future__ import annotations

import pytest
import torch

from tfcli import recipe as recipes
from tfcli.errors import UserError

from .conftest import tiny_bert_recipe, tiny_gpt_recipe, train_losses
from .test_trainer import pretrain


def recording(read, seen: list):
    """setup_runtime that appends read() (a torch setting) to `seen` once the run's runtime is set up."""
    from tfcli.engine import runtime

    def setup(*args, **kwargs):
        rt = runtime.setup_runtime(*args, **kwargs)
        seen.append(read())
        return rt

    return setup


@pytest.mark.parametrize("make", [tiny_gpt_recipe, tiny_bert_recipe], ids=["clm", "mlm"])
def test_a_deterministic_run_trains_as_the_default_does_on_the_cpu_and_leaves_torch_as_it_was(
    tmp_path, small_text, make
):
    """train.deterministic turns on torch's repeatable kernels for the run (what a GPU needs to repeat a
    run or resume it bit for bit; the CPU's kernels repeat anyway, so the losses are the default's),
    and the process's setting is restored after it (runs inside a longer process: compare, tests)."""
    seen = []
    losses = {}
    for on in (False, True):
        raw = make(small_text)
        raw["train"].update(steps=6, log_interval=1, deterministic=on, device="cpu")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("tfcli.driver.setup_runtime", recording(torch.are_deterministic_algorithms_enabled, seen))
            losses[on] = train_losses(pretrain(recipes.from_dict(raw), out=tmp_path / f"d{on}"))
    assert seen == [False, True] and not torch.are_deterministic_algorithms_enabled()
    assert len(losses[True]) == 6 and losses[True] == losses[False]


def test_a_run_inside_a_longer_process_gives_torchs_thread_count_back(tmp_path, small_text):
    """train.threads sets torch's CPU threads for the run; the process that goes on after it (tests, a
    notebook) gets its own count back, whether the run trained or was refused: a count left above the
    process's cores makes every later small op wait on threads that have no core."""
    before = torch.get_num_threads()
    seen = []
    raw = tiny_gpt_recipe(small_text)
    raw["train"].update(steps=2, threads=before + 1, device="cpu")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tfcli.driver.setup_runtime", recording(torch.get_num_threads, seen))
        pretrain(recipes.from_dict(raw), out=tmp_path / "run")
        raw["train"]["strategy"] = "ddp"  # refused: it needs torchrun
        with pytest.raises(UserError, match="runs under torchrun"):
            pretrain(recipes.from_dict(raw), out=tmp_path / "refused")
    assert seen == [before + 1] and torch.get_num_threads() == before
