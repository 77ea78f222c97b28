"""The convolutional stem for ViT (Xiao et al. 2021): the same token grid as patchify for every shipped ViT
recipe, an MAE encoder that never sees a masked patch's pixels, pretraining, a linear probe and
`tfcli probe` of every layer through the CLI, and an export refused in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tfcli import recipe as recipes
from tfcli.models import build_model
from tfcli.models.vit import ViTConfig

from .conftest import invoke, mae_overrides, set_args, tiny_npz


@pytest.mark.parametrize("name", ["mae-vit-tiny", "vit-tiny-image-classify", "vit-base-16"])
def test_both_stems_give_the_same_sequence_for_every_shipped_vit_recipe(name):
    cfg = recipes.load(name).model
    size = min(cfg.image_size, 64) if name == "vit-base-16" else cfg.image_size
    cfg = dataclasses.replace(cfg, image_size=size, n_layer=1)  # the stem is what is compared
    pixels = torch.randn(2, cfg.channels, size, size)
    shapes = {}
    for stem in ("patch", "conv"):
        model = build_model(dataclasses.replace(cfg, stem=stem)).eval()
        with torch.no_grad():
            shapes[stem] = tuple(model(pixels).shape)
        assert f"{cfg.n_patches} tokens" in model.describe()
    assert shapes["patch"] == shapes["conv"] == (2, 1 + (size // cfg.patch_size) ** 2, cfg.d_model)


def test_a_conv_stem_needs_a_power_of_two_patch():
    with pytest.raises(ValueError, match="power of 2"):
        ViTConfig(image_size=24, patch_size=6, stem="conv")


def test_mae_with_a_conv_stem_never_sees_a_masked_patch():
    cfg = ViTConfig(image_size=16, patch_size=4, n_layer=1, n_head=2, d_model=32, d_ff=64, stem="conv")
    model = build_model(cfg).eval()
    pixels = torch.randn(2, 3, 16, 16)
    keep = torch.tensor([[0, 5, 10, 15], [1, 2, 3, 4]])  # visible patches of each image
    visible = torch.zeros(2, 16, dtype=torch.bool).scatter_(1, keep, True).view(2, 4, 4)
    mask = ~visible.repeat_interleave(4, 1).repeat_interleave(4, 2)  # (2, 16, 16) pixels of masked patches
    changed = torch.where(mask[:, None], torch.randn_like(pixels), pixels)  # other pixels where nothing is seen
    with torch.no_grad():
        torch.testing.assert_close(model(pixels, keep), model(changed, keep))
        assert not torch.allclose(model(pixels), model(changed))  # without masking they would leak


def test_conv_stem_pretrains_probes_and_refuses_export(tmp_path):
    npz = tiny_npz(tmp_path / "x.npz")
    result = invoke(
        "pretrain",
        "--objective",
        "mae",
        *set_args(mae_overrides(npz, **{"model.stem": "conv"})),
        "--out",
        tmp_path / "mae",
    )
    assert result.exit_code == 0, result.output
    assert (
        "convolutional stem (2 3x3 stride-2 convolutions + 1x1" in result.output and "16 tokens (4x4)" in result.output
    )
    result = invoke(
        "finetune",
        "image-classify",
        "--from",
        tmp_path / "mae",
        "--data",
        npz,
        "--train",
        "head",
        "--steps",
        2,
        "--out",
        tmp_path / "probe",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    result = invoke(
        "probe",
        "image-classify",
        "--from",
        tmp_path / "mae",
        "--data",
        npz,
        "--out",
        tmp_path / "layers",
        "--limit",
        48,
        "--eval-limit",
        16,
    )
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "layers" / "probe.json").read_text())["results"][str(tmp_path / "mae")]
    assert list(saved["test"]) == ["0", "1", "2"]  # the stem's tokens, then each block
    result = invoke("export", "--checkpoint", tmp_path / "mae", "--hf", tmp_path / "hf")
    assert result.exit_code == 2 and "convolutional stem" in result.output and result.output.count("\n") == 1
