"""Datasets: bundled digits, fake distribution files of every format, augmentation."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch

from lipvit import data as lipvit_data
from lipvit.data import Augment, augment, load_dataset
from lipvit.errors import DataError


def test_digits_split(digits) -> None:
    assert digits.x_train.shape == (1437, 1, 8, 8)
    assert digits.x_test.shape == (360, 1, 8, 8)
    assert digits.x_train.dtype == torch.float32 and digits.y_train.dtype == torch.int64
    assert float(digits.x_train.min()) >= 0 and float(digits.x_train.max()) <= 1
    assert float(digits.x_train.max()) == 1.0  # pixels / 16 reach 1
    assert (digits.image_size, digits.in_chans, digits.num_classes) == (8, 1, 10)
    counts = torch.bincount(digits.y_test, minlength=10)
    assert int(counts.min()) >= 35 and int(counts.max()) <= 37  # stratified
    again = load_dataset("digits")
    assert torch.equal(again.x_test, digits.x_test)  # fixed seed
    assert digits.mean[0] == pytest.approx(float(digits.x_train.mean()), abs=1e-6)
    assert digits.std[0] == pytest.approx(float(digits.x_train.std()), abs=1e-6)
    assert not digits.augment.flip  # digits are not flip-invariant


def test_digits_split_is_cached_and_remade_when_unreadable(tmp_path: Path,
                                                            monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    fresh = lipvit_data._digits_split()

    def same(arrays) -> bool:
        return arrays[4] == fresh[4] == 10 and all(
            np.array_equal(a, b) and a.dtype == b.dtype
            for a, b in zip(arrays[:4], fresh[:4], strict=True))

    assert same(lipvit_data._digits())  # made, then kept
    (path,) = (tmp_path / "lipvit").glob("digits-sklearn-*.npz")
    monkeypatch.setattr(lipvit_data, "_digits_split", lambda: pytest.fail("remade"))
    assert same(lipvit_data._digits())  # read back
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    assert same(lipvit_data._digits())
    with np.load(path) as f:  # made again, whole
        assert sorted(f) == ["x_test", "x_train", "y_test", "y_train"]
    # A cache directory that cannot be made: the split is made, nothing kept.
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert same(lipvit_data._digits())


def test_unknown_dataset_and_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet")
    with pytest.raises(DataError, match="data_batch_1"):
        load_dataset("cifar10")
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("svhn", tmp_path / "nope")
    for name, expected in [
        ("cifar10", "data_batch_1"),
        ("cifar100", "train"),
        ("svhn", "train_32x32.mat"),
        ("mnist", "train-images-idx3-ubyte"),
    ]:
        with pytest.raises(DataError, match=expected) as err:
            load_dataset(name, tmp_path)
        assert "\n" not in str(err.value)
        assert "http" in str(err.value)  # says where the files come from


# ---------------------------------------------------------------- CIFAR


def _cifar_batch(path: Path, n: int, seed: int, label_key: str, classes: int) -> tuple:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = rng.integers(0, classes, size=n).tolist()
    with open(path, "wb") as f:
        pickle.dump(
            {b"batch_label": b"x", b"data": data, label_key.encode(): labels},
            f,
            protocol=2,
        )
    return data, labels


def test_cifar10_from_fake_pickles(tmp_path: Path) -> None:
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    parts = [
        _cifar_batch(root / f"data_batch_{i}", 4, i, "labels", 10) for i in range(1, 6)
    ]
    test_data, test_labels = _cifar_batch(root / "test_batch", 3, 9, "labels", 10)
    ds = load_dataset("cifar10", tmp_path)  # finds the sub-directory
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
    assert ds.num_classes == 10 and ds.augment.flip
    # Row layout: 1024 red, then green, then blue values, each row-major.
    i, c, r, col = 2, 1, 5, 7
    assert float(ds.x_test[i, c, r, col]) == pytest.approx(
        test_data[i, c * 1024 + r * 32 + col] / 255
    )
    assert ds.y_test.tolist() == test_labels
    assert ds.y_train.tolist() == sum((lab for _, lab in parts), [])
    assert len(ds.mean) == 3


def test_cifar100_from_fake_pickles(tmp_path: Path) -> None:
    _cifar_batch(tmp_path / "train", 5, 0, "fine_labels", 100)
    _, labels = _cifar_batch(tmp_path / "test", 2, 1, "fine_labels", 100)
    ds = load_dataset("cifar100", tmp_path)
    assert ds.num_classes == 100 and ds.x_train.shape == (5, 3, 32, 32)
    assert ds.y_test.tolist() == labels


def test_cifar_malformed_and_malicious_pickles(tmp_path: Path) -> None:
    (tmp_path / "train").write_bytes(b"this is not a pickle")
    _cifar_batch(tmp_path / "test", 2, 1, "fine_labels", 100)
    with pytest.raises(DataError, match="malformed"):
        load_dataset("cifar100", tmp_path)

    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    with open(tmp_path / "train", "wb") as f:
        pickle.dump({b"data": Evil()}, f)
    with pytest.raises(DataError, match="not allowed"):
        load_dataset("cifar100", tmp_path)
    assert not (tmp_path / "pwned").exists()  # nothing ran
    with open(tmp_path / "train", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"fine_labels": [0, 1]}, f)
    with pytest.raises(DataError, match="3072"):
        load_dataset("cifar100", tmp_path)


# ---------------------------------------------------------------- SVHN


def test_svhn_from_fake_mat_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    X = rng.integers(0, 256, size=(32, 32, 3, 6), dtype=np.uint8)
    y = np.array([[1], [10], [3], [10], [9], [2]], dtype=np.uint8)  # 10 means digit 0
    scipy.io.savemat(tmp_path / "train_32x32.mat", {"X": X, "y": y})
    scipy.io.savemat(tmp_path / "test_32x32.mat", {"X": X[..., :2], "y": y[:2]})
    ds = load_dataset("svhn", tmp_path)
    assert ds.x_train.shape == (6, 3, 32, 32)
    assert ds.y_train.tolist() == [1, 0, 3, 0, 9, 2]
    assert float(ds.x_train[4, 2, 10, 20]) == pytest.approx(X[10, 20, 2, 4] / 255)
    assert not ds.augment.flip
    (tmp_path / "test_32x32.mat").write_bytes(b"garbage")
    with pytest.raises(DataError, match="test_32x32.mat"):
        load_dataset("svhn", tmp_path)
    scipy.io.savemat(tmp_path / "test_32x32.mat", {"X": X[:5], "y": y})
    with pytest.raises(DataError, match="malformed"):
        load_dataset("svhn", tmp_path)


# ---------------------------------------------------------------- MNIST


def _idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    raw = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_from_fake_idx_files(tmp_path: Path, compress: bool) -> None:
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7, dtype=np.uint8)
    _idx(tmp_path / "train-images-idx3-ubyte", images, compress)
    _idx(tmp_path / "train-labels-idx1-ubyte", labels, compress)
    _idx(tmp_path / "t10k-images-idx3-ubyte", images[:3], compress)
    _idx(tmp_path / "t10k-labels-idx1-ubyte", labels[:3], compress)
    ds = load_dataset("mnist", tmp_path)
    assert ds.x_train.shape == (7, 1, 28, 28) and ds.x_test.shape == (3, 1, 28, 28)
    assert ds.y_train.tolist() == labels.tolist()
    assert float(ds.x_train[3, 0, 4, 9]) == pytest.approx(images[3, 4, 9] / 255)


def test_mnist_malformed(tmp_path: Path) -> None:
    images = np.zeros((4, 28, 28), np.uint8)
    _idx(tmp_path / "train-images-idx3-ubyte", images, False)
    _idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(3, np.uint8), False)  # 3 ≠ 4
    _idx(tmp_path / "t10k-images-idx3-ubyte", images, False)
    _idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(4, np.uint8), False)
    with pytest.raises(DataError, match="do not match"):
        load_dataset("mnist", tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03\x00")
    with pytest.raises(DataError, match="t10k-images"):
        load_dataset("mnist", tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte"):
        load_dataset("mnist", tmp_path)


# ---------------------------------------------------------------- augment


def test_augment_identity_and_flip() -> None:
    x = torch.rand(16, 3, 6, 6)
    assert torch.equal(augment(x, Augment()), x)
    g = torch.Generator().manual_seed(0)
    y = augment(x, Augment(flip=True), g)
    flipped = torch.tensor([torch.equal(y[i], x[i].flip(-1)) for i in range(16)])
    same = torch.tensor([torch.equal(y[i], x[i]) for i in range(16)])
    assert torch.all(flipped | same) and flipped.any() and same.any()


@pytest.mark.parametrize("mode", ["zeros", "reflect"])
def test_augment_translation_is_a_crop_of_the_padded_image(mode: str) -> None:
    p = 2
    x = torch.rand(32, 2, 8, 8)
    g = torch.Generator().manual_seed(1)
    y = augment(x, Augment(pad=p, pad_mode=mode), g)
    assert y.shape == x.shape
    padded = torch.nn.functional.pad(
        x, (p,) * 4, mode="constant" if mode == "zeros" else "reflect"
    )
    shifts = set()
    for i in range(32):
        hits = [
            (dy, dx)
            for dy in range(2 * p + 1)
            for dx in range(2 * p + 1)
            if torch.equal(y[i], padded[i, :, dy : dy + 8, dx : dx + 8])
        ]
        assert hits, f"image {i} is no crop of its padded version"
        shifts.add(hits[0])
    assert len(shifts) > 5  # shifts differ between images
    again = augment(x, Augment(pad=p, pad_mode=mode), torch.Generator().manual_seed(1))
    assert torch.equal(again, y)  # seeded
