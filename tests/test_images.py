"""Image loaders (npz, folders, builtin, hub errors), bad images and transforms (the sampler: test_sampler)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tfcli.data import sources
from tfcli.data.image_batches import ImageTransform
from tfcli.data.images import ImageSet, as_uint8_rgb, load_images
from tfcli.errors import UserError

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def test_cifar_subset_npz(shared_data):
    splits = load_images(str(shared_data / "images" / "cifar10_subset" / "cifar10_subset.npz"))
    assert splits.train.images.shape == (10000, 32, 32, 3) and splits.train.images.dtype == np.uint8
    assert splits.test.images.shape == (1000, 32, 32, 3)
    assert np.bincount(splits.test.labels).tolist() == [100] * 10
    assert splits.train.class_names[0] == "airplane" and len(splits.train.class_names) == 10


def test_npz_layouts_are_converted(tmp_path):
    gray = (np.arange(2 * 8 * 8) % 256).astype(np.uint8).reshape(2, 8, 8)
    np.savez(tmp_path / "g.npz", x_train=gray)
    s = load_images(str(tmp_path / "g.npz"), val_fraction=0.0)
    assert s.train.images.shape == (2, 8, 8, 3) and s.train.labels is None
    assert np.array_equal(s.train.images[..., 1], gray)
    floats = np.random.default_rng(0).uniform(0, 1, (3, 3, 8, 8)).astype(np.float32)  # (N, C, H, W) in [0, 1]
    out = as_uint8_rgb(floats, "x")
    assert out.shape == (3, 8, 8, 3) and np.abs(out[0, 2, 5] / 255 - floats[0, :, 2, 5]).max() < 1 / 255
    with pytest.raises(UserError, match="channels"):
        as_uint8_rgb(np.zeros((2, 8, 8, 5)), "x")


def _write(path, mode, size=(12, 10), fmt=None):
    rng = np.random.default_rng(len(str(path)))
    if mode == "I;16":
        Image.fromarray(rng.integers(0, 65535, size[::-1], dtype=np.uint16)).save(path)
        return
    img = Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).convert(mode)
    img.save(path, format=fmt)


def test_class_folders_with_bad_images(tmp_path):
    root = tmp_path / "imgs"
    (root / "cat").mkdir(parents=True)
    (root / "dog").mkdir()
    _write(root / "cat" / "a.png", "RGB")
    _write(root / "cat" / "b.jpg", "L", fmt="JPEG")  # grayscale JPEG
    _write(root / "cat" / "c.png", "RGBA")
    _write(root / "dog" / "d.png", "P")  # palette
    _write(root / "dog" / "e.png", "I;16")  # 16-bit grayscale
    _write(root / "dog" / "f.png", "CMYK", fmt="TIFF")  # CMYK in a file named .png
    (root / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (root / "dog" / "notes.txt").write_text("ignored: not an image extension")
    s = load_images(str(root), val_fraction=0.0)
    assert s.skipped == 1
    assert len(s.train) == 6 and s.train.class_names == ["cat", "dog"]
    assert s.train.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert all(im.shape == (10, 12, 3) and im.dtype == np.uint8 for im in s.train.images)
    gray = s.train.images[1]
    assert np.array_equal(gray[..., 0], gray[..., 2])


def test_flat_folder_and_train_test_folders(tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(10):
        _write(flat / f"{i}.png", "RGB", size=(8 + i, 8))  # different sizes
    s = load_images(str(flat), val_fraction=0.2, seed=1)
    assert s.train.labels is None and len(s.train) == 8 and len(s.test) == 2
    from tfcli.data.images import LazyImages

    assert isinstance(s.train.images, LazyImages)  # decoded when a batch asks, sizes known from the headers
    assert [im.shape[:2] for im in s.train.images] == [tuple(hw) for hw in s.train.images.sizes]
    split = tmp_path / "split"
    for part in ("train", "test"):
        for c in ("a", "b"):
            (split / part / c).mkdir(parents=True)
            _write(split / part / c / "x.png", "RGB")
    s = load_images(str(split))
    assert len(s.train) == 2 and len(s.test) == 2 and s.test.labels.tolist() == [0, 1]


def test_missing_and_unsupported_sources(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_images(str(tmp_path / "nope"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(UserError, match="unsupported"):
        load_images(str(tmp_path / "x.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no readable images"):
        load_images(str(tmp_path / "empty"))


def test_hub_unreachable_is_one_line(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(UserError) as e:
        load_images("hf:cifar10")
    assert "unreachable" in str(e.value) and "\n" not in str(e.value)


def test_builtin_photos_work_offline():
    s = load_images("builtin")
    assert s.train.images.shape[1:] == (64, 64, 3) and len(s.train) > 500 and len(s.test) > 50
    assert "astronaut" in s.train.class_names and s.train.labels.max() == len(s.train.class_names) - 1
    assert s.train.images.std() > 20  # real photographs, not blank tiles


def test_eval_transform_is_plain_normalisation_at_native_size():
    img = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    t = ImageTransform(16, MEAN, STD)
    x = t(img)
    expected = (
        torch.from_numpy(img).permute(2, 0, 1).float() / 255 - torch.tensor(MEAN)[:, None, None]
    ) / torch.tensor(STD)[:, None, None]
    assert torch.allclose(x, expected, atol=1e-6)
    assert torch.allclose(t.denormalize(x), torch.from_numpy(img).permute(2, 0, 1).float() / 255, atol=1e-6)
    assert ImageTransform(8, MEAN, STD)(np.zeros((20, 30, 3), np.uint8)).shape == (3, 8, 8)


def test_random_resized_crop_statistics():
    t = ImageTransform(8, MEAN, STD, train=True, crop_scale=(0.2, 1.0), crop_ratio=(0.75, 4 / 3))
    rng = np.random.default_rng(0)
    boxes = [t.crop_box(40, 40, rng) for _ in range(500)]
    areas = np.array([h * w / 1600 for _, _, h, w in boxes])
    assert all(0 <= top and 0 <= left and top + h <= 40 and left + w <= 40 for top, left, h, w in boxes)
    assert 0.17 < areas.min() and areas.max() <= 1.0 and 0.5 < areas.mean() < 0.7  # uniform on [0.2, 1]


def test_horizontal_flip_happens_half_the_time():
    img = np.zeros((8, 8, 3), np.uint8)
    img[:, :4] = 255  # left half white
    t = ImageTransform(8, (0, 0, 0), (1, 1, 1), train=True, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0))
    rng = np.random.default_rng(0)
    flipped = [float(t(img, rng)[0, 0, 0]) == 0.0 for _ in range(200)]
    assert 70 < sum(flipped) < 130


def test_subset_is_a_seeded_sample_across_classes():
    data = ImageSet(np.zeros((100, 4, 4, 3), np.uint8), np.repeat(np.arange(10), 10))  # sorted by class
    sub = data.subset(30, seed=1)
    assert len(sub) == 30 and len(set(sub.labels.tolist())) > 5
    assert np.array_equal(sub.labels, data.subset(30, seed=1).labels) and data.subset(0) is data
