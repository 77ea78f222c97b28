"""Hugging Face interop: tfcli ViT + MAE decoder against transformers' ViTMAEForPreTraining (same noise,
same outputs) and ViTForImageClassification, both directions, plus `tfcli export`."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from typer.testing import CliRunner

from tfcli.cli import app
from tfcli.hf import vit as hf_vit
from tfcli.models.vit import MAEDecoder, ViT, ViTConfig, random_masking, sincos_2d
from tfcli.objectives import mae

from .test_mae import TINY, overrides, tiny_npz

TOL = 1e-4


def _jiggle_(module: torch.nn.Module) -> None:
    """Random norms and biases too, so that a swapped or missed tensor cannot go unnoticed."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "norm" in name else 0.0))


def _ours(cfg: ViTConfig):
    torch.manual_seed(0)
    enc, dec = ViT(cfg).eval(), MAEDecoder(cfg).eval()
    _jiggle_(enc), _jiggle_(dec)
    return enc, dec


def _compare_mae(enc, dec, hf, cfg):
    x = torch.randn(3, 3, cfg.image_size, cfg.image_size)
    noise = torch.rand(3, cfg.n_patches)
    with torch.no_grad():
        out = hf(pixel_values=x, noise=noise)
        ids_keep, ids_restore, mask = random_masking(noise, cfg.mask_ratio)
        latent = enc.forward_features(x, ids_keep)
        pred = dec(latent, ids_restore)
        loss, _ = mae.loss(enc, torch.nn.ModuleDict({"decoder": dec}), {"pixels": x, "noise": noise})
        hf_latent = hf.vit(pixel_values=x, noise=noise).last_hidden_state
    assert torch.equal(mask, out.mask) and torch.equal(ids_restore, out.ids_restore)
    assert (latent - hf_latent).abs().max() < TOL
    assert (pred - out.logits).abs().max() < TOL
    assert abs(float(loss) - float(out.loss)) < TOL


@pytest.mark.parametrize("norm_pix", [False, True])
def test_export_to_vitmae_gives_identical_outputs_under_the_same_noise(norm_pix):
    cfg = ViTConfig(**TINY, norm_pix_loss=norm_pix)
    enc, dec = _ours(cfg)
    hf = transformers.ViTMAEForPreTraining(hf_vit.config_to_hf(cfg)).eval()
    hf.load_state_dict(hf_vit.to_hf(enc, decoder=dec))  # strict: every tensor accounted for
    _compare_mae(enc, dec, hf, cfg)


@pytest.mark.parametrize("positions", ["sincos", "other"])
def test_import_from_a_vitmae_directory(tmp_path, positions):
    hf_cfg = transformers.ViTMAEConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=64, decoder_hidden_size=32,
                                       decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
                                       decoder_intermediate_size=64, layer_norm_eps=1e-12)
    torch.manual_seed(1)
    hf = transformers.ViTMAEForPreTraining(hf_cfg).eval()
    _jiggle_(hf)
    with torch.no_grad():
        if positions == "sincos":  # as in MAE checkpoints
            hf.vit.embeddings.position_embeddings.copy_(sincos_2d(4, 32))
            hf.decoder.decoder_pos_embed.copy_(sincos_2d(4, 32))
        else:  # anything else is kept as learned positions
            hf.vit.embeddings.position_embeddings.normal_()
    hf.save_pretrained(tmp_path / "mae")
    cfg, enc_sd, dec_sd, cls_sd, _ = hf_vit.read_hf_dir(tmp_path / "mae", with_heads=True)
    assert cfg.pos_embed == ("sincos" if positions == "sincos" else "learned")
    assert cfg.decoder_n_layer == 1 and not cls_sd
    enc, dec = ViT(cfg).eval(), MAEDecoder(cfg).eval()
    enc.load_state_dict(enc_sd)
    dec.load_state_dict(dec_sd)
    _compare_mae(enc, dec, hf, cfg)
    # transformers 4.x names are understood too
    legacy = {k.replace("vit.layers.", "vit.encoder.layer.").replace("attention.q_proj", "attention.attention.query")
              .replace("attention.k_proj", "attention.attention.key").replace("attention.v_proj", "attention.attention.value")
              .replace("attention.o_proj", "attention.output.dense").replace("mlp.fc1", "intermediate.dense")
              .replace("mlp.fc2", "output.dense"): v for k, v in hf.state_dict().items()}
    enc_legacy, _, _ = hf_vit.from_hf(legacy, cfg)
    assert all(torch.equal(enc_legacy[k], enc_sd[k]) for k in enc_sd)


def test_vit_for_image_classification_both_ways(tmp_path):
    hf_cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, num_labels=3, layer_norm_eps=1e-12)
    torch.manual_seed(2)
    hf = transformers.ViTForImageClassification(hf_cfg).eval()
    _jiggle_(hf)
    hf.save_pretrained(tmp_path / "cls")
    cfg, enc_sd, _, cls_sd, _ = hf_vit.read_hf_dir(tmp_path / "cls", with_heads=True)
    assert cfg.pos_embed == "learned"
    enc = ViT(cfg).eval()
    enc.load_state_dict(enc_sd)
    head = torch.nn.Linear(32, 3)
    head.load_state_dict(cls_sd)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ours = head(ViT.pool(enc.forward_features(x), "cls"))
        assert (ours - hf(pixel_values=x).logits).abs().max() < TOL
        back = transformers.ViTForImageClassification(hf_vit.config_to_hf(cfg, mae=False, labels=["a", "b", "c"]))
        back.load_state_dict(hf_vit.to_hf(enc, classifier=head))
        assert (ours - back.eval()(pixel_values=x).logits).abs().max() < TOL


def test_non_vit_directory_is_a_user_error(tmp_path):
    from tfcli.errors import UserError
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UserError, match="not a ViT"):
        hf_vit.read_hf_dir(tmp_path)
    with pytest.raises(UserError, match="no config.json"):
        hf_vit.read_hf_dir(tmp_path / "nothing")


def test_cli_export_of_an_mae_run_loads_in_transformers(tmp_path):
    npz = tiny_npz(tmp_path / "tiny.npz")
    run = tmp_path / "run"
    args = ["pretrain", "--objective", "mae", "--out", str(run), "--quiet"]
    for k, v in overrides(npz, **{"train.steps": 1}).items():
        args += ["--set", f"{k}={json.dumps(v) if isinstance(v, list) else v}"]
    assert CliRunner().invoke(app, args).exit_code == 0
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(run), "--hf", str(tmp_path / "hf")])
    assert result.exit_code == 0 and "ViTMAEForPreTraining" in result.output, result.output
    hf = transformers.ViTMAEForPreTraining.from_pretrained(tmp_path / "hf").eval()
    from tfcli.tasks.mae import load_mae
    loaded, dec = load_mae(run)
    _compare_mae(loaded.model, dec, hf, loaded.model.cfg)


def test_finetune_from_a_hf_directory_and_export_as_vit_for_image_classification(tmp_path):
    npz = tiny_npz(tmp_path / "tiny.npz")
    hf_cfg = transformers.ViTMAEConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=64, decoder_hidden_size=32,
                                       decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
                                       decoder_intermediate_size=64)
    transformers.ViTMAEForPreTraining(hf_cfg).save_pretrained(tmp_path / "mae")
    run = tmp_path / "ft"
    result = CliRunner().invoke(app, ["finetune", "image-classify", "--from", str(tmp_path / "mae"), "--data", str(npz),
                                      "--train", "all", "--pooling", "cls", "--steps", "2", "--batch-size", "8",
                                      "--out", str(run),
                                      "--set", "schedule.warmup_steps=1", "--quiet"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(run), "--hf", str(tmp_path / "hf")])
    assert result.exit_code == 0 and "ViTForImageClassification" in result.output, result.output
    mean_run = tmp_path / "ft-mean"
    assert CliRunner().invoke(app, ["finetune", "image-classify", "--from", str(tmp_path / "mae"), "--data", str(npz),
                                    "--pooling", "mean", "--steps", "1", "--batch-size", "8", "--out", str(mean_run),
                                    "--set", "schedule.warmup_steps=1", "--quiet"]).exit_code == 0
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(mean_run), "--hf", str(tmp_path / "hf-mean")])
    assert result.exit_code == 2 and "--pooling cls" in result.output
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.id2label == {0: "a", 1: "b"}
    from tfcli.inference import load_run
    loaded = load_run(run, which="best")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ours = ViT.pool(loaded.model.forward_features(x), "cls") @ loaded.heads["classifier.weight"].t() \
            + loaded.heads["classifier.bias"]
        assert (ours - hf(pixel_values=x).logits).abs().max() < TOL
