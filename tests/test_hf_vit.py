"""ViT runs to and from transformers through the CLI: an MAE run exported as ViTMAEForPreTraining
(same outputs under the same noise), finetuning from a ViT-MAE directory, export as
ViTForImageClassification ([CLS]) or Dinov2ForImageClassification (mean of the patches), same logits."""

from __future__ import annotations

import pytest
import torch

from tfcli.engine.backbone import from_run
from tfcli.models.vit import MAEDecoder, ViT

from .conftest import invoke, mae_overrides, set_args, tiny_npz
from .test_hf import TINY_MAE, TOL, compare_mae

transformers = pytest.importorskip("transformers")


def test_cli_export_of_an_mae_run_loads_in_transformers(tmp_path):
    npz = tiny_npz(tmp_path / "tiny.npz")
    run = tmp_path / "run"
    assert (
        invoke(
            "pretrain",
            "--objective",
            "mae",
            "--out",
            run,
            "--quiet",
            *set_args(mae_overrides(npz, **{"train.steps": 1})),
        ).exit_code
        == 0
    )
    result = invoke("export", "--checkpoint", run, "--hf", tmp_path / "hf")
    assert result.exit_code == 0 and "ViTMAEForPreTraining" in result.output, result.output
    hf = transformers.ViTMAEForPreTraining.from_pretrained(tmp_path / "hf").eval()
    loaded = from_run(run)
    dec = MAEDecoder(loaded.model.cfg).eval()
    dec.load_state_dict({k[len("decoder.") :]: v for k, v in loaded.heads.items()})
    compare_mae(loaded.model, dec, hf)
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    assert list(processor.image_mean) == pytest.approx(list(loaded.recipe.settings.mean))


def test_finetune_from_a_hf_directory_and_export_as_vit_for_image_classification(tmp_path):
    npz = tiny_npz(tmp_path / "tiny.npz")
    transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(**TINY_MAE)).save_pretrained(tmp_path / "mae")
    run = tmp_path / "ft"
    result = invoke(
        "finetune",
        "image-classify",
        "--from",
        tmp_path / "mae",
        "--data",
        npz,
        "--train",
        "all",
        "--pooling",
        "cls",
        "--steps",
        2,
        "--batch-size",
        8,
        "--out",
        run,
        "--set",
        "schedule.warmup_steps=1",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    result = invoke("export", "--checkpoint", run, "--hf", tmp_path / "hf")
    assert result.exit_code == 0 and "ViTForImageClassification" in result.output, result.output
    from .conftest import transformers_runs_the_export

    transformers_runs_the_export(tmp_path / "hf")
    mean_run = tmp_path / "ft-mean"
    assert (
        invoke(
            "finetune",
            "image-classify",
            "--from",
            tmp_path / "mae",
            "--data",
            npz,
            "--pooling",
            "mean",
            "--steps",
            1,
            "--batch-size",
            8,
            "--out",
            mean_run,
            "--set",
            "schedule.warmup_steps=1",
            "--quiet",
        ).exit_code
        == 0
    )
    result = invoke("export", "--checkpoint", mean_run, "--hf", tmp_path / "hf-mean")
    assert result.exit_code == 0 and "Dinov2ForImageClassification" in result.output, result.output
    dinov2 = transformers.Dinov2ForImageClassification.from_pretrained(tmp_path / "hf-mean").eval()
    mean_loaded = from_run(mean_run, which="best")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():  # the mean-pooled classifier, read by transformers as Dinov2 with the same logits
        ours = (
            ViT.pool(mean_loaded.model.forward_features(x), "mean") @ mean_loaded.heads["classifier.weight"].t()
            + mean_loaded.heads["classifier.bias"]
        )
        assert (ours - dinov2(pixel_values=x).logits).abs().max() < TOL
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.id2label == {0: "a", 1: "b"}
    loaded = from_run(run, which="best")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ours = (
            ViT.pool(loaded.model.forward_features(x), "cls") @ loaded.heads["classifier.weight"].t()
            + loaded.heads["classifier.bias"]
        )
        assert (ours - hf(pixel_values=x).logits).abs().max() < TOL
