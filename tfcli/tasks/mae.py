"""`tfcli eval mae`: reconstruction loss of an MAE run on held-out images, and the picture grid
(original | masked input | reconstruction with the visible patches pasted back)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from . import EvalOptions



def load_mae(checkpoint: Path):
    """(loaded run, its MAE decoder with the trained weights)."""
    from ..inference import load_run
    from ..models.vit import MAEDecoder

    loaded = load_run(checkpoint)
    if loaded.recipe.objective != "mae":
        raise UserError(f"{loaded.checkpoint} is a {loaded.recipe.objective!r} run; `eval mae` needs an MAE "
                        f"pretraining run (tfcli pretrain --objective mae)")
    decoder = MAEDecoder(loaded.model.cfg)
    own = {k[len("decoder."):]: v for k, v in loaded.heads.items() if k.startswith("decoder.")}
    if not own:
        raise UserError(f"{loaded.checkpoint} has no MAE decoder weights")
    decoder.load_state_dict(own)
    return loaded, decoder.eval()


@torch.no_grad()
def reconstruction_loss(encoder: nn.Module, decoder: nn.Module, batches) -> tuple[float, int]:
    """Mean masked-patch MSE over held-out batches (weighted by images) and the number of images."""
    from ..objectives.mae import loss

    heads = nn.ModuleDict({"decoder": decoder})
    total, n = 0.0, 0
    for batch in batches:
        value, _ = loss(encoder, heads, batch)
        total += float(value) * batch["pixels"].size(0)
        n += batch["pixels"].size(0)
    return total / max(n, 1), n


def evaluate(checkpoint: Path, options: EvalOptions) -> dict[str, float]:
    """Print the held-out reconstruction loss and write the picture grid (default: RUN/recon.png)."""
    from ..checkpoint import run_dir_of
    from ..data.image_batches import ImageTransform
    from ..display import console
    from ..evaluate import metrics_table
    from ..objectives.mae import fixed_noise, held_out, picture_batch, val_batches
    from ..pictures import reconstruction_png

    loaded, decoder = load_mae(checkpoint)
    recipe, encoder = loaded.recipe, loaded.model
    recipe.train.seed += options.seed  # --seed picks another masking of the same images
    if options.data:
        recipe.data.val_source = options.data
    images = held_out(recipe)
    images = images.subset(options.limit)
    value, n = reconstruction_loss(encoder, decoder, val_batches(images, recipe, encoder.cfg.n_patches, 0))
    transform = ImageTransform.from_recipe(recipe, train=False)
    first = picture_batch(images, recipe)
    out = Path(options.out) if options.out else run_dir_of(loaded.checkpoint) / "recon.png"
    reconstruction_png(encoder, decoder, first, fixed_noise(0, first.size(0), encoder.cfg.n_patches,
                                                            recipe.train.seed), transform.denormalize, out)
    metrics = {"recon_loss": value, "images": float(n), "mask_ratio": encoder.cfg.mask_ratio}
    console.print(metrics_table(f"{loaded.checkpoint} (MAE reconstruction, held-out)", metrics))
    console.print(f"picture: {out}  (columns: original | masked input | reconstruction, visible patches pasted)")
    if encoder.cfg.norm_pix_loss:
        console.print("note: this model predicts per-patch normalised pixels (norm_pix_loss); the picture draws each "
                      "masked patch with its true mean and variance, so colours and contrast are not predicted")
    return metrics
