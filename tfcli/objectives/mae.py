"""MAE inpainting: shuffle each image's patches, encode the visible 25%, decode every patch from
the encoded ones plus mask tokens, mean squared error on the masked patches only (He et al. 2021).

The decoder is this objective's head: it is trained here and dropped after pretraining.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..data.image_batches import ImageSampler, ImageTransform, sequential_batches
from ..data.images import ImageSet, load_images
from ..display import console
from ..models.vit import MAEDecoder, n_visible, patchify, random_masking
from . import Prepared

FAMILY = "vit"
DEFAULT_RECIPE = "mae-vit-tiny"
SPECIAL_TOKENS: list[str] = []
TEXT = False  # no tokenizer, no documents: prepare() loads its own images
PICTURE_IMAGES = 8  # held-out images drawn in each reconstruction grid


def masked_mse(pred: Tensor, target: Tensor, mask: Tensor, norm_pix: bool = False) -> Tensor:
    """Mean over masked patches of the per-patch MSE. pred, target (B, N, P*P*C); mask (B, N) 1 = masked.
    norm_pix: the target is each patch normalised by its own mean and variance."""
    if norm_pix:
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mean) / (var + 1e-6) ** 0.5
    per_patch = ((pred - target) ** 2).mean(dim=-1)  # (B, N)
    return (per_patch * mask).sum() / mask.sum()


def loss(model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked-patch reconstruction loss; `noise` (B, N) in the batch fixes the masking (held-out, tests)."""
    cfg = model.cfg
    pixels = batch["pixels"]  # (B, C, S, S)
    noise = batch.get("noise")
    if noise is None:
        noise = torch.rand(pixels.size(0), cfg.n_patches, device=pixels.device)
    ids_keep, ids_restore, mask = random_masking(noise, cfg.mask_ratio)
    latent = model.forward_features(pixels, ids_keep)  # (B, 1 + K, D): only visible patches
    pred = heads["decoder"](latent, ids_restore)  # (B, N, P*P*C)
    value = masked_mse(pred.float(), patchify(pixels, cfg.patch_size).float(), mask, cfg.norm_pix_loss)
    return value, {"loss": value.detach()}


def flops_per_image(model: nn.Module, decoder: nn.Module) -> float:
    """6 x parameters x tokens for encoder (1 + K tokens) and decoder (1 + N), plus attention 12 L T^2 D."""
    cfg = model.cfg
    k, n = n_visible(cfg.n_patches, cfg.mask_ratio) + 1, cfg.n_patches + 1
    enc = sum(p.numel() for p in model.blocks.parameters())
    dec = sum(p.numel() for p in decoder.parameters() if p.requires_grad)
    embed = cfg.d_model * cfg.channels * cfg.patch_size ** 2 * (k - 1)
    attn = 12 * (cfg.n_layer * k * k * cfg.d_model + cfg.decoder_n_layer * n * n * cfg.decoder_d_model)
    return 6.0 * (enc * k + dec * n + embed) + attn


def held_out(recipe) -> ImageSet:
    """The images MAE is evaluated on: data.val_source, else the source's test split or held-out tail."""
    d = recipe.data
    if d.val_source:
        splits = load_images(d.val_source, 0.0, recipe.train.seed)
        return splits.test or splits.train
    splits = load_images(d.source, d.val_fraction, recipe.train.seed)
    return splits.test if splits.test is not None else splits.train


def fixed_noise(index: int, batch: int, n_patches: int, seed: int) -> Tensor:
    """The same masking for held-out batch `index` at every evaluation, so losses compare."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.rand(batch, n_patches, generator=g)


def val_batches(images: ImageSet, recipe, n_patches: int, max_batches: int, rank: int = 0, world_size: int = 1):
    transform = ImageTransform.from_recipe(recipe, train=False)
    for i, b in enumerate(sequential_batches(images, transform, recipe.train.batch_size, max_batches,
                                             rank, world_size)):
        b.pop("labels", None)
        b["noise"] = fixed_noise(i * world_size + rank, b["pixels"].size(0), n_patches, recipe.train.seed)
        yield b


def picture_batch(images: ImageSet, recipe, k: int = PICTURE_IMAGES) -> Tensor:
    """k held-out images spread evenly over the set (not just its first class), eval-transformed."""
    idx = np.unique(np.linspace(0, len(images) - 1, min(k, len(images))).round().astype(np.int64))
    transform = ImageTransform.from_recipe(recipe, train=False)
    return next(sequential_batches(images.take(idx), transform, len(idx), 1))["pixels"]  # (k, C, S, S)


def picture_saver(recipe, images: ImageSet, rank: int):
    """A run directory -> an evaluation that saves the reconstruction grid at each evaluation."""
    from ..pictures import reconstruction_png
    from ..train import Evaluation

    transform = ImageTransform.from_recipe(recipe, train=False)
    first = picture_batch(images, recipe)

    def make(run_dir: Path):
        def run(module: nn.Module) -> dict[str, float]:
            if rank == 0:
                folder = Path(run_dir) / "recon"
                path = folder / f"eval-{len(list(folder.glob('eval-*.png'))) + 1:03d}.png"
                device = next(module.parameters()).device
                noise = fixed_noise(0, first.size(0), module.model.cfg.n_patches, recipe.train.seed)
                reconstruction_png(module.model, module.heads["decoder"], first.to(device), noise.to(device),
                                   transform.denormalize, path)
                shutil.copyfile(path, Path(run_dir) / "recon.png")
            return {}
        return Evaluation(run=run, best_key="")
    return make


def prepare(recipe, tokenizer, docs, model, rank: int = 0, world_size: int = 1) -> Prepared:
    """Load and split the images (tokenizer and docs are unused), build the decoder head."""
    d, t = recipe.data, recipe.train
    splits = load_images(d.source, d.val_fraction, t.seed)
    if splits.skipped and rank == 0:
        console.print(f"[yellow]note:[/] skipped {splits.skipped} unreadable image file(s) in {d.source}")
    val_images = held_out(recipe) if d.val_source else (splits.test or splits.train)
    heads = nn.ModuleDict({"decoder": MAEDecoder(model.cfg)})
    sampler = ImageSampler(splits.train, ImageTransform.from_recipe(recipe, train=True), t.batch_size, t.seed,
                           rank, world_size)
    return Prepared(
        train=sampler,
        val=lambda: val_batches(val_images, recipe, model.cfg.n_patches, t.eval_batches, rank, world_size),
        loss=loss,
        items_per_batch=lambda b: b["pixels"].size(0),
        flops_per_item=flops_per_image(model, heads["decoder"]),
        heads=heads,
        item_name="img",
        evaluation=picture_saver(recipe, val_images, rank),
    )
