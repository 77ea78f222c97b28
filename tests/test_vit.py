"""ViT encoder and MAE decoder: patchify, masking, shapes, what reaches the encoder, paper sizes."""

from __future__ import annotations

import pytest
import torch

from tfcli import recipe as recipes
from tfcli.models import build_model
from tfcli.models.vit import MAEDecoder, ViT, ViTConfig, n_visible, patchify, random_masking, sincos_2d, unpatchify


def tiny_cfg(**kw) -> ViTConfig:
    base = dict(
        image_size=16,
        patch_size=4,
        n_layer=2,
        n_head=2,
        d_model=32,
        d_ff=64,
        decoder_d_model=16,
        decoder_n_layer=1,
        decoder_n_head=2,
        decoder_d_ff=32,
    )
    return ViTConfig(**{**base, **kw})


def test_patchify_unpatchify_round_trip_is_exact():
    x = torch.randn(3, 3, 16, 16)
    p = patchify(x, 4)
    assert p.shape == (3, 16, 48)
    assert torch.equal(unpatchify(p, 4, 3), x)
    # patch 1 is the second 4x4 tile of the first row, flattened (row, col, channel)
    assert torch.equal(p[0, 1], x[0, :, 0:4, 4:8].permute(1, 2, 0).reshape(-1))


def test_patch_embedding_is_a_linear_map_of_each_patch():
    model = ViT(tiny_cfg()).eval()
    x = torch.randn(2, 3, 16, 16)
    conv = model.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, D)
    w = model.patch_embed.weight.permute(0, 2, 3, 1).reshape(32, -1)  # (D, P*P*C) in patchify order
    assert torch.allclose(conv, patchify(x, 4) @ w.t() + model.patch_embed.bias, atol=1e-5)


@pytest.mark.parametrize("ratio", [0.75, 0.5, 0.9, 0.6])
def test_random_masking_keeps_round_n_times_one_minus_ratio(ratio):
    noise = torch.rand(5, 64)
    ids_keep, ids_restore, mask = random_masking(noise, ratio)
    keep = round(64 * (1 - ratio))
    assert ids_keep.shape == (5, keep)
    assert torch.equal(mask.sum(1), torch.full((5,), 64.0 - keep))
    # the kept patches are exactly the unmasked ones, and they are the lowest-noise ones
    for b in range(5):
        assert set(ids_keep[b].tolist()) == set(torch.nonzero(mask[b] == 0).flatten().tolist())
        assert set(ids_keep[b].tolist()) == set(noise[b].argsort()[:keep].tolist())
    shuffled = noise.argsort(1)
    assert torch.equal(torch.gather(shuffled, 1, ids_restore), torch.arange(64).expand(5, -1))


def test_masking_differs_per_sample():
    _, _, mask = random_masking(torch.rand(8, 64), 0.75)
    assert len({tuple(m.tolist()) for m in mask}) == 8


def test_encoder_sees_only_visible_patches_and_no_mask_token():
    cfg = tiny_cfg()
    enc, dec = ViT(cfg), MAEDecoder(cfg)
    seen = []
    enc.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x = torch.randn(2, 3, 16, 16)
    ids_keep, ids_restore, _ = random_masking(torch.rand(2, cfg.n_patches), 0.75)
    latent = enc.forward_features(x, ids_keep)
    assert latent.shape == (2, 1 + n_visible(16, 0.75), 32) == (2, 5, 32)
    tokens = seen[0]  # what entered the first encoder block: [CLS] + 4 visible patch embeddings
    expected = enc.patch_embed(x).flatten(2).transpose(1, 2) + enc.pos_embed[:, 1:]
    assert torch.allclose(tokens[:, 1:], torch.gather(expected, 1, ids_keep[..., None].expand(-1, -1, 32)))
    assert not any(p is dec.mask_token for p in enc.parameters())
    pred = dec(latent, ids_restore)
    assert pred.shape == (2, 16, 4 * 4 * 3)


def test_decoder_puts_tokens_back_in_raster_order():
    """Changing the encoded visible patch i changes the decoder input at i's position only."""
    cfg = tiny_cfg()
    dec = MAEDecoder(cfg).eval()
    seen = []
    dec.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    ids_keep, ids_restore, mask = random_masking(torch.rand(1, 16), 0.75)
    latent = torch.randn(1, 5, 32)
    dec(latent, ids_restore)
    bumped = latent.clone()
    bumped[0, 1] += 1.0  # the first visible patch
    dec(bumped, ids_restore)
    changed = (seen[0] - seen[1]).abs().sum(-1)[0, 1:] > 0  # (N,) over patches
    assert torch.nonzero(changed).flatten().tolist() == [int(ids_keep[0, 0])]
    # masked positions hold the one shared mask token (+ their position)
    masked = torch.nonzero(mask[0]).flatten()
    assert torch.allclose(
        seen[0][0, 1 + masked] - dec.pos_embed[0, 1 + masked], dec.mask_token[0].expand(len(masked), -1), atol=1e-6
    )


def test_sincos_positions_are_fixed_and_learned_ones_train():
    fixed = ViT(tiny_cfg(pos_embed="sincos"))
    assert "pos_embed" not in dict(fixed.named_parameters())
    assert torch.equal(fixed.pos_embed[0, 0], torch.zeros(32))
    assert sincos_2d(4, 32).shape == (1, 17, 32)
    learned = ViT(tiny_cfg(pos_embed="learned"))
    assert dict(learned.named_parameters())["pos_embed"].shape == (1, 17, 32)


def test_pooling_cls_and_mean():
    h = torch.randn(2, 5, 8)
    assert torch.equal(ViT.pool(h, "cls"), h[:, 0])
    assert torch.allclose(ViT.pool(h, "mean"), h[:, 1:].mean(1))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="model.image_size"):
        ViTConfig(image_size=30, patch_size=4)
    with pytest.raises(ValueError, match="model.decoder_d_model"):
        ViTConfig(decoder_d_model=130, decoder_n_head=4)


def test_vit_base_16_recipe_has_86m_parameters():
    rec = recipes.load("vit-base-16")
    assert (rec.model.image_size, rec.model.patch_size, rec.model.n_layer, rec.model.d_model) == (224, 16, 12, 768)
    with torch.device("meta"):
        model = build_model(rec.model)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 86e6) / 86e6 < 0.02, n


def test_mae_tiny_recipe_builds():
    rec = recipes.load("mae-vit-tiny")
    model = build_model(rec.model)
    assert isinstance(model, ViT) and model.cfg.n_patches == 64
