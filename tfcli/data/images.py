"""Image data without torchvision: folders of PNG/JPEG, .npz arrays, Hugging Face datasets, and a
built-in set cut from the real photographs that ship inside scikit-image.

Every loader returns `ImageSplits` of uint8 RGB arrays (H, W, 3), labels when the source has
them, and the count of files it had to skip. Odd modes (grayscale, palette, RGBA, 16-bit) are
converted to RGB; unreadable files are skipped and counted, never a traceback.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError, listing
from .sources import load_hub_dataset, quiet_datasets

EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
MAX_SIDE = 512  # larger images are shrunk on load (keeps memory bounded; crops are small anyway)
BUILTIN_PHOTOS = [
    "astronaut.png",
    "coffee.png",
    "chelsea.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "ihc.png",
    "camera.png",
    "coins.png",
    "moon.png",
    "grass.png",
    "gravel.png",
    "brick.png",
    "page.png",
]
BUILTIN_TILE = 64


class LazyImages:
    """Images decoded when a batch asks for them (an image folder or a Hugging Face split): only the
    file list (or the dataset's memory-mapped Arrow table) is held, whatever the number of images.
    `sizes` are (height, width) read from the files' headers, for checks that need no pixels."""

    def __init__(self, read, count: int, sizes: np.ndarray, ids: np.ndarray | None = None):
        self.read, self.count, self.sizes = read, count, sizes  # read(i) -> uint8 (H, W, 3)
        self.ids = np.arange(count) if ids is None else ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.read(int(self.ids[i]))

    def take(self, idx: np.ndarray) -> LazyImages:
        return LazyImages(self.read, self.count, self.sizes[idx], self.ids[idx])


@dataclass
class ImageSet:
    """Images as uint8 (H, W, 3) arrays (one stacked array when all share a size, or LazyImages
    decoded per batch) and labels."""

    images: list | np.ndarray | LazyImages
    labels: np.ndarray | None = None  # int64 (N,)
    class_names: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.images)

    def take(self, idx) -> ImageSet:
        idx = np.asarray(idx, dtype=np.int64)
        if isinstance(self.images, (np.ndarray, LazyImages)):
            images = self.images[idx] if isinstance(self.images, np.ndarray) else self.images.take(idx)
        else:
            images = [self.images[i] for i in idx]
        labels = self.labels[idx] if self.labels is not None else None
        return ImageSet(images, labels, self.class_names)

    def min_side(self) -> int:
        """The smallest height or width among (the first thousand of) the images."""
        if isinstance(self.images, LazyImages):
            return int(self.images.sizes.min()) if len(self.images) else 0
        if isinstance(self.images, np.ndarray):
            return min(self.images.shape[1:3]) if len(self.images) else 0
        return min((min(im.shape[:2]) for im in self.images[:1000]), default=0)

    def subset(self, n: int, seed: int = 0) -> ImageSet:
        """A seeded random n of the images, in their order (files are often sorted by class, so
        the first n would not do); n <= 0 or >= len: all of them."""
        if n <= 0 or n >= len(self):
            return self
        return self.take(np.sort(np.random.default_rng(seed).permutation(len(self))[:n]))


@dataclass
class ImageSplits:
    train: ImageSet
    test: ImageSet | None = None
    skipped: int = 0  # unreadable files left out


def load_images(source: str, val_fraction: float = 0.1, seed: int = 0) -> ImageSplits:
    """'builtin', a .npz file, an image folder, or 'hf:name[:config]'. Without a test split of its
    own, a shuffled `val_fraction` of the images is held out (the same one for a given seed)."""
    source = (source or "builtin").strip()
    if source == "builtin":
        splits = builtin_images()
    elif source.startswith("hf:"):
        splits = _from_hub(source[3:])
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise UserError(f"image data not found: {source}")
        if path.is_file() and path.suffix == ".npz":
            splits = _from_npz(path)
        elif path.is_dir():
            splits = _from_folder(path)
        else:
            raise UserError(
                f"unsupported image data {source} (use a folder of images, a .npz file, 'builtin' or hf:name)"
            )
    if len(splits.train) == 0:
        raise UserError(f"no readable images in {source}")
    if splits.test is None and val_fraction > 0:
        splits = hold_out(splits, val_fraction, seed)
    return splits


def hold_out(splits: ImageSplits, fraction: float, seed: int) -> ImageSplits:
    """Split off a shuffled `fraction` of the training images as the test split."""
    n = len(splits.train)
    order = np.random.default_rng(seed).permutation(n)
    n_test = max(1, int(n * fraction)) if n > 1 else 0
    return ImageSplits(
        splits.train.take(np.sort(order[n_test:])), splits.train.take(np.sort(order[:n_test])), splits.skipped
    )


# --- pixels ---------------------------------------------------------------------------------


def to_rgb(image) -> np.ndarray:
    """A Pillow image of any mode -> uint8 (H, W, 3); transparency composited on white."""
    from PIL import Image

    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    elif image.mode in ("I;16", "I;16B", "I;16L", "I"):
        a = np.asarray(image, dtype=np.float64)
        span = max(a.max() - a.min(), 1e-9)
        image = Image.fromarray(((a - a.min()) / span * 255).astype(np.uint8))
    elif image.mode == "F":
        image = Image.fromarray(
            np.clip(np.asarray(image) * (255 if np.asarray(image).max() <= 1 else 1), 0, 255).astype(np.uint8)
        )
    if max(image.size) > MAX_SIDE:
        image = image.copy()
        image.thumbnail((MAX_SIDE, MAX_SIDE))
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def read_image(path: Path) -> np.ndarray | None:
    """uint8 (H, W, 3), or None if the file is not a readable image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            return to_rgb(im)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None


def as_uint8_rgb(x: np.ndarray, where: str) -> np.ndarray:
    """Arrays of images in common layouts -> uint8 (N, H, W, 3): grayscale (N, H, W) or
    (N, H, W, 1), channels first (N, C, H, W), RGBA, floats in [0, 1] or [0, 255]."""
    x = np.asarray(x)
    if x.dtype.kind not in "uif":
        raise UserError(f"{where}: images must be numbers (uint8 or float), not {x.dtype}")
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4:
        raise UserError(f"{where}: expected images as (N, H, W[, C]), got shape {x.shape}")
    if x.shape[-1] not in (1, 3, 4) and x.shape[1] in (1, 3, 4):
        x = x.transpose(0, 2, 3, 1)  # (N, C, H, W) -> (N, H, W, C)
    if x.shape[-1] == 1:
        x = np.repeat(x, 3, axis=-1)
    elif x.shape[-1] == 4:
        x = x[..., :3]
    elif x.shape[-1] != 3:
        raise UserError(f"{where}: images have {x.shape[-1]} channels; expected 1, 3 or 4")
    if x.dtype != np.uint8:
        x = x.astype(np.float64)
        scale = 255.0 if x.max() <= 1.0 else 1.0
        x = np.clip(np.rint(x * scale), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(x)


# --- sources --------------------------------------------------------------------------------


def _from_npz(path: Path) -> ImageSplits:
    """x_train / y_train (and x_test / y_test, class_names) as in cifar10_subset.npz."""
    try:
        arrays = np.load(path, allow_pickle=False)
        keys = set(arrays.files)
    except (OSError, ValueError) as e:
        raise UserError(f"could not read {path}: {e}") from None
    if "x_train" not in keys:
        raise UserError(f"{path}: no x_train array (has: {listing(sorted(keys))})")
    names = [str(c) for c in arrays["class_names"]] if "class_names" in keys else []

    def split(name: str) -> ImageSet | None:
        if f"x_{name}" not in keys:
            return None
        labels = arrays[f"y_{name}"].astype(np.int64).reshape(-1) if f"y_{name}" in keys else None
        return ImageSet(as_uint8_rgb(arrays[f"x_{name}"], f"{path}:x_{name}"), labels, names)

    train = split("train")
    test = split("test") or split("val")
    if train.labels is not None and not names:
        train.class_names = [str(i) for i in range(int(train.labels.max()) + 1)]
        if test is not None:
            test.class_names = train.class_names
    return ImageSplits(train, test)


def _from_folder(root: Path) -> ImageSplits:
    """Class sub-folders (labels from their names) or a flat folder; train/ and test/ (or val/)
    sub-folders, when present, are the splits."""
    subdirs = {p.name.lower(): p for p in root.iterdir() if p.is_dir()}
    if "train" in subdirs:
        test_dir = subdirs.get("test") or subdirs.get("val")
        train, skipped = _read_folder(subdirs["train"], None)
        test, skipped_test = _read_folder(test_dir, train.class_names) if test_dir else (None, 0)
        return ImageSplits(train, test, skipped + skipped_test)
    train, skipped = _read_folder(root, None)
    return ImageSplits(train, None, skipped)


def _read_folder(root: Path, class_names: list[str] | None) -> tuple[ImageSet, int]:
    """The folder's images, checked now (headers and integrity, never pixels) and decoded per batch;
    unreadable files are left out and counted."""
    classes = class_names or sorted(p.name for p in root.iterdir() if p.is_dir() and has_images(p))
    if classes:
        files = [(f, i) for i, c in enumerate(classes) for f in image_files(root / c)]
    else:
        files = [(f, -1) for f in image_files(root)]
    kept, labels, sizes = [], [], []
    for f, label in files:
        size = image_size(f)
        if size is None:
            continue
        kept.append(f)
        labels.append(label)
        sizes.append(size)

    def read(i: int) -> np.ndarray:
        image = read_image(kept[i])
        if image is None:
            raise UserError(f"{kept[i]}: could not be decoded (it passed the check when the run started)")
        return image

    images = LazyImages(read, len(kept), np.array(sizes, dtype=np.int64).reshape(-1, 2))
    return ImageSet(images, np.array(labels, dtype=np.int64) if classes else None, list(classes)), len(files) - len(
        kept
    )


def image_size(path: Path) -> tuple[int, int] | None:
    """(height, width) after the shrink to MAX_SIDE, from the header; None for a file that is not a
    readable image (Pillow's integrity check, which decodes no pixels)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            w, h = im.size
            im.verify()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None
    scale = min(1.0, MAX_SIDE / max(w, h))
    return max(1, round(h * scale)), max(1, round(w * scale))


def image_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in EXTENSIONS)


def has_images(folder: Path) -> bool:
    return any(f.suffix.lower() in EXTENSIONS for f in folder.iterdir() if f.is_file())


def _from_hub(spec: str) -> ImageSplits:
    """hf:name[:config], e.g. hf:cifar10: its train and test splits, image and label columns."""
    name, _, config = spec.partition(":")
    ds = load_hub_dataset(name, config or None, instead="use a local image folder or .npz instead")
    if "train" not in ds:
        raise UserError(f"hf:{spec}: no train split (has: {listing(ds)})")
    test_name = next((s for s in ("test", "validation", "val") if s in ds), None)
    return ImageSplits(_hub_split(ds["train"], spec), _hub_split(ds[test_name], spec) if test_name else None)


def _hub_split(split, spec: str) -> ImageSet:
    """A dataset split's images decoded per batch from its Arrow table (memory-mapped, not loaded)."""
    datasets = quiet_datasets()

    feats = split.features
    image_col = next((k for k, f in feats.items() if isinstance(f, datasets.Image)), None)
    if image_col is None:
        raise UserError(f"hf:{spec}: no image column (columns: {listing(feats)})")
    label_col = next((k for k, f in feats.items() if isinstance(f, datasets.ClassLabel)), None)
    column = split.select_columns([image_col])
    first = to_rgb(column[0][image_col]) if len(column) else np.zeros((1, 1, 3), np.uint8)
    # the first image's size stands for all (hub image sets are uniform); read(i) decodes one
    sizes = np.tile(np.array(first.shape[:2], dtype=np.int64), (len(column), 1))
    images = LazyImages(lambda i: to_rgb(column[i][image_col]), len(column), sizes)
    labels = np.asarray(split[label_col], dtype=np.int64) if label_col else None
    return ImageSet(images, labels, list(feats[label_col].names) if label_col else [])


def builtin_images() -> ImageSplits:
    """Real photographs bundled with scikit-image, cut into 64x64 tiles, labelled by their photo.
    Works offline with nothing downloaded; every tenth tile is held out as the test split."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the built-in images are scikit-image's bundled photos: pip install scikit-image "
            "(or pass --data with your own images)"
        )
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    tiles, labels, names = [], [], []
    for name in BUILTIN_PHOTOS:
        photo = read_image(folder / name)
        if photo is None:
            continue
        label = len(names)
        names.append(Path(name).stem)
        H, W, _ = photo.shape
        for top in range(0, H - BUILTIN_TILE + 1, BUILTIN_TILE):
            for left in range(0, W - BUILTIN_TILE + 1, BUILTIN_TILE):
                tiles.append(photo[top : top + BUILTIN_TILE, left : left + BUILTIN_TILE])
                labels.append(label)
    if not tiles:
        raise UserError(f"no built-in photos found in {folder}")
    images = ImageSet(np.stack(tiles), np.array(labels, dtype=np.int64), names)
    test = np.arange(len(images)) % 10 == 9
    return ImageSplits(images.take(np.flatnonzero(~test)), images.take(np.flatnonzero(test)))
