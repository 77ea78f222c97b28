"""Images as sequences of colours, as ImageGPT reads them (Chen et al. 2020): a palette of k colours found
by k-means over training pixels, every pixel replaced by its nearest colour's index, the image read in
raster order. Pure functions (and one Source), shared by the igpt objective, image classification
from an igpt run, and the pictures `tfcli generate --images` draws.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UserError
from .images import ImageSet
from .sampler import Draw, Source

PALETTE_FILE = "palette.json"  # an igpt run's colours and image side (and a classifier's trained from it)


def square(image: np.ndarray, side: int) -> np.ndarray:
    """uint8 (H, W, 3) -> uint8 (side, side, 3): the central square, resized (antialiased)."""
    h, w, _ = image.shape
    s = min(h, w)
    x = torch.from_numpy(np.ascontiguousarray(image[(h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]))
    x = x.permute(2, 0, 1).float()[None]  # (1, 3, s, s)
    if s != side:
        x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False, antialias=True)
    return x[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()


def squares(images: ImageSet, side: int) -> np.ndarray:
    """Every image of the set as uint8 (N, side, side, 3)."""
    return (
        np.stack([square(images.images[i], side) for i in range(len(images))])
        if len(images)
        else np.zeros((0, side, side, 3), dtype=np.uint8)
    )


def nearest(x: Tensor, colours: Tensor, chunk: int = 32768) -> tuple[Tensor, Tensor]:
    """(N, 3) pixels -> the index (N,) of each one's nearest colour and the distance to it, in chunks
    (a (N, k) distance matrix of a large sample would not fit)."""
    found = [torch.cdist(x[i : i + chunk], colours).min(1) for i in range(0, len(x), chunk)]
    if not found:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0)
    return torch.cat([f.indices for f in found]), torch.cat([f.values for f in found])


def fit_palette(pixels: np.ndarray, k: int, iters: int = 20, seed: int = 0) -> np.ndarray:
    """k-means over RGB pixels (N, 3) -> the k colours (k, 3) float32, sorted by brightness (so that
    nearby indices look alike). Seeded k-means++ start, then Lloyd's iterations; an empty cluster takes
    the pixel farthest from its colour."""
    x = torch.from_numpy(pixels.reshape(-1, 3).astype(np.float32))  # (N, 3)
    g = torch.Generator().manual_seed(seed)
    k = min(k, len(x))
    centres = [x[int(torch.randint(len(x), (1,), generator=g))]]
    closest = ((x - centres[0]) ** 2).sum(1)  # (N,) squared distance to the nearest centre so far
    for _ in range(1, k):  # k-means++: the next centre drawn in proportion to that distance
        centres.append(x[int(torch.multinomial(closest + 1e-12, 1, generator=g))])
        closest = torch.minimum(closest, ((x - centres[-1]) ** 2).sum(1))
    centres = torch.stack(centres)  # (k, 3)
    for _ in range(iters):
        index, distance = nearest(x, centres)
        sums = torch.zeros_like(centres).index_add_(0, index, x)
        counts = torch.bincount(index, minlength=k).float()
        empty = counts == 0
        centres = torch.where(empty[:, None], centres, sums / counts.clamp(min=1)[:, None])
        if empty.any():
            centres[empty] = x[distance.topk(int(empty.sum())).indices]
    return centres[centres.sum(1).argsort()].numpy()


def quantize(images: np.ndarray, palette: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W, 3) -> int64 (N, H * W): each pixel's nearest colour, in raster order."""
    index, _ = nearest(torch.from_numpy(images.reshape(-1, 3).astype(np.float32)), torch.from_numpy(palette))
    return index.view(len(images), -1).numpy()


def dequantize(tokens: np.ndarray, palette: np.ndarray, side: int) -> np.ndarray:
    """int (N, side * side) -> uint8 (N, side, side, 3): the colours of the indices."""
    return palette[np.asarray(tokens)].reshape(len(tokens), side, side, 3).round().clip(0, 255).astype(np.uint8)


class PaletteSource(Source):
    """Quantized images for a decoder: input_ids (B, 1 + T - 1) = start token then the first T - 1
    colours, targets (B, T) = the T colours; with labels, also `labels` and an all-ones attention
    mask (a classifier reads the whole sequence)."""

    def __init__(self, tokens: np.ndarray, start_id: int, labels=None, with_target: bool = True):
        self.tokens, self.start, self.labels, self.with_target = tokens, start_id, labels, with_target

    def epoch_size(self, epoch: int) -> int:
        return len(self.tokens)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        t = torch.from_numpy(self.tokens[draw.indices.astype(np.int64)].astype(np.int64))  # (B, T)
        start = torch.full((len(t), 1), self.start, dtype=torch.long)
        if self.with_target:
            out = {"input_ids": torch.cat([start, t[:, :-1]], 1), "targets": t}
        else:  # features for a classifier: the whole image after the start token
            seq = torch.cat([start, t], 1)
            out = {"input_ids": seq, "attention_mask": torch.ones_like(seq)}
        if self.labels is not None:
            out["labels"] = torch.from_numpy(self.labels[draw.indices.astype(np.int64)])
        return out


def start_id(palette: np.ndarray) -> int:
    """The start-of-image token comes after the colours."""
    return len(palette)


def read_palette(run_dir: Path) -> tuple[np.ndarray, int]:
    """(the colours (k, 3), the image side) an igpt run (or a classifier trained from one) reads with."""
    path = Path(run_dir) / PALETTE_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} has no {PALETTE_FILE}: it is not an igpt run (tfcli pretrain --objective igpt)")
    saved = json.loads(path.read_text())
    return np.array(saved["colours"], dtype=np.float32), int(saved["image_size"])


def palette_file(palette: np.ndarray, side: int) -> dict[str, str]:
    """What a run keeps so that the images can be read as it read them (Job.files)."""
    return {PALETTE_FILE: json.dumps({"image_size": side, "colours": palette.round(3).tolist()})}


def palette_tokens(images, side: int, palette: np.ndarray) -> np.ndarray:
    """An ImageSet -> its images as colour indices (N, side * side), int16."""
    return quantize(squares(images, side), palette).astype(np.int16)
