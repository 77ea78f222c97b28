"""From images to batches: random resized crop, horizontal flip, per-channel normalisation, and a
resumable shuffled sampler (the image counterpart of packing.BlockSampler).

Every random choice of a batch is drawn from (seed, epoch, position), so a run resumed from a
checkpoint sees exactly the crops and flips it would have seen without the interruption.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .images import ImageSet


@dataclass
class ImageTransform:
    """uint8 (H, W, 3) -> normalised float (3, S, S). train=True: random resized crop + flip."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    train: bool = False
    crop_scale: tuple[float, float] = (0.2, 1.0)
    crop_ratio: tuple[float, float] = (0.75, 4 / 3)
    hflip: bool = True

    @classmethod
    def from_recipe(cls, recipe, train: bool) -> "ImageTransform":
        im = recipe.images
        return cls(recipe.model.image_size, im.mean, im.std, train and im.augment, im.crop_scale,
                   im.crop_ratio, im.hflip)

    def crop_box(self, h: int, w: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """Random resized crop as torchvision draws it: (top, left, height, width)."""
        area = h * w
        log_ratio = (math.log(self.crop_ratio[0]), math.log(self.crop_ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.crop_scale)
            ratio = math.exp(rng.uniform(*log_ratio))
            cw, ch = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
        side = min(h, w)  # fallback: the central square
        return (h - side) // 2, (w - side) // 2, side, side

    def __call__(self, image: np.ndarray, rng: Optional[np.random.Generator] = None) -> Tensor:
        h, w, _ = image.shape
        if self.train:
            top, left, ch, cw = self.crop_box(h, w, rng)
        else:  # the central square (after which the resize makes it S x S)
            side = min(h, w)
            top, left, ch, cw = (h - side) // 2, (w - side) // 2, side, side
        x = torch.from_numpy(np.ascontiguousarray(image[top: top + ch, left: left + cw]))
        x = x.permute(2, 0, 1).float().div_(255.0)  # (3, ch, cw) in [0, 1]
        if (ch, cw) != (self.size, self.size):
            x = F.interpolate(x[None], size=(self.size, self.size), mode="bilinear", align_corners=False,
                              antialias=True)[0].clamp_(0.0, 1.0)
        if self.train and self.hflip and rng.random() < 0.5:
            x = x.flip(-1)
        return self.normalize(x)

    def normalize(self, x: Tensor) -> Tensor:
        """[0, 1] pixels (..., 3, H, W) -> (x - mean) / std per channel."""
        mean = torch.tensor(self.mean, dtype=x.dtype)[:, None, None]
        std = torch.tensor(self.std, dtype=x.dtype)[:, None, None]
        return (x - mean) / std

    def denormalize(self, x: Tensor) -> Tensor:
        """Inverse of normalize, back to [0, 1] (clamped): for pictures."""
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device)[:, None, None]
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device)[:, None, None]
        return (x * std + mean).clamp(0.0, 1.0)


def make_batch(images: ImageSet, idx, transform: ImageTransform, rng: Optional[np.random.Generator]) -> dict:
    """{'pixels': (B, 3, S, S) float, 'labels': (B,) int64 when the images have labels}."""
    pixels = torch.stack([transform(images.images[i], rng) for i in idx])  # (B, 3, S, S)
    batch = {"pixels": pixels}
    if images.labels is not None:
        batch["labels"] = torch.from_numpy(images.labels[np.asarray(idx, dtype=np.int64)])
    return batch


@dataclass
class ImageSampler:
    """Shuffled batches of transformed images, epoch after epoch; resumable via state_dict.

    Hands out the global batch of batch_size * world_size images and keeps this rank's slice, so
    the data order does not depend on how many processes share the work.
    """

    images: ImageSet
    transform: ImageTransform
    batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1
    epoch: int = 0
    index: int = 0  # position within this epoch's order

    def __post_init__(self):
        self._order_epoch: Optional[int] = None

    def _order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._cached = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.images))
            self._order_epoch = self.epoch
        return self._cached

    def next_batch(self) -> dict[str, Tensor]:
        rng = np.random.default_rng([self.seed, self.epoch, self.index, 1])  # this batch's crops/flips
        picked = []
        while len(picked) < self.batch_size * self.world_size:
            order = self._order()
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            picked.append(int(order[self.index]))
            self.index += 1
        mine = picked[self.rank * self.batch_size: (self.rank + 1) * self.batch_size]
        return make_batch(self.images, mine, self.transform, rng)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def sequential_batches(images: ImageSet, transform: ImageTransform, batch_size: int, max_batches: int = 0,
                       rank: int = 0, world_size: int = 1) -> Iterator[dict[str, Tensor]]:
    """Held-out batches in order, the same every time (max_batches 0: all of them)."""
    per_step = batch_size * world_size
    n_batches = math.ceil(len(images) / per_step)
    if max_batches > 0:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        first = b * per_step + rank * batch_size
        idx = list(range(first, min(first + batch_size, len(images))))
        if not idx:
            return
        yield make_batch(images, idx, transform, None)
