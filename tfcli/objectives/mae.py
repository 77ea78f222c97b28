"""MAE inpainting: shuffle each image's patches, encode the visible 25%, decode every patch from
the encoded ones plus mask tokens, mean squared error on the masked patches only (He et al. 2021).

The decoder is this objective's head: it is trained here and dropped after pretraining.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn

from ..data.image_batches import ImageConfig, ImageSource, ImageTransform, check_images
from ..data.images import ImageSet, load_images
from ..data.sampler import HELD_OUT, Draw, sequential_batches
from ..display import console, phase
from ..engine.evaluate import held_out_metrics, metrics_table
from ..engine.trainer import ObjectiveModule
from ..errors import UserError
from ..models import kinds
from ..models.vit import MAEDecoder, n_visible, patchify, random_masking
from ..plugin import EvalOptions, Job
from .mae_pictures import reconstruction_png
from .objective import Objective

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
    """Masked-patch reconstruction loss; `noise` (B, N) in the batch decides the masking."""
    cfg = model.cfg
    pixels = batch["pixels"]  # (B, C, S, S)
    ids_keep, ids_restore, mask = random_masking(batch["noise"], cfg.mask_ratio)
    latent = model.forward_features(pixels, ids_keep)  # (B, 1 + K, D): only visible patches
    pred = heads["decoder"](latent, ids_restore)  # (B, N, P*P*C)
    value = masked_mse(pred.float(), patchify(pixels, cfg.patch_size).float(), mask, cfg.norm_pix_loss)
    return value, {"loss": value.detach()}


def flops_per_image(model: nn.Module, decoder: nn.Module) -> float:
    """The encoder's FLOPs on its 1 + K visible tokens and the decoder's on all 1 + N (the models' counts)."""
    k, n = n_visible(model.cfg.n_patches, model.cfg.mask_ratio) + 1, model.cfg.n_patches + 1
    return model.flops_per_token(k) * k + decoder.flops_per_token(n) * n


def held_out(data, seed: int) -> ImageSet:
    """The images MAE is evaluated on: data.val_source, else the source's test split or held-out share."""
    if data.val_source:
        splits = load_images(data.val_source, 0.0, seed)
        return splits.test or splits.train
    splits = load_images(data.source, data.val_fraction, seed)
    return splits.test if splits.test is not None else splits.train


def picture_batch(source: ImageSource, seed: int, k: int = PICTURE_IMAGES) -> dict[str, Tensor]:
    """k held-out images spread evenly over the set (not just its first class), with fixed masking noise."""
    idx = np.unique(np.linspace(0, len(source.images) - 1, min(k, len(source.images))).round().astype(np.int64))
    keys = np.stack([np.full_like(idx, seed), np.full_like(idx, HELD_OUT), idx], axis=1)
    return source.batch(Draw(np.zeros_like(idx), idx, keys))


def save_picture(module: ObjectiveModule, batch: dict[str, Tensor], transform: ImageTransform, path: Path) -> Path:
    device = next(module.parameters()).device
    return reconstruction_png(
        module.model,
        module.heads["decoder"],
        batch["pixels"].to(device),
        batch["noise"].to(device),
        transform.denormalize,
        path,
    )


class MaskedAutoencoder(Objective):
    key = "mae"
    model_kinds = (kinds.VISION_ENCODER,)
    recipe_pattern = "mae-{family}-tiny"
    Config = ImageConfig
    describe = "ViT masked autoencoder"

    def sources(self, recipe, backbone) -> tuple[ImageSource, ImageSource]:
        d, seed, size, n = recipe.data, recipe.train.seed, backbone.cfg.image_size, backbone.cfg.n_patches
        with phase(f"reading images from {d.source}"):
            splits = load_images(d.source, d.val_fraction, seed)
        check_images(splits.train, backbone.cfg.patch_size, d.source)
        if splits.skipped and self.rt.is_main and not self.quiet:
            console.print(f"[yellow]note:[/] skipped {splits.skipped} unreadable image file(s) in {d.source}")
        val = held_out(d, seed) if d.val_source else (splits.test or splits.train)
        return (
            ImageSource(splits.train, ImageTransform.from_config(recipe.settings, size, train=True), n),
            ImageSource(val, ImageTransform.from_config(recipe.settings, size, train=False), n),
        )

    def setup(self, recipe, backbone) -> Job:
        train, val = self.sources(recipe, backbone)
        heads = nn.ModuleDict({"decoder": MAEDecoder(backbone.cfg)})
        pictures = picture_batch(val, recipe.train.seed)

        def evaluate(module: ObjectiveModule, run_dir: Path) -> dict[str, float]:
            if self.rt.is_main:  # the reconstruction grid of this evaluation, and the latest as recon.png
                folder = Path(run_dir) / "recon"
                path = save_picture(
                    module, pictures, val.transform, folder / f"eval-{len(list(folder.glob('eval-*.png'))) + 1:03d}.png"
                )
                shutil.copyfile(path, Path(run_dir) / "recon.png")
            return {}

        return Job(
            heads=heads,
            loss=loss,
            train=train,
            val=val,
            evaluate=evaluate,
            item_name="img",
            flops_per_item=flops_per_image(backbone.model, heads["decoder"]),
            count_items=lambda b: b["pixels"].size(0),
        )

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        """Held-out reconstruction loss and the picture grid (default: RUN/recon-eval.png; the
        training's own RUN/recon.png is left as it is)."""
        if not any(k.startswith("decoder.") for k in backbone.heads):
            raise UserError(
                f"{backbone.checkpoint} has no MAE decoder; `eval mae` needs an MAE pretraining run "
                f"(tfcli pretrain --objective mae)"
            )
        t = recipe.train
        recipe = replace(
            recipe,
            train=replace(t, seed=t.seed + options.seed),  # --seed: another masking
            data=replace(recipe.data, val_source=options.data or recipe.data.val_source),
        )
        job = self.setup(recipe, backbone)
        job.heads.load_state_dict(backbone.heads)
        module = ObjectiveModule(backbone.model, job.heads, loss).to(self.rt.device)
        val = job.val
        val.images = val.images.subset(options.limit)
        with phase("evaluating"):
            metrics = held_out_metrics(
                module, sequential_batches(val, t.batch_size, recipe.train.seed), self.rt.device, recipe.train.precision
            )
        out = options.report_path(Path(backbone.checkpoint).parent.parent / "recon-eval.png")
        save_picture(module, picture_batch(val, recipe.train.seed), val.transform, out)
        metrics = {
            "recon_loss": metrics["loss"],
            "images": float(len(val.images)),
            "mask_ratio": backbone.cfg.mask_ratio,
        }
        console.print(metrics_table(f"{backbone.checkpoint} (MAE reconstruction, held-out)", metrics))
        console.print(f"picture: {out}  (columns: original | masked input | reconstruction, visible patches pasted)")
        if backbone.cfg.norm_pix_loss:
            console.print(
                "note: this model predicts per-patch normalised pixels (norm_pix_loss); the picture draws each "
                "masked patch with its true mean and variance, so colours and contrast are not predicted"
            )
        return metrics

    def hints(self, run_dir) -> list[str]:
        return [
            f"reconstructions: {run_dir}/recon.png",
            f"evaluate it:  tfcli eval mae --checkpoint {run_dir} --out recon.png",
            f"probe it on the built-in photos:  tfcli finetune image-classify --from {run_dir} --train head",
        ]
