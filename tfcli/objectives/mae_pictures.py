"""MAE reconstruction pictures: originals, masked inputs and reconstructions side by side in a PNG.

The reconstruction shows the decoder's prediction on masked patches with the visible patches
pasted back, as in the MAE paper's figures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..models.vit import patchify, random_masking, unpatchify

GREY = 0.5  # masked patches are drawn in mid grey


@torch.no_grad()
def reconstruct(encoder: nn.Module, decoder: nn.Module, pixels: Tensor, noise: Tensor, denormalize) -> list[Tensor]:
    """pixels (B, 3, S, S) normalised -> [original, masked, reconstruction], each (B, 3, S, S) in [0, 1]."""
    cfg = encoder.cfg
    ids_keep, ids_restore, mask = random_masking(noise, cfg.mask_ratio)
    pred = decoder(encoder.forward_features(pixels, ids_keep), ids_restore)  # (B, N, P*P*C)
    target = patchify(pixels, cfg.patch_size)  # (B, N, P*P*C)
    if cfg.norm_pix_loss:  # the decoder predicts normalised patches: undo with the true statistics
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        pred = pred * (var + 1e-6) ** 0.5 + mean
    m = mask[..., None]  # (B, N, 1): 1 on masked patches
    pasted = unpatchify(pred * m + target * (1 - m), cfg.patch_size, cfg.channels)
    original = denormalize(pixels)
    masked_patches = patchify(original, cfg.patch_size) * (1 - m) + GREY * m
    masked = unpatchify(masked_patches, cfg.patch_size, cfg.channels)
    return [original, masked, denormalize(pasted)]


def grid(columns: list[Tensor], scale: int = 1, gap: int = 2) -> np.ndarray:
    """Columns of images (B, 3, S, S) in [0, 1] -> uint8 (H, W, 3): one row per image, white gaps."""
    B, _, S, _ = columns[0].shape
    cell = S * scale
    out = np.full((B * (cell + gap) + gap, len(columns) * (cell + gap) + gap, 3), 255, dtype=np.uint8)
    for c, images in enumerate(columns):
        pics = (images.float().clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
        for r in range(B):
            pic = pics[r].repeat(scale, axis=0).repeat(scale, axis=1)  # nearest upscale for small images
            y, x = gap + r * (cell + gap), gap + c * (cell + gap)
            out[y : y + cell, x : x + cell] = pic
    return out


def save_png(array: np.ndarray, path: Path) -> Path:
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


def reconstruction_png(encoder, decoder, pixels: Tensor, noise: Tensor, denormalize, path: Path) -> Path:
    """Write the original | masked | reconstruction grid of `pixels` to `path`."""
    was = encoder.training, decoder.training
    encoder.eval(), decoder.eval()
    columns = reconstruct(encoder, decoder, pixels, noise, denormalize)
    encoder.train(was[0]), decoder.train(was[1])
    scale = max(1, 96 // pixels.size(-1))
    return save_png(grid(columns, scale), path)
