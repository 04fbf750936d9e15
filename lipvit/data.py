"""Datasets resident on the device as one tensor, and batched augmentation.

Shapes: ``n`` images, ``C`` channels, ``S`` image side, ``B`` batch.

``load_dataset(name)`` returns a :class:`Dataset` whose images are float tensors
in ``[0, 1]`` of shape ``(n, C, S, S)`` and whose labels are int64, already on
the requested device (airbench style: no data loader, batches are indexed with
a device permutation). ``digits`` (scikit-learn's bundled 8×8 digits) needs no
files; ``cifar10``, ``cifar100``, ``svhn``, ``mnist`` and ``fashion-mnist`` are
read from their standard distribution files in ``data_dir`` without torchvision
(``fashion-mnist`` defaults to :data:`DEFAULT_DATA_DIRS`, where Debian's
``dataset-fashion-mnist`` package puts it). :attr:`Dataset.class_names` names
the classes for reports and figures.

:func:`augment` is the batched random crop (with padding) and horizontal flip,
as tensor ops on the device; which of them a dataset uses is its
:attr:`Dataset.augment` (digits are not flip-invariant, so no flips for them).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from lipvit.errors import DataError, LipvitError
from lipvit.files import atomic_path

DATASETS = ("digits", "mnist", "fashion-mnist", "svhn", "cifar10", "cifar100")

DEFAULT_DATA_DIRS: dict[str, Path] = {
    "fashion-mnist": Path("/usr/share/datasets/fashion-mnist"),
}
"""Where a dataset is read from when no ``data_dir`` is given (Debian's
``dataset-fashion-mnist`` package installs the four idx files there)."""


def default_dirs_text() -> str:
    """The default directories for a ``--data-dir`` help text:
    ``default for fashion-mnist: /usr/share/datasets/fashion-mnist``."""
    dirs = ", ".join(f"{name}: {path}" for name, path in DEFAULT_DATA_DIRS.items())
    return f"default for {dirs}"


CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "fashion-mnist": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    "cifar10": (
        "airplane",
        "automobile",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    ),
}
"""Names of the classes ``0, 1, ...`` of the datasets whose labels are not the
digits themselves (see :func:`class_names`)."""

PathLike = str | Path


@dataclass(frozen=True)
class Augment:
    """Batched training augmentation of a dataset (see :func:`augment`).

    Attributes:
        pad: random translation of up to ``pad`` pixels in each direction
            (crop of the padded image); 0 disables it.
        flip: random horizontal flips.
        pad_mode: ``"zeros"`` (digits on a black background) or ``"reflect"``.
    """

    pad: int = 0
    flip: bool = False
    pad_mode: Literal["zeros", "reflect"] = "zeros"


@dataclass(frozen=True, eq=False)
class Dataset:
    """A whole image classification dataset held as tensors on one device.

    Attributes:
        name: dataset name (one of :data:`DATASETS`).
        x_train: training images ``(n, C, S, S)``, float32 in ``[0, 1]``.
        y_train: training labels ``(n,)``, int64.
        x_test: test images ``(n_test, C, S, S)``.
        y_test: test labels ``(n_test,)``.
        num_classes: number of classes.
        mean: per-channel mean of ``x_train``.
        std: per-channel standard deviation of ``x_train``.
        augment: the training augmentation suited to this dataset.
    """

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: Augment

    @property
    def image_size(self) -> int:
        return int(self.x_train.shape[-1])

    @property
    def in_chans(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def device(self) -> torch.device:
        return self.x_train.device

    @property
    def class_names(self) -> tuple[str, ...]:
        """Name of every class (:func:`class_names`)."""
        return class_names(self.name, self.num_classes)

    def to(self, device: str | torch.device) -> Dataset:
        """The same dataset with every tensor on ``device``."""
        return Dataset(
            self.name,
            self.x_train.to(device),
            self.y_train.to(device),
            self.x_test.to(device),
            self.y_test.to(device),
            self.num_classes,
            self.mean,
            self.std,
            self.augment,
        )

    def describe(self) -> dict[str, Any]:
        """Plain-Python summary (stored in training summaries)."""
        return {
            "name": self.name,
            "n_train": int(self.x_train.shape[0]),
            "n_test": int(self.x_test.shape[0]),
            "num_classes": self.num_classes,
            "image_size": self.image_size,
            "in_chans": self.in_chans,
            "mean": list(self.mean),
            "std": list(self.std),
            "class_names": list(self.class_names),
        }


def class_names(dataset: str | None, num_classes: int) -> tuple[str, ...]:
    """Names of classes ``0 .. num_classes - 1`` of ``dataset`` for reports and
    figures: :data:`CLASS_NAMES` where it has them (Fashion-MNIST's "T-shirt/top",
    ...), else the class numbers as text ("0", "1", ...: digits, SVHN)."""
    names = CLASS_NAMES.get(dataset or "", ())
    if len(names) == num_classes:
        return names
    return tuple(str(i) for i in range(num_classes))


# ------------------------------------------------------------------ augmentation


def augment(
    x: Tensor, aug: Augment, generator: torch.Generator | None = None
) -> Tensor:
    """Random crop of the padded images and random horizontal flip, batched.

    Every image gets its own shift ``(dy, dx) ∈ [-pad, pad]²`` and (with
    ``aug.flip``) a coin-flip mirror; all of it is gather/where on ``x``'s
    device, no per-image Python loop (airbench's approach).

    Args:
        x: images ``(B, C, S, S)``.
        aug: what to apply.
        generator: random source on ``x``'s device (``None``: the global one).

    Returns:
        Augmented images of the same shape and dtype.
    """
    B, C, S, _ = x.shape
    if aug.pad > 0:
        p = aug.pad
        mode = "constant" if aug.pad_mode == "zeros" else "reflect"
        # (B, C, S+2p, S+2p)
        padded = torch.nn.functional.pad(x, (p, p, p, p), mode=mode)
        shift = torch.randint(
            0, 2 * p + 1, (2, B), device=x.device, generator=generator
        )
        ar = torch.arange(S, device=x.device)
        rows = (shift[0][:, None] + ar)[:, None, :, None]  # (B, 1, S, 1)
        cols = (shift[1][:, None] + ar)[:, None, None, :]  # (B, 1, 1, S)
        batch = torch.arange(B, device=x.device)[:, None, None, None]  # (B, 1, 1, 1)
        chans = torch.arange(C, device=x.device)[None, :, None, None]  # (1, C, 1, 1)
        x = padded[batch, chans, rows, cols]  # (B, C, S, S)
    if aug.flip:
        flip = torch.rand(B, device=x.device, generator=generator) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    return x


# ---------------------------------------------------------------- loaders


def load_dataset(
    name: str = "digits",
    data_dir: PathLike | None = None,
    device: str | torch.device = "cpu",
) -> Dataset:
    """Load dataset ``name`` onto ``device``.

    Args:
        name: ``"digits"`` (bundled with scikit-learn, 1437 train / 360 test
            images from a fixed seeded stratified split), ``"mnist"``,
            ``"fashion-mnist"``, ``"svhn"``, ``"cifar10"`` or ``"cifar100"``
            (from ``data_dir``).
        data_dir: directory holding the distribution files (not used by digits;
            ``None``: the dataset's :data:`DEFAULT_DATA_DIRS` entry).
        device: where the tensors live.

    Raises:
        ValueError: unknown name.
        DataError: ``data_dir`` missing, or its files absent or malformed (the
            message names the files expected and where they come from).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    if name == "digits":
        arrays = _digits()
    else:
        arrays = _LOADERS[name](_data_root(name, data_dir))
    x_train, y_train, x_test, y_test, num_classes = arrays
    aug = _AUGMENT[name]
    xt = torch.from_numpy(x_train)
    mean = tuple(float(m) for m in xt.mean(dim=(0, 2, 3), dtype=torch.float64))
    std = tuple(float(s) for s in xt.std(dim=(0, 2, 3)).double())
    std = tuple(s if s > 0 else 1.0 for s in std)
    return Dataset(
        name=name,
        x_train=xt.to(device),
        y_train=torch.from_numpy(y_train).to(device),
        x_test=torch.from_numpy(x_test).to(device),
        y_test=torch.from_numpy(y_test).to(device),
        num_classes=num_classes,
        mean=mean,
        std=std,
        augment=aug,
    )


def check_data_dir(name: str, data_dir: PathLike | None) -> None:
    """Refuse (:class:`DataError`, the message of :func:`load_dataset`) a
    dataset's missing directory without reading it: for a command that starts
    other work (processes, files) before it loads the data."""
    if name != "digits":
        _data_root(name, data_dir)


def _data_root(name: str, data_dir: PathLike | None) -> Path:
    """``data_dir`` (or the default directory of ``name``), checked to exist."""
    if data_dir is None:
        default = DEFAULT_DATA_DIRS.get(name)
        if default is None:
            raise DataError(f"dataset {name} needs --data-dir: {_HELP[name]}")
        if not default.is_dir():
            raise DataError(
                f"{name}: no --data-dir given and {default} does not exist; "
                f"{_HELP[name]}"
            )
        return default
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist; {name}: {_HELP[name]}")
    return root


_AUGMENT: dict[str, Augment] = {
    # At 8×8 a one-pixel shift moves an eighth of the digit off the image; it
    # cost the digits-tiny ViT about ten points of test accuracy at the epoch
    # budget of the default runs (measured, issue 2), so digits train unaugmented.
    "digits": Augment(pad=0, flip=False),
    "mnist": Augment(pad=2, flip=False, pad_mode="zeros"),
    # A mirrored garment or shoe is of the same class, so Fashion-MNIST takes
    # flips. Shifts of up to 2 pixels (half a 4-pixel patch) made the 3×64
    # standard ViT underfit in 30 epochs (88.2 % against 90.1 % with flips
    # alone, docs/results/fashion-mnist.md).
    "fashion-mnist": Augment(pad=0, flip=True),
    "svhn": Augment(pad=2, flip=False, pad_mode="reflect"),
    "cifar10": Augment(pad=4, flip=True, pad_mode="reflect"),
    "cifar100": Augment(pad=4, flip=True, pad_mode="reflect"),
}

_HELP: dict[str, str] = {
    "mnist": (
        "expects train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (each optionally .gz) "
        "in the directory or in MNIST/raw/ below it, from "
        "https://yann.lecun.com/exdb/mnist/ (mirror: "
        "https://ossci-datasets.s3.amazonaws.com/mnist/)"
    ),
    "fashion-mnist": (
        "expects train-images-idx3-ubyte, train-labels-idx1-ubyte, "
        "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (each optionally .gz); "
        "get them with `apt-get install dataset-fashion-mnist` (Debian, into "
        "/usr/share/datasets/fashion-mnist, the default --data-dir) or download "
        "the four files from https://github.com/zalandoresearch/fashion-mnist "
        "(data/fashion/) into a directory given as --data-dir"
    ),
    "svhn": (
        "expects train_32x32.mat and test_32x32.mat (format 2, cropped digits) "
        "from http://ufldl.stanford.edu/housenumbers/"
    ),
    "cifar10": (
        "expects data_batch_1 ... data_batch_5 and test_batch (python "
        "version) in the directory or in cifar-10-batches-py/ below it, from "
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz (extract it)"
    ),
    "cifar100": (
        "expects train and test (python version) in the directory or in "
        "cifar-100-python/ below it, from "
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz (extract it)"
    ),
}

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]


def _finish(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
) -> Arrays:
    """uint8 ``(n, C, S, S)`` images to float32 in [0, 1]; labels to int64."""

    def img(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32) / np.float32(255.0)

    return (
        img(x_train),
        np.asarray(y_train, dtype=np.int64),
        img(x_test),
        np.asarray(y_test, dtype=np.int64),
        num_classes,
    )


def cache_dir() -> Path:
    """Where lipvit keeps files it can remake: ``$XDG_CACHE_HOME/lipvit``
    (``~/.cache/lipvit`` by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "lipvit"


def _digits() -> Arrays:
    """:func:`_digits_split`, kept in :func:`cache_dir` (one file per
    scikit-learn version, written atomically; remade when absent or unreadable,
    and not kept where the directory cannot be written): importing
    scikit-learn takes about a second of every command's start, reading the
    file milliseconds."""
    from importlib.metadata import version

    path = cache_dir() / f"digits-sklearn-{version('scikit-learn')}.npz"
    names = ("x_train", "y_train", "x_test", "y_test")
    try:
        with np.load(path) as f:
            return (*(f[n] for n in names), 10)
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        pass
    arrays = _digits_split()
    with contextlib.suppress(OSError, LipvitError), \
            atomic_path(path, force=True) as tmp:
        np.savez(tmp, **dict(zip(names, arrays[:4], strict=True)))
    return arrays


def _digits_split() -> Arrays:
    """scikit-learn's 8×8 digits, pixels / 16, stratified 1437/360 split (seed 0)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None]  # (1797, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=360, stratify=y, random_state=0
    )
    return (
        np.ascontiguousarray(x_train),
        y_train,
        np.ascontiguousarray(x_test),
        y_test,
        10,
    )


def _find(
    root: Path, names: list[str], subdirs: tuple[str, ...], dataset: str
) -> list[Path]:
    """Paths of ``names`` in ``root`` or one of ``subdirs`` (first full set wins)."""
    for base in (root, *(root / s for s in subdirs)):
        paths = [base / n for n in names]
        if all(p.is_file() for p in paths):
            return paths
    missing = [
        n
        for n in names
        if not any((b / n).is_file() for b in (root, *(root / s for s in subdirs)))
    ]
    raise DataError(
        f"{dataset}: {', '.join(missing)} not found in {root}; {_HELP[dataset]}"
    )


def _bad(dataset: str, path: Path, why: str) -> DataError:
    return DataError(f"{dataset}: {path} is malformed ({why}); {_HELP[dataset]}")


class _NumpyUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds numpy arrays and plain containers.

    The CIFAR files are pickles; refusing every other global means a foreign
    file cannot run code while being read.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def _unpickle(path: Path, dataset: str) -> dict[bytes, Any]:
    try:
        with open(path, "rb") as f:
            obj = _NumpyUnpickler(f, encoding="bytes").load()
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        ImportError,
        IndexError,
        KeyError,
    ) as err:
        raise _bad(dataset, path, f"not a CIFAR python pickle: {err}") from err
    if not isinstance(obj, dict):
        raise _bad(dataset, path, "not a dict")
    return {k.encode() if isinstance(k, str) else k: v for k, v in obj.items()}


def _cifar_part(
    path: Path, dataset: str, label_key: bytes
) -> tuple[np.ndarray, np.ndarray]:
    batch = _unpickle(path, dataset)
    if b"data" not in batch or label_key not in batch:
        raise _bad(dataset, path, f"missing keys 'data' or {label_key.decode()!r}")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[label_key])
    if (
        data.ndim != 2
        or data.shape[1] != 3 * 32 * 32
        or data.shape[0] != labels.shape[0]
    ):
        raise _bad(
            dataset,
            path,
            f"data of shape {data.shape} with {labels.shape[0]} "
            "labels (expected (n, 3072) and n labels)",
        )
    return data.reshape(-1, 3, 32, 32).astype(np.uint8), labels  # (n, 3, 32, 32)


def _check_labels(
    dataset: str, path: Path, labels: np.ndarray, num_classes: int
) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise _bad(dataset, path, f"labels outside 0..{num_classes - 1}")


def _cifar10(root: Path) -> Arrays:
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    paths = _find(root, names, ("cifar-10-batches-py",), "cifar10")
    parts = [_cifar_part(p, "cifar10", b"labels") for p in paths]
    for p, (_, y) in zip(paths, parts, strict=True):
        _check_labels("cifar10", p, y, 10)
    x_train = np.concatenate([x for x, _ in parts[:5]])
    y_train = np.concatenate([y for _, y in parts[:5]])
    return _finish(x_train, y_train, parts[5][0], parts[5][1], 10)


def _cifar100(root: Path) -> Arrays:
    paths = _find(root, ["train", "test"], ("cifar-100-python",), "cifar100")
    (x_train, y_train), (x_test, y_test) = (
        _cifar_part(p, "cifar100", b"fine_labels") for p in paths
    )
    for p, y in zip(paths, (y_train, y_test), strict=True):
        _check_labels("cifar100", p, y, 100)
    return _finish(x_train, y_train, x_test, y_test, 100)


def _svhn(root: Path) -> Arrays:
    import scipy.io
    from scipy.io.matlab import MatReadError

    paths = _find(root, ["train_32x32.mat", "test_32x32.mat"], ("svhn",), "svhn")
    out = []
    for path in paths:
        try:
            mat = scipy.io.loadmat(path)
        except (
            MatReadError,
            ValueError,
            TypeError,
            OSError,
            NotImplementedError,
        ) as err:
            raise _bad("svhn", path, f"not a MATLAB file: {err}") from err
        if "X" not in mat or "y" not in mat:
            raise _bad("svhn", path, "missing variables X or y")
        X, y = np.asarray(mat["X"]), np.asarray(mat["y"]).reshape(-1).astype(np.int64)
        if X.ndim != 4 or X.shape[:3] != (32, 32, 3) or X.shape[3] != y.shape[0]:
            raise _bad(
                "svhn",
                path,
                f"X of shape {X.shape} with {y.shape[0]} labels "
                "(expected (32, 32, 3, n) and n labels)",
            )
        y = np.where(y == 10, 0, y)  # SVHN stores the digit 0 as label 10
        _check_labels("svhn", path, y, 10)
        out.append((X.transpose(3, 2, 0, 1), y))  # (n, 3, 32, 32)
    return _finish(out[0][0], out[0][1], out[1][0], out[1][1], 10)


_IDX_STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
"""The four idx files of MNIST and Fashion-MNIST (same names, each maybe .gz)."""


def _read_idx(path: Path, dataset: str, ndim: int) -> np.ndarray:
    """An idx file (MNIST's format) of ``ndim`` dimensions, gzipped or not, as a
    uint8 array."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as err:
        raise _bad(dataset, path, f"unreadable: {err}") from err
    if len(raw) < 4:
        raise _bad(dataset, path, "too short for an idx header")
    magic = int.from_bytes(raw[:4], "big")
    if magic != 0x0800 + ndim:
        raise _bad(
            dataset,
            path,
            f"magic number {magic:#010x}, expected {0x0800 + ndim:#010x} for an "
            f"idx file of {ndim}-d unsigned bytes",
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise _bad(dataset, path, "truncated idx header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    size = int(np.prod(shape))
    if len(raw) != header + size:
        raise _bad(
            dataset,
            path,
            f"{len(raw) - header} data bytes where shape {shape} needs {size} "
            "(truncated?)",
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _find_idx(root: Path, dataset: str, subdirs: tuple[str, ...]) -> list[Path]:
    """The paths of :data:`_IDX_STEMS` (plain or .gz) in ``root`` or ``subdirs``."""
    paths = []
    for stem in _IDX_STEMS:
        for base in (root, *(root / s for s in subdirs)):
            hits = [base / n for n in (stem, stem + ".gz") if (base / n).is_file()]
            if hits:
                paths.append(hits[0])
                break
        else:
            raise DataError(
                f"{dataset}: {stem}[.gz] not found in {root}; {_HELP[dataset]}"
            )
    return paths


def _idx_dataset(root: Path, dataset: str, subdirs: tuple[str, ...]) -> Arrays:
    """A dataset of four idx files (:data:`_IDX_STEMS`): square grayscale images
    ``(n, S, S)`` and their labels ``0..9``."""
    paths = _find_idx(root, dataset, subdirs)
    x_train, y_train, x_test, y_test = (
        _read_idx(p, dataset, ndim) for p, ndim in zip(paths, (3, 1, 3, 1), strict=True)
    )
    for p, x, y in ((paths[0], x_train, y_train), (paths[2], x_test, y_test)):
        if x.shape[0] != y.shape[0]:
            raise _bad(
                dataset,
                p,
                f"{x.shape[0]} images but {y.shape[0]} labels: images "
                f"{x.shape} and labels {y.shape} do not match",
            )
        if x.shape[1] != x.shape[2]:
            raise _bad(dataset, p, f"images of shape {x.shape[1:]} are not square")
    _check_labels(dataset, paths[1], y_train, 10)
    _check_labels(dataset, paths[3], y_test, 10)
    return _finish(x_train[:, None], y_train, x_test[:, None], y_test, 10)


def _mnist(root: Path) -> Arrays:
    return _idx_dataset(root, "mnist", ("MNIST/raw", "mnist"))


def _fashion_mnist(root: Path) -> Arrays:
    # torchvision's layout, then the dataset repository's data/fashion/.
    return _idx_dataset(
        root, "fashion-mnist", ("FashionMNIST/raw", "fashion-mnist", "data/fashion")
    )


_LOADERS = {
    "mnist": _mnist,
    "fashion-mnist": _fashion_mnist,
    "svhn": _svhn,
    "cifar10": _cifar10,
    "cifar100": _cifar100,
}
