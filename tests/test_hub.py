"""Hub ids for --from and --checkpoint: read from the local Hugging Face cache when offline, refused
in one line naming the cache when neither the cache nor the hub has them."""

from __future__ import annotations

import shutil

import pytest

from tfcli.engine import model_source
from tfcli.errors import UserError

from .conftest import invoke


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, hf_bert):
    """A Hugging Face cache holding acme/tiny-bert (as snapshot_download lays it out), offline."""
    constants = pytest.importorskip("huggingface_hub").constants
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-bert"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(hf_bert, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / commit


def test_a_hub_id_resolves_from_the_cache_offline(hf_cache):
    assert model_source.resolve("acme/tiny-bert").path == hf_cache


def test_an_uncached_hub_id_offline_is_one_line_naming_the_cache(hf_cache):
    with pytest.raises(
        UserError, match=r"--from acme/absent: not a local path, and not in the Hugging Face cache .*hub"
    ) as refused:
        model_source.resolve("acme/absent")
    assert "`hf download acme/absent --local-dir DIR`" in str(refused.value)  # how to get it for offline use


def test_an_unreachable_hub_is_one_line(hf_cache, monkeypatch):
    constants = pytest.importorskip("huggingface_hub").constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(UserError, match="the hub did not give it"):
        model_source.resolve("acme/absent")


def test_local_paths_win_and_missing_ones_are_named(tmp_path, hf_bert):
    assert model_source.resolve(str(hf_bert)).path == hf_bert
    with pytest.raises(UserError, match="not found"):
        model_source.resolve(str(tmp_path / "nothing" / "here"))


def test_finetune_from_a_cached_hub_id(hf_cache, mnli_dir, tmp_path):
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        "acme/tiny-bert",
        "--data",
        mnli_dir,
        "--steps",
        2,
        "--batch-size",
        4,
        "--out",
        tmp_path / "run",
        "--set",
        "finetune.eval_limit=6",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    import json

    assert json.loads((tmp_path / "run" / "run.json").read_text())["from"] == str(hf_cache.resolve())


def test_smollm2s_hub_id_reads_a_cached_llama_and_is_one_line_when_absent(tmp_path, monkeypatch):
    """HuggingFaceTB/SmolLM2-135M-Instruct as the hub id of a (tiny, random) llama in the local cache:
    generate and finetune sft read it offline; with an empty cache it is one line naming the cache."""
    from tfcli.hf import interop as hf

    from .test_gguf import tiny_backbone

    constants = pytest.importorskip("huggingface_hub").constants
    cache = tmp_path / "hub"
    repo = cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    hf.export(tiny_backbone(max_seq_len=128), None, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    result = invoke("generate", "--checkpoint", hub_id, "--chat", "--prompt", "hi", "--greedy", "--max-new-tokens", 3)
    assert result.exit_code == 0, result.output
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": "2+{i}?", "completion": "{2 + i}"}}\n' for i in range(20)))
    result = invoke(
        "finetune",
        "sft",
        "--from",
        hub_id,
        "--data",
        rows,
        "--steps",
        1,
        "--batch-size",
        2,
        "--out",
        tmp_path / "run",
        "--quiet",
        "--set",
        "sft.generate_limit=0",
    )
    assert result.exit_code == 0, result.output
    shutil.rmtree(repo)
    result = invoke("finetune", "sft", "--from", hub_id, "--data", rows, "--steps", 1, "--out", tmp_path / "again")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "not in the Hugging Face cache" in result.output and not (tmp_path / "again").exists()
