"""engine.model_source: what `--from` and `--checkpoint` name is worked out in one place, into one typed
answer (kind, path, run directory, family), and anything else is one line."""

from __future__ import annotations

import pytest

from tfcli.engine import model_source
from tfcli.engine.model_source import GGUF, HF, RUN
from tfcli.errors import UserError

from .conftest import pretrained_run
from .test_gguf import chat_gguf_file

TINY_GPT = {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "max_seq_len": 64}


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, small_text):
    return pretrained_run(tmp_path_factory.mktemp("run"), small_text, "clm", TINY_GPT)


def test_a_run_and_each_of_its_checkpoints_are_one_run(gpt_run):
    for path in (gpt_run, gpt_run / "checkpoints" / "step-0000002"):
        source = model_source.resolve(path)
        assert (source.kind, source.whole, source.run_dir, source.family) == (RUN, True, gpt_run, "gpt")
        assert not source.transformers_can_name


def test_a_transformers_directory_and_a_gguf_file(hf_bert, tmp_path_factory):
    source = model_source.resolve(hf_bert)
    assert (source.kind, source.run_dir, source.family, source.transformers_can_name) == (HF, None, "bert", True)
    assert source.config["model_type"] == "bert"
    gguf = model_source.resolve(chat_gguf_file(tmp_path_factory))
    assert (gguf.kind, gguf.family, gguf.is_gguf, gguf.transformers_can_name) == (GGUF, "llama", True, False)


def test_a_broken_run_is_still_a_run_so_that_its_fault_is_named(tmp_path):
    (tmp_path / "checkpoints").mkdir()  # a run directory whose config.yaml is gone
    source = model_source.resolve(tmp_path)
    assert (source.kind, source.whole) == (RUN, False)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "absent", "not found"),
        (lambda p: p, "neither a tfcli run nor a Hugging Face model directory"),
        (lambda p: (p / "notes.gguf.txt").write_text("x") and p / "notes.gguf.txt", "neither a tfcli run"),
    ],
)
def test_what_is_no_model_is_one_line_naming_the_flag(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(UserError, match=f"^--checkpoint {path}: {message}"):
        model_source.resolve(path, "--checkpoint")
    assert model_source.local(path) is None


def test_a_name_that_climbs_out_is_never_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^--from \.\./gpt2: not found$"):
        model_source.resolve("../gpt2")


def test_an_unsupported_architecture_is_named_by_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "hyena9"}')  # neither native nor transformers'
    with pytest.raises(UserError, match="model_type 'hyena9' is not supported"):
        _ = model_source.resolve(tmp_path).family
