"""The datasets of ``dgt train --dataset``: digits, Fashion-MNIST, CIFAR-10.

Each loader returns a :class:`Dataset`: train and test tensors already normalised per
channel with the training split's own mean and standard deviation (the test split is
never trained on, and never used for the statistics either).

- ``digits``: the UCI handwritten digits that scikit-learn ships
  (``sklearn.datasets.load_digits``: 1,797 8x8 images, 16 grey levels, 10 classes),
  stratified 80/20 train/test split seeded by ``seed``, scaled to [0, 1] (no per-channel
  normalisation: ``dgt train``'s original job, kept bit for bit).
- ``fashion-mnist``: Zalando's Fashion-MNIST (Xiao et al. 2017; 60,000 + 10,000 28x28
  greyscale images, 10 classes) from its four IDX files (gzipped or not), by default
  those of Debian's package ``dataset-fashion-mnist`` in
  ``/usr/share/datasets/fashion-mnist``. IDX: http://yann.lecun.com/exdb/mnist/ (big-endian
  magic 0x00000803 for images, 0x00000801 for labels, then the dimensions as uint32).
- ``cifar10``: CIFAR-10 (Krizhevsky 2009; 50,000 + 10,000 32x32 RGB images, 10 classes)
  from a user directory in the standard "python version" layout
  (https://www.cs.toronto.edu/~kriz/cifar.html): ``data_batch_1`` .. ``data_batch_5`` and
  ``test_batch``, each a pickled dict with ``b'data'`` (uint8, (N, 3072), channel-major
  32x32 planes R, G, B) and ``b'labels'`` (N ints in 0..9); ``batches.meta`` is optional.
  The pickles are read with an unpickler that accepts only the numpy/builtin types those
  files hold, so a hostile file cannot run code. The directory may be the
  ``cifar-10-batches-py`` folder itself or its parent. Training adds the usual light
  augmentation (:func:`augment`: 4-pixel padded random crop, horizontal flip).

Every problem with the files raises :class:`DatasetError` with one line that says what
to do.
"""
from __future__ import annotations

import gzip
import io
import math
import os
import pickle
import zlib
from dataclasses import dataclass

import numpy as np

from ..run_files import not_regular

#: name -> (channels, height, width) of one sample
SHAPES = {"digits": (1, 8, 8), "fashion-mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
from . import DATASETS  # noqa: F401  (one list of names)
CLASSES = 10   # every dataset here has 10 classes
#: (training, test) images of the published datasets (Xiao et al. 2017; Krizhevsky 2009)
FULL_SIZES = {"fashion-mnist": (60_000, 10_000), "cifar10": (50_000, 10_000)}
#: training samples of the fixed-size datasets (CIFAR-10's depends on the user's files)
TRAIN_SAMPLES = {"digits": 1437, "fashion-mnist": FULL_SIZES["fashion-mnist"][0]}
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
_FMNIST_FILES = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
                 "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_FILE = "test_batch"


class DatasetError(ValueError):
    """A dataset's files are missing, unreadable or malformed; the message says what
    to do, on one line: whitespace in it (newlines included, as in an unpickler's or a
    decompressor's own text that a message quotes) is collapsed to single spaces."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass
class Dataset:
    """One dataset, in memory.

    ``x_train``/``x_test``: float32 (n, C, H, W), normalised; ``y_train``/``y_test``:
    int64 (n,) in 0..classes-1; ``shape``: (C, H, W); ``augment``: whether training
    batches go through :func:`augment`.
    """

    name: str
    x_train: "torch.Tensor"
    y_train: "torch.Tensor"
    x_test: "torch.Tensor"
    y_test: "torch.Tensor"
    shape: tuple
    classes: int = CLASSES
    augment: bool = False
    source: str = ""

    def subset_note(self) -> str | None:
        """One line when this is not the whole published dataset it is named for (a
        subset someone cut, or other files in its format), else None."""
        full = FULL_SIZES.get(self.name)
        have = (len(self.y_train), len(self.y_test))
        if full is None or have == full:
            return None
        return (f"{self.source} holds {have[0]:,} training and {have[1]:,} test images, "
                f"not {self.name}'s {full[0]:,} and {full[1]:,}: a subset (or other "
                f"files), whose accuracy is not the published dataset's")

    def describe(self) -> dict:
        return {"dataset": self.name, "shape": list(self.shape), "classes": self.classes,
                "train_samples": len(self.y_train), "test_samples": len(self.y_test),
                "augment": self.augment, "source": self.source}


def load(name: str, data_dir: str = "", seed: int = 0) -> Dataset:
    """Load dataset ``name`` (one of :data:`DATASETS`). ``data_dir``: where its files
    are (Fashion-MNIST: default the Debian package's folder; CIFAR-10: required);
    ``seed``: the digits' train/test split. Raises DatasetError, ValueError (unknown
    name)."""
    if name == "digits":
        return load_digits(seed)
    if name == "fashion-mnist":
        return load_fashion_mnist(data_dir or FASHION_MNIST_DIR)
    if name == "cifar10":
        return load_cifar10(data_dir)
    raise ValueError(f"unknown dataset {name!r}; use one of {', '.join(DATASETS)}")


def load_digits(seed: int = 0) -> Dataset:
    """The scikit-learn digits, split 80/20 (stratified, ``random_state=seed``); x in
    [0, 1] as (n, 1, 8, 8) float32."""
    import torch
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split
    x, y = sk_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    return Dataset("digits", torch.from_numpy(xtr).view(-1, 1, 8, 8),
                   torch.from_numpy(ytr).long(), torch.from_numpy(xte).view(-1, 1, 8, 8),
                   torch.from_numpy(yte).long(), SHAPES["digits"],
                   source="sklearn.datasets.load_digits")


# ----------------------------------------------------------------------- Fashion-MNIST


def read_bytes(path: str, fix: str) -> bytes:
    """The bytes of the dataset file ``path``. Raises DatasetError naming the file, and
    ``fix`` as what to do (or, for a file this user may not read, to make it readable:
    breaker round 24's valid batch of mode 000 was called no CIFAR-10 batch)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except PermissionError as e:
        raise DatasetError(f"cannot read {path}: {e.strerror}; make it readable by this "
                           f"user (uid {os.getuid()})") from None
    except OSError as e:
        raise DatasetError(f"cannot read {path}: {e.strerror or e}; {fix}") from None


def read_idx(path: str, magic: int, dims: int) -> np.ndarray:
    """One IDX file (gzipped when its name ends in .gz) as a uint8 array of ``dims``
    dimensions. Raises DatasetError naming the file."""
    raw = read_bytes(path, "reinstall the file")
    if path.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:   # gzip.BadGzipFile is an OSError
            raise DatasetError(f"cannot read {path}: {e}; reinstall the file") from None
    want = 4 + 4 * dims
    if len(raw) < want or int.from_bytes(raw[:4], "big") != magic:
        raise DatasetError(f"{path} is not an IDX file (magic {magic:#010x} expected); "
                           f"reinstall the file")
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    if len(raw) - want != math.prod(shape):   # exact: np.prod would wrap at 2**63
        raise DatasetError(f"{path} is truncated or corrupt ({len(raw) - want} data bytes, "
                           f"{math.prod(shape)} expected for shape {shape}); reinstall "
                           f"the file")
    return np.frombuffer(raw, np.uint8, offset=want).reshape(shape)


def _not_regular(folder: str, names) -> str | None:
    """The first of ``names`` in ``folder`` that is there but is not a regular file (a
    FIFO, a directory, a dangling link: dgt.run_files.not_regular), as one line for the
    user, else None. Without it such a file was reported as missing."""
    for name in names:
        path = os.path.join(folder, name)
        try:
            what = not_regular(path)
        except OSError as e:
            return f"{path}: {e.strerror}; give the dataset's files"
        if what:
            return f"{path} is {what}, not a regular file; give the dataset's files"
    return None


def _find(folder: str, base: str) -> str | None:
    for name in (base + ".gz", base):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def fashion_mnist_both_forms(folder: str = FASHION_MNIST_DIR) -> list[str]:
    """The IDX files that ``folder`` holds both gzipped and plain (the gzipped one is
    read: :func:`_find`), which may be two different versions."""
    return [b for b in _FMNIST_FILES.values()
            if all(os.path.isfile(os.path.join(folder, n)) for n in (b + ".gz", b))]


def fashion_mnist_missing(folder: str = FASHION_MNIST_DIR) -> str | None:
    """None when the four IDX files are in ``folder``, else the one line that says what
    to do."""
    missing = [b for b in _FMNIST_FILES.values() if _find(folder, b) is None]
    if not missing:
        return None
    odd = _not_regular(folder, [n for b in missing for n in (b + ".gz", b)])
    if odd:
        return odd
    if folder == FASHION_MNIST_DIR:
        return (f"Fashion-MNIST is not in {folder}; install Debian's package "
                f"'{FASHION_MNIST_PACKAGE}' (apt-get install {FASHION_MNIST_PACKAGE}) or "
                f"give --data-dir with its four IDX files")
    return (f"--data-dir {folder} lacks {missing[0]}(.gz) (Fashion-MNIST's four IDX files "
            f"are expected there); give the right --data-dir, or install Debian's package "
            f"'{FASHION_MNIST_PACKAGE}' and drop --data-dir")


def load_fashion_mnist(folder: str = FASHION_MNIST_DIR) -> Dataset:
    """Fashion-MNIST from the IDX files in ``folder``; x as (n, 1, 28, 28) float32,
    normalised with the training images' mean and std. Raises DatasetError."""
    import torch
    why = fashion_mnist_missing(folder)
    if why:
        raise DatasetError(why)
    arr = {k: read_idx(_find(folder, b), 0x803 if k.startswith("x") else 0x801,
                       3 if k.startswith("x") else 1) for k, b in _FMNIST_FILES.items()}
    for split in ("train", "test"):
        x, y = arr["x_" + split], arr["y_" + split]
        if x.shape[1:] != (28, 28) or len(x) != len(y) or (y > 9).any():
            raise DatasetError(f"{folder}: the {split} images and labels do not match "
                               f"Fashion-MNIST (28x28 images, as many labels in 0..9); "
                               f"reinstall the files")
    xtr = torch.from_numpy(arr["x_train"].astype(np.float32) / 255.0).unsqueeze(1)
    xte = torch.from_numpy(arr["x_test"].astype(np.float32) / 255.0).unsqueeze(1)
    xtr, xte = normalise(xtr, xte)
    return Dataset("fashion-mnist", xtr, torch.from_numpy(arr["y_train"].astype(np.int64)),
                   xte, torch.from_numpy(arr["y_test"].astype(np.int64)),
                   SHAPES["fashion-mnist"], source=os.path.abspath(folder))


# ----------------------------------------------------------------------------- CIFAR-10


class _CifarUnpickler(pickle.Unpickler):
    """Only what a CIFAR-10 batch pickle holds: builtins and numpy arrays."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray",
                "_reconstruct"), ("numpy", "ndarray"), ("numpy", "dtype"),
                ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if (module, name) == ("_codecs", "encode"):   # protocol 2's bytes, from Python 3
            return _latin1_bytes
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR-10 batch")


def _latin1_bytes(text, encoding="latin1"):
    """What a protocol-2 pickle written by Python 3 calls to make a bytes object
    (``_codecs.encode(str, "latin1")``), and nothing else. Raises UnpicklingError."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is allowed only for latin1 bytes")
    return text.encode("latin1")


def _cifar_dir(folder: str) -> str:
    if not folder:
        raise DatasetError("--dataset cifar10 needs --data-dir: a folder in CIFAR-10's "
                           "python layout (cifar-10-batches-py, from "
                           "https://www.cs.toronto.edu/~kriz/cifar.html)")
    sub = os.path.join(folder, "cifar-10-batches-py")
    d = sub if os.path.isdir(sub) else folder
    if not os.path.isdir(d):
        raise DatasetError(f"--data-dir {folder} is not a folder; give the folder that "
                           f"holds data_batch_1..5 and test_batch (cifar-10-batches-py)")
    missing = [f for f in CIFAR_TRAIN_FILES + (CIFAR_TEST_FILE,)
               if not os.path.isfile(os.path.join(d, f))]
    odd = _not_regular(d, missing)
    if odd:
        raise DatasetError(odd)
    if missing:
        raise DatasetError(f"--data-dir {folder} lacks {missing[0]}: CIFAR-10's python "
                           f"layout has data_batch_1..5 and test_batch; give the "
                           f"cifar-10-batches-py folder")
    return d


def read_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch file: (uint8 (n, 3, 32, 32), int64 (n,)). Raises
    DatasetError naming the file."""
    raw = read_bytes(path, "download the python version again")
    try:
        d = _CifarUnpickler(io.BytesIO(raw), encoding="bytes").load()
        data = np.asarray(d[b"data"])
        labels = np.asarray(d[b"labels"])
        if len(labels) and not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels of dtype {labels.dtype}, not whole numbers")
        labels = labels.astype(np.int64)
    except Exception as e:   # noqa: BLE001 -- untrusted bytes: any failure of the
        # restricted unpickler (Overflow-, Recursion-, Unpickling-, KeyError, ...) or of
        # the fields' conversion means the same thing to the user
        raise DatasetError(f"{path} is not a CIFAR-10 batch ({type(e).__name__}: "
                           f"{str(e)[:80]}); download the python version again") from None
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 \
            or len(labels) != len(data) or (len(labels) and not
                                           (0 <= labels.min() and labels.max() <= 9)):
        raise DatasetError(f"{path} is not a CIFAR-10 batch (uint8 data (n, 3072) and n "
                           f"labels in 0..9 expected); download the python version again")
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(folder: str) -> Dataset:
    """CIFAR-10 from ``folder`` (python layout); x as (n, 3, 32, 32) float32,
    normalised per channel with the training images' statistics. Raises DatasetError."""
    import torch
    d = _cifar_dir(folder)
    parts = [read_cifar_batch(os.path.join(d, f)) for f in CIFAR_TRAIN_FILES]
    xte, yte = read_cifar_batch(os.path.join(d, CIFAR_TEST_FILE))
    xtr = np.concatenate([p[0] for p in parts])
    ytr = np.concatenate([p[1] for p in parts])
    if not len(xtr) or not len(xte):
        raise DatasetError(f"{d}: the training or test batches are empty; download the "
                           f"python version again")
    xtr_t = torch.from_numpy(xtr.astype(np.float32) / 255.0)
    xte_t = torch.from_numpy(xte.astype(np.float32) / 255.0)
    xtr_t, xte_t = normalise(xtr_t, xte_t)
    return Dataset("cifar10", xtr_t, torch.from_numpy(ytr), xte_t, torch.from_numpy(yte),
                   SHAPES["cifar10"], augment=True, source=os.path.abspath(d))


def write_cifar_batch(path: str, data: np.ndarray, labels) -> None:
    """Write one batch file in CIFAR-10's python format (``data``: uint8 (n, 3072)).
    For tests and for users who cut their own subsets."""
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"dgt", b"labels": [int(v) for v in labels],
                     b"data": np.ascontiguousarray(data, dtype=np.uint8),
                     b"filenames": [b"%d.png" % i for i in range(len(labels))]}, f)


# ---------------------------------------------------------------------- preprocessing


def normalise(xtr, xte):
    """Per-channel (x - mean) / std with the training split's statistics (float64
    accumulation), applied to both splits. Shapes (n, C, H, W) float32."""
    mean = xtr.double().mean(dim=(0, 2, 3), keepdim=True)
    std = xtr.double().std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return (((xtr - mean) / std).float(), ((xte - mean) / std).float())


def augment(x, generator, pad: int = 4):
    """The usual light CIFAR augmentation, per sample: a random crop of the image
    zero-padded by ``pad`` pixels, then a horizontal flip with probability 1/2. ``x``:
    float32 (n, C, H, W); ``generator``: a seeded ``torch.Generator`` (every rank seeds
    its own, so runs repeat). Returns a new tensor of the same shape."""
    import torch
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    out = torch.empty_like(x)
    for i in range(n):
        crop = padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
        out[i] = crop.flip(-1) if flip[i] else crop
    return out
