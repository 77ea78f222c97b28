"""`tfcli probe`: a linear probe on every layer. On a task that only word order decides, the embeddings of
a random model are at chance and the last layer of a model trained on it is not; a run, a Hugging Face
directory and a GGUF are probed; the plot is drawn; features are computed once and reused by another
probe of the same model and data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tfcli.commands import probe
from tfcli.hf import interop as hf

from .conftest import invoke, pretrained_run
from .test_gguf import tiny_backbone

FILLER = "the a of to in and it is was on at by with as for".split()


def order_task(path, n: int, seed: int) -> None:
    """label 'first' when 'red' comes before 'blue', else 'second': the same words either way."""
    rng = np.random.default_rng(seed)
    lines = ["text,label"]
    for i in range(n):
        words = list(rng.choice(FILLER, 8))
        a, b = sorted(rng.choice(9, 2, replace=False))
        first = i % 2 == 0
        words.insert(a, "red" if first else "blue")
        words.insert(b + 1, "blue" if first else "red")
        lines.append(f"{' '.join(words)} end,{'first' if first else 'second'}")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def order_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("order")
    order_task(root / "train.csv", 400, 0)
    order_task(root / "dev.csv", 100, 1)
    return root


def test_the_last_layer_of_a_trained_model_knows_what_a_random_models_embeddings_cannot(
    tmp_path, order_data, small_text
):
    base = pretrained_run(
        tmp_path, small_text, "clm", {"family": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "max_seq_len": 64}
    )
    result = invoke(
        "finetune",
        "classify",
        "--from",
        base,
        "--data",
        order_data,
        "--text-fields",
        "text",
        "--head",
        "classifier",
        "--pooling",
        "last",
        "--steps",
        120,
        "--batch-size",
        16,
        "--lr",
        3e-3,
        "--out",
        tmp_path / "trained",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    args = ["probe", "classify", "--data", order_data, "--set", "classify.text_fields=[text]", "--pooling", "last"]
    result = invoke(*args, "--from", f"{base},{tmp_path / 'trained'}", "--out", tmp_path / "probe")
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "probe" / "probe.json").read_text())["results"]
    random_model, trained = saved[str(base)]["dev"], saved[str(tmp_path / "trained")]["dev"]
    assert random_model["0"] <= 0.65 and trained["2"] >= 0.85, (random_model, trained)
    assert (tmp_path / "probe" / "probe.png").stat().st_size > 5000


@pytest.mark.slow
def test_a_hugging_face_directory_and_a_gguf_are_probed_and_features_are_read_once(tmp_path, order_data, monkeypatch):
    backbone = tiny_backbone()
    hf.export(backbone, None, tmp_path / "hf")
    hf.export_gguf(tiny_backbone(), None, tmp_path / "model.gguf", "f32")
    args = [
        "probe",
        "classify",
        "--data",
        order_data,
        "--set",
        "classify.text_fields=[text]",
        "--limit",
        100,
        "--eval-limit",
        40,
        "--from",
        f"{tmp_path / 'hf'},{tmp_path / 'model.gguf'}",
    ]
    monkeypatch.setenv("TFCLI_CACHE", str(tmp_path / "cache"))
    result = invoke(*args, "--out", tmp_path / "a")
    assert result.exit_code == 0, result.output
    first = json.loads((tmp_path / "a" / "probe.json").read_text())["results"]
    assert all(len(r["dev"]) == 3 for r in first.values())  # the embeddings and two blocks
    assert first[str(tmp_path / "hf")]["dev"] == pytest.approx(first[str(tmp_path / "model.gguf")]["dev"], abs=0.03)
    monkeypatch.setattr(probe, "extract", lambda *a: pytest.fail("features were computed again"))
    result = invoke(*args, "--out", tmp_path / "b", "--method", "logistic", "--layers", "0,2")
    assert result.exit_code == 0, result.output
    assert list(json.loads((tmp_path / "b" / "probe.json").read_text())["results"][str(tmp_path / "hf")]["dev"]) == [
        "0",
        "2",
    ]
    bad = invoke(
        "probe",
        "classify",
        "--data",
        order_data,
        "--from",
        tmp_path / "hf",
        "--layers",
        "7",
        "--limit",
        100,
        "--eval-limit",
        40,
        "--set",
        "classify.text_fields=[text]",
        "--out",
        tmp_path / "c",
    )
    assert bad.exit_code == 2 and "depths 0 (the embeddings) to 2" in bad.output
