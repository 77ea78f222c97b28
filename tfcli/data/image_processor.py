"""A vision-language model's image preprocessing, as transformers' image processors do it (their PIL
backend: CLIP's, SigLIP's, Idefics3's), written from their configs: no code of a checkpoint's runs.

    shortest_edge  CLIP / LLaVA: the short side resized to `size` (the long side in proportion, rounded
                   down), then a `crop` x `crop` centre crop
    square         SigLIP: resized to `size` x `size`
    longest_edge   Idefics3 / SmolVLM: the long side resized to `size` (the short side in proportion,
                   rounded up to even), then, with `split`, both sides up to multiples of `tile` and
                   cut into tile x tile pieces in raster order, followed by the whole image at tile x
                   tile; without, the whole image at tile x tile alone

Every resize is PIL's on the 8-bit image (resample: PIL's filter number, 3 bicubic, 1 Lanczos), then
the pixels are scaled by `rescale` and normalised by `mean` and `std`, in float32.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import UserError
from ..models.vlm import ImageProcessing

MAX_SIDE = 4096  # Idefics3's bound on either side after its first resize


def frames(p: ImageProcessing, image) -> tuple[Tensor, int, int]:
    """A PIL image -> (frames (F, 3, S, S) float32, tile rows, tile columns) as `p` prepares it; rows =
    columns = 0 when the image is one frame."""
    pixels = np.asarray(image.convert("RGB"))  # (H, W, 3) uint8
    rows = cols = 0
    if p.resize == "shortest_edge":
        h, w = pixels.shape[:2]
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = p.size, int(p.size * long / short)
        pixels = _resize(pixels, (new_long, new_short) if w <= h else (new_short, new_long), p.resample)
        pieces = [_centre_crop(pixels, p.crop)]
    elif p.resize == "square":
        pieces = [_resize(pixels, (p.size, p.size), p.resample)]
    else:
        pixels = _resize(pixels, longest_edge(*pixels.shape[:2], p.size), p.resample)
        if p.split:
            pixels = _resize(pixels, tiled(*pixels.shape[:2], p.tile), p.resample)
            pieces, rows, cols = _tiles(pixels, p.tile, p.resample)
        else:
            pieces = [_resize(pixels, (p.tile, p.tile), p.resample)]
    mean, std = np.array(p.mean, dtype=np.float32), np.array(p.std, dtype=np.float32)
    out = [((piece.astype(np.float32) * np.float32(p.rescale)) - mean) / std for piece in pieces]  # (H, W, 3) each
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).contiguous(), rows, cols


def grid(p: ImageProcessing, height: int, width: int) -> tuple[int, int]:
    """(tile rows, tile columns) `p` cuts an image of that size into (0, 0: one frame), without resizing it."""
    if p.resize != "longest_edge" or not p.split:
        return 0, 0
    h, w = tiled(*longest_edge(height, width, p.size), p.tile)
    return (0, 0) if h <= p.tile and w <= p.tile else (h // p.tile, w // p.tile)


def _resize(pixels: np.ndarray, hw: tuple[int, int], resample: int) -> np.ndarray:
    from PIL import Image

    if pixels.shape[:2] == tuple(hw):  # PIL returns a copy unchanged
        return pixels
    return np.asarray(Image.fromarray(pixels).resize((hw[1], hw[0]), resample=resample))


def _centre_crop(pixels: np.ndarray, side: int) -> np.ndarray:
    h, w = pixels.shape[:2]
    if h < side or w < side:  # transformers pads a small image with zeros around it first
        padded = np.zeros((max(h, side), max(w, side), 3), dtype=pixels.dtype)
        top, left = math.ceil((padded.shape[0] - h) / 2), math.ceil((padded.shape[1] - w) / 2)
        padded[top : top + h, left : left + w] = pixels
        pixels, h, w = padded, *padded.shape[:2]
    top, left = (h - side) // 2, (w - side) // 2
    return pixels[top : top + side, left : left + side]


def longest_edge(h: int, w: int, longest: int) -> tuple[int, int]:
    """Idefics3's first resize: the long side to `longest`, the other in proportion, rounded up to even;
    then both held under MAX_SIDE."""
    ratio = w / h
    if w >= h:
        w, h = longest, int(longest / ratio)
        h += h % 2
    else:
        h, w = longest, int(longest * ratio)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    if w >= h and w > MAX_SIDE:
        w, h = MAX_SIDE, int(MAX_SIDE / ratio)
    elif h > w and h > MAX_SIDE:
        h, w = MAX_SIDE, int(MAX_SIDE * ratio)
    return max(h, 1), max(w, 1)


def tiled(h: int, w: int, tile: int) -> tuple[int, int]:
    """Both sides up to multiples of the tile, the long side first and the short in proportion."""
    ratio = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / ratio) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * ratio) / tile) * tile
    return h, w


def _tiles(pixels: np.ndarray, tile: int, resample: int) -> tuple[list[np.ndarray], int, int]:
    """tile x tile pieces in raster order, then the whole image at tile x tile; an image no larger than
    one tile is that one frame (rows = columns = 0)."""
    h, w = pixels.shape[:2]
    if h <= tile and w <= tile:
        return [pixels], 0, 0
    rows, cols = (h - tile) // tile + 1, (w - tile) // tile + 1
    pieces = [pixels[r * tile : (r + 1) * tile, c * tile : (c + 1) * tile] for r in range(rows) for c in range(cols)]
    return pieces + [_resize(pixels, (tile, tile), resample)], rows, cols


def open_image(path: Path, where: str):
    """The image at `path`, decoded (so that a truncated file fails here, not in training), or one line
    naming `where` it was asked for."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except FileNotFoundError:
        raise UserError(f"{where}: image {path} not found") from None
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"{where}: image {path} is not a readable image ({e.__class__.__name__})") from None
