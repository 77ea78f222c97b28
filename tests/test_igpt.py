"""ImageGPT: a k-means palette that round-trips real images within a stated error, next-colour
pretraining whose loss falls and whose palette a resumed run reads back, half-images completed as a PNG
grid, and classifiers and probes of any layer of an igpt run."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from tfcli import recipe as recipes
from tfcli.data.images import ImageSet
from tfcli.data.palette import dequantize, fit_palette, quantize, squares
from tfcli.driver import RunRequest, train

from .conftest import invoke, tiny_npz, train_losses

TINY = [
    "--set",
    "igpt.image_size=8",
    "--set",
    "igpt.palette=16",
    "--set",
    "igpt.kmeans_pixels=4000",
    "--set",
    "model.n_layer=2",
    "--set",
    "model.d_model=32",
    "--set",
    "model.n_head=2",
    "--set",
    "model.d_ff=64",
    "--set",
    "train.batch_size=16",
    "--set",
    "train.log_interval=1",
    "--set",
    "schedule.warmup_steps=2",
]


@pytest.mark.slow
def test_a_512_colour_palette_round_trips_cifar_within_8_levels(shared_data):
    d = np.load(shared_data / "images" / "cifar10_subset" / "cifar10_subset.npz")
    rng = np.random.default_rng(0)
    pixels = d["x_train"][:1000].reshape(-1, 3)[rng.permutation(1000 * 1024)[:60_000]]
    palette = fit_palette(pixels, 512, iters=8, seed=0)
    assert palette.shape == (512, 3) and (np.diff(palette.sum(1)) >= 0).all()  # sorted by brightness
    test = d["x_test"][:100]
    back = dequantize(quantize(test, palette), palette, 32).astype(float)
    rmse = np.sqrt(((back - test) ** 2).mean())
    assert rmse < 8.0, rmse  # of 255 levels, on held-out images (measured 4.9 with 100k pixels, 10 iterations)
    assert (fit_palette(pixels[:5000], 16, 5, seed=3) == fit_palette(pixels[:5000], 16, 5, seed=3)).all()


def test_squares_cut_the_centre_and_resize():
    image = np.zeros((20, 30, 3), dtype=np.uint8)
    image[:, 5:25] = 200  # the central 20x20 square is bright, the sides dark
    out = squares(ImageSet([image]), 10)
    assert out.shape == (1, 10, 10, 3) and out.min() == 200


@pytest.fixture(scope="module")
def igpt_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("igpt")
    npz = tiny_npz(tmp / "x.npz")
    result = invoke(
        "pretrain",
        "--objective",
        "igpt",
        "--data",
        npz,
        "--steps",
        40,
        "--out",
        tmp / "run",
        *TINY,
        "--set",
        "train.eval_interval=20",
        "--set",
        "train.ckpt_interval=20",
    )
    assert result.exit_code == 0, result.output
    return tmp / "run", npz


def test_igpt_learns_and_a_resumed_run_reads_its_palette_back(igpt_run, tmp_path):
    run, npz = igpt_run
    losses = train_losses(run)
    assert np.mean([losses[s] for s in (38, 39, 40)]) < np.mean([losses[s] for s in (1, 2, 3)]) - 0.5
    assert (
        not (run / "tokenizer.json").exists() and len(json.loads((run / "palette.json").read_text())["colours"]) == 16
    )
    crashed = tmp_path / "crashed"
    shutil.copytree(run, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step-0000040")
    (crashed / "checkpoints" / "latest").write_text("step-0000020")
    train(RunRequest(recipes.load_resolved(crashed / "config.yaml"), resume=crashed, quiet=True))
    assert train_losses(crashed) == losses  # the same palette (read, not fitted again), the same steps


def test_generate_completes_half_images_and_draws_samples(igpt_run, tmp_path):
    run, _ = igpt_run
    result = invoke("generate", "--checkpoint", run, "--images", 4, "--seed", 1, "--out", tmp_path / "grid.png")
    assert result.exit_code == 0, result.output
    grid = np.asarray(Image.open(tmp_path / "grid.png"))
    cell = grid.shape[1] // 4  # four columns of (8 + 2) pixels, scaled
    assert grid.shape[0] == 4 * cell  # given halves, completions, originals, unconditional samples
    top = slice(cell // 10 + 1, cell // 2 - 1)
    assert (grid[top, :cell] == grid[2 * cell :][top, :cell]).all()  # the given half is the original's top
    refused = invoke("generate", "--checkpoint", tmp_path / "nothing", "--images", 2)
    assert refused.exit_code == 2


@pytest.mark.slow  # whole suite only: other fast tests exercise its modules
def test_a_classifier_and_a_probe_read_any_layer_of_an_igpt_run(igpt_run, tmp_path):
    run, npz = igpt_run
    result = invoke(
        "finetune",
        "image-classify",
        "--from",
        run,
        "--data",
        npz,
        "--train",
        "head",
        "--layer",
        1,
        "--steps",
        20,
        "--lr",
        0.05,
        "--out",
        tmp_path / "probe",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "probe" / "palette.json").is_file()
    report = json.loads((tmp_path / "probe" / "eval.json").read_text())
    assert report["test"]["acc"] >= 0.9  # the two classes are tinted apart
    assert invoke("eval", "--checkpoint", tmp_path / "probe").exit_code == 0
    result = invoke(
        "finetune",
        "image-classify",
        "--from",
        run,
        "--data",
        npz,
        "--train",
        "head",
        "--layer",
        9,
        "--steps",
        1,
        "--out",
        tmp_path / "deep",
        "--quiet",
    )
    assert (
        result.exit_code == 2 and "depths 0 (the embeddings) to 2" in result.output and not (tmp_path / "deep").exists()
    )
    result = invoke("probe", "image-classify", "--from", run, "--data", npz, "--out", tmp_path / "layers")
    assert result.exit_code == 0, result.output
    assert list(json.loads((tmp_path / "layers" / "probe.json").read_text())["results"][str(run)]["test"]) == [
        "0",
        "1",
        "2",
    ]


def test_bad_igpt_settings_are_one_line(tmp_path):
    npz = tiny_npz(tmp_path / "x.npz")
    result = invoke(
        "pretrain", "--objective", "igpt", "--data", npz, "--set", "igpt.palette=1", "--out", tmp_path / "r"
    )
    assert (
        result.exit_code == 2 and "igpt.palette must be in [2, 4096]" in result.output and not (tmp_path / "r").exists()
    )
