"""ImageGPT (Chen et al. 2020, "Generative pretraining from pixels"): images at a small size, every pixel
replaced by the nearest of a k-means palette's colours (512 in the paper), read in raster order after a
start token, and a decoder (GPT or llama family) trained to predict the next colour.

    tfcli pretrain --objective igpt --data cifar10_subset.npz            # recipe igpt-gpt-mini (16x16)
    tfcli generate --checkpoint runs/<igpt run> --images 16               # half-images completed, samples
    tfcli finetune image-classify --from runs/<igpt run> --train head --layer 2   # a probe of any layer

The palette is fitted once on a seeded sample of the training pixels and kept in the run
(palette.json); image classification and generation from the run read it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from torch import nn

from ..data.images import load_images
from ..data.palette import (
    PALETTE_FILE,
    PaletteSource,
    dequantize,
    fit_palette,
    palette_file,
    palette_tokens,
    read_palette,
    squares,
    start_id,
)
from ..display import phase
from ..errors import UserError
from ..models import kinds
from ..plugin import Job
from ..recipe import require
from .next_token import loss, with_perplexity
from .objective import Objective


@dataclass(frozen=True)
class IGPTConfig:
    """The `igpt:` recipe section."""

    image_size: int = field(
        default=16, metadata={"help": "images are cut to their central square and resized to this side"}
    )
    palette: int = field(default=512, metadata={"help": "colours of the k-means palette (the paper's 9-bit palette)"})
    kmeans_pixels: int = field(
        default=200_000, metadata={"help": "training pixels (a seeded sample) the palette is fitted on"}
    )
    kmeans_iters: int = field(default=20, metadata={"help": "k-means iterations that learn the colour palette"})

    def __post_init__(self):
        require(2 <= self.image_size <= 64, "igpt.image_size", "in [2, 64]", self.image_size)
        require(2 <= self.palette <= 4096, "igpt.palette", "in [2, 4096]", self.palette)
        require(self.kmeans_pixels >= self.palette, "igpt.kmeans_pixels", "at least igpt.palette", self.kmeans_pixels)
        require(self.kmeans_iters >= 1, "igpt.kmeans_iters", ">= 1", self.kmeans_iters)

    @property
    def length(self) -> int:
        return self.image_size**2


class ImageGPT(Objective):
    key = "igpt"
    model_kinds = (kinds.DECODER,)
    recipe_pattern = "igpt-{family}-mini"
    Config = IGPTConfig
    describe = "ImageGPT next-colour"
    reads_text = False  # its vocabulary is the palette: no tokenizer

    def model_shape(self, recipe):
        """A fresh decoder's vocabulary is the palette and the start token; its context the start token
        and one image (generation feeds back all but the last colour)."""
        cfg = recipe.settings
        return replace(recipe.model, vocab_size=cfg.palette + 1, max_seq_len=cfg.length + 1)

    def palette(self, recipe, images) -> np.ndarray:
        """The run's palette: read back on resume, else fitted on a seeded sample of training pixels."""
        if self.run_dir is not None and (Path(self.run_dir) / PALETTE_FILE).is_file():
            return read_palette(self.run_dir)[0]
        cfg = recipe.settings
        rng = np.random.default_rng(recipe.train.seed)
        sample = images.take(rng.permutation(len(images))[: max(1, cfg.kmeans_pixels // cfg.length + 1)])
        pixels = squares(sample, cfg.image_size).reshape(-1, 3)
        pixels = pixels[rng.permutation(len(pixels))[: cfg.kmeans_pixels]]
        with phase(f"k-means palette of {cfg.palette} colours on {len(pixels):,} pixels"):
            return fit_palette(pixels, cfg.palette, cfg.kmeans_iters, recipe.train.seed)

    def setup(self, recipe, backbone) -> Job:
        cfg, model = recipe.settings, backbone.model
        if model.cfg.vocab_size < cfg.palette + 1 or model.cfg.max_seq_len < cfg.length + 1:
            raise UserError(
                f"igpt needs a decoder with {cfg.palette + 1} tokens and a context of {cfg.length} "
                f"+ 1 ({cfg.image_size}x{cfg.image_size} and a start); this one has {model.cfg.vocab_size} and "
                f"{model.cfg.max_seq_len}"
            )
        with phase(f"reading images from {recipe.data.source}"):
            splits = load_images(recipe.data.source, recipe.data.val_fraction, recipe.train.seed)
        palette = self.palette(recipe, splits.train)
        with phase("quantizing the images"):
            train = palette_tokens(splits.train, cfg.image_size, palette)
            test = palette_tokens(splits.test, cfg.image_size, palette) if splits.test is not None else None
        start = start_id(palette)
        return Job(
            heads=nn.ModuleDict(),
            loss=loss,
            train=PaletteSource(train, start),
            val=PaletteSource(test, start) if test is not None and len(test) else None,
            flops_per_item=model.flops_per_token(cfg.length),
            count_items=lambda b: b["input_ids"].numel(),
            held_out_metrics=with_perplexity,
            files=palette_file(palette, cfg.image_size),
        )

    def hints(self, run_dir) -> list[str]:
        return [
            f"complete images:   tfcli generate --checkpoint {run_dir} --images 16",
            f"probe a layer:     tfcli finetune image-classify --from {run_dir} --train head --layer 1",
            f"probe every layer: tfcli probe image-classify --from {run_dir}",
        ]


def held_out_tokens(recipe, palette: np.ndarray, side: int, n: int, seed: int) -> np.ndarray | None:
    """n held-out images of the run's data as colour indices (a seeded sample)."""
    splits = load_images(recipe.data.source, recipe.data.val_fraction, recipe.train.seed)
    images = splits.test if splits.test is not None and len(splits.test) else splits.train
    return palette_tokens(images.subset(n, seed), side, palette)


def sample_grid(backbone, n: int, out: Path, temperature: float, top_k: int, seed: int) -> Path:
    """ImageGPT's figure: for n held-out images, the top half given, the bottom half completed by the
    model, and the original; under them n unconditional samples. Written as a PNG."""
    from PIL import Image

    from ..generate import generate_batch

    run, recipe = backbone.run_dir, backbone.recipe
    palette, side = read_palette(run)
    start, half = start_id(palette), (side // 2) * side
    tokens = held_out_tokens(recipe, palette, side, n, seed)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=1.0, seed=seed, pad_id=start)
    with phase(f"completing {len(tokens)} half-images and drawing {n} samples"):
        completed = generate_batch(
            backbone.model, [[start] + t[:half].tolist() for t in tokens], max_new_tokens=side * side - half, **sampling
        )
        free = generate_batch(backbone.model, [[start]] * n, max_new_tokens=side * side, **sampling)
    given = [np.concatenate([t[:half], np.full(side * side - half, -1)]) for t in tokens]
    rows = [given, [np.concatenate([t[:half], c]) for t, c in zip(tokens, completed)], list(tokens), free]
    pictures = [[picture(r, palette, side) for r in row] for row in rows]
    grid = Image.new("RGB", (n * (side + 2), len(rows) * (side + 2)), (255, 255, 255))
    for y, row in enumerate(pictures):
        for x, image in enumerate(row):
            grid.paste(Image.fromarray(image), (x * (side + 2) + 1, y * (side + 2) + 1))
    scale = max(1, 256 // side)
    grid = grid.resize((grid.width * scale, grid.height * scale), Image.NEAREST)
    out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out)
    return out


def picture(tokens, palette: np.ndarray, side: int) -> np.ndarray:
    """Colour indices (side * side,) -> uint8 (side, side, 3); -1 (not given) as mid grey."""
    tokens = np.asarray(tokens)
    with_grey = np.vstack([palette, [[128.0, 128.0, 128.0]]])
    return dequantize(np.where(tokens < 0, len(palette), tokens)[None], with_grey, side)[0]
