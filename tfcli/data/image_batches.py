"""From images to batches: random resized crop, horizontal flip, per-channel normalisation, as a
`sampler.Source`. Every random choice (crop, flip, MAE's masking noise) is drawn from the
example's own random stream, so a resumed run sees exactly the crops it would have seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UserError
from .images import ImageSet
from .sampler import Draw, Source


@dataclass(frozen=True)
class ImageConfig:
    """How images become pixels (the `mae:` and `image-classify:` recipe sections). Pixels are
    scaled to [0, 1], then (x - mean) / std per channel; the size is model.image_size."""

    augment: bool = field(default=True, metadata={"help": "random resized crop + horizontal flip on training images"})
    crop_scale: tuple[float, float] = field(
        default=(0.2, 1.0), metadata={"help": "area fraction of the random crop (MAE: 0.2-1)"}
    )
    crop_ratio: tuple[float, float] = field(
        default=(0.75, 1.3333333), metadata={"help": "aspect ratio range of the crop"}
    )
    hflip: bool = field(default=True, metadata={"help": "flip training images left to right at random"})
    mean: tuple[float, float, float] = field(
        default=(0.485, 0.456, 0.406), metadata={"help": "per-channel mean images are normalised by"}
    )
    std: tuple[float, float, float] = field(
        default=(0.229, 0.224, 0.225), metadata={"help": "per-channel standard deviation images are normalised by"}
    )

    def __post_init__(self):
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must be two numbers with 0 < low <= high <= 1, got {list(self.crop_scale)}")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise ValueError(f"crop_ratio must be two numbers with 0 < low <= high, got {list(self.crop_ratio)}")
        if not all(s > 0 for s in self.std):
            raise ValueError(f"std must be positive, got {list(self.std)}")


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
    def from_config(cls, cfg: ImageConfig, size: int, train: bool) -> ImageTransform:
        return cls(size, cfg.mean, cfg.std, train and cfg.augment, cfg.crop_scale, cfg.crop_ratio, cfg.hflip)

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

    def __call__(self, image: np.ndarray, rng: np.random.Generator | None = None) -> Tensor:
        h, w, _ = image.shape
        if self.train:
            top, left, ch, cw = self.crop_box(h, w, rng)
        else:  # the central square (after which the resize makes it S x S)
            side = min(h, w)
            top, left, ch, cw = (h - side) // 2, (w - side) // 2, side, side
        # one copy to fp32, which is also writable (the image may be a read-only memory map)
        x = torch.from_numpy(np.array(image[top : top + ch, left : left + cw], dtype=np.float32))
        x = x.permute(2, 0, 1).div_(255.0)  # (3, ch, cw) in [0, 1]
        if (ch, cw) != (self.size, self.size):
            x = F.interpolate(
                x[None], size=(self.size, self.size), mode="bilinear", align_corners=False, antialias=True
            )[0].clamp_(0.0, 1.0)
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


def check_images(images: ImageSet, patch_size: int, where: str) -> None:
    """Images smaller than one patch cannot be seen by a ViT: say so instead of training on them."""
    side = images.min_side()
    if len(images) and side < patch_size:
        raise UserError(
            f"{where}: images as small as {side}x{side} pixels, smaller than one "
            f"{patch_size}x{patch_size} patch of the model"
        )


class ImageSource(Source):
    """Transformed images (and their labels); with `noise_patches` also MAE's masking noise (B, N),
    each example's drawn from its own random stream."""

    def __init__(self, images: ImageSet, transform: ImageTransform, noise_patches: int = 0):
        self.images, self.transform, self.noise_patches = images, transform, noise_patches

    def epoch_size(self, epoch: int) -> int:
        return len(self.images)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        rngs = [draw.rng(i) for i in range(len(draw))]
        pixels = torch.stack([self.transform(self.images.images[int(i)], rng) for i, rng in zip(draw.indices, rngs)])
        batch = {"pixels": pixels}  # (B, 3, S, S)
        if self.images.labels is not None:
            batch["labels"] = torch.from_numpy(self.images.labels[draw.indices.astype(np.int64)])
        if self.noise_patches:
            batch["noise"] = torch.from_numpy(np.stack([rng.random(self.noise_patches) for rng in rngs])).float()
        return batch
