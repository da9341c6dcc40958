"""CIFAR-10 in its binary version, read from a local directory (never downloaded).

The binary version (Krizhevsky, "Learning multiple layers of features from
tiny images", 2009; ``cifar-10-binary.tar.gz``) unpacks into
``cifar-10-batches-bin/`` with five training files ``data_batch_1.bin`` ..
``data_batch_5.bin`` and one test file ``test_batch.bin`` of 10000 records
each. A record is 3073 bytes: the label (one byte, 0..9), then the image as
1024 red, 1024 green and 1024 blue bytes, each plane row by row (so a record
reshapes to ``(3, 32, 32)`` as it is).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["CIFAR10_CLASSES", "CIFAR10_FILES", "RECORD_BYTES", "cifar10"]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_FILES = {
    "train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
    "test": ("test_batch.bin",),
}
IMAGE_SHAPE = (3, 32, 32)
RECORD_BYTES = 1 + 3 * 32 * 32  # label byte + 3072 pixel bytes
_SUBDIRECTORY = "cifar-10-batches-bin"  # what the tarball unpacks to


def _directory(root: Path) -> Path:
    """``root`` itself, or its ``cifar-10-batches-bin`` when the files are there (the unpacked tarball)."""
    if not (root / CIFAR10_FILES["test"][0]).exists() and (root / _SUBDIRECTORY).is_dir():
        return root / _SUBDIRECTORY
    return root


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"CIFAR-10 file {path} is missing; unpack cifar-10-binary.tar.gz (the binary version, not the python "
            f"one) and pass its directory as root"
        ) from None
    if raw.size == 0 or raw.size % RECORD_BYTES:
        whole, rest = divmod(raw.size, RECORD_BYTES)
        raise ValueError(
            f"CIFAR-10 file {path} has {raw.size} bytes: {whole} whole records of {RECORD_BYTES} bytes and "
            f"{rest} bytes more; it is truncated or not a CIFAR-10 binary batch (download it again)"
        )
    records = raw.reshape(-1, RECORD_BYTES)
    labels = records[:, 0]
    if labels.max() >= len(CIFAR10_CLASSES):
        bad = int(np.argmax(labels >= len(CIFAR10_CLASSES)))
        raise ValueError(
            f"CIFAR-10 file {path}: record {bad} has label {int(labels[bad])}, not 0..9; is it CIFAR-100's "
            f"(which has 2 label bytes per record)?"
        )
    return records[:, 1:], labels


def cifar10(root: str | os.PathLike[str], split: str = "train") -> TensorDataset:
    """Read CIFAR-10's binary batches from ``root``.

    Args:
        root: The directory holding ``data_batch_1.bin`` .. ``data_batch_5.bin``
            and ``test_batch.bin``, or the directory that holds the unpacked
            ``cifar-10-batches-bin``.
        split: ``"train"`` (the five training batches, in order, 50000 images)
            or ``"test"`` (10000 images).

    Returns:
        ``TensorDataset(x, y)``: ``x`` float32 of shape ``(N, 3, 32, 32)`` with
        pixels scaled to [0, 1], ``y`` int64 labels 0..9 (names in
        :data:`CIFAR10_CLASSES`).

    Raises:
        ValueError: an unknown split, a file that is not a whole number of
            3073-byte records (e.g. cut short), or a label outside 0..9.
        FileNotFoundError: ``root`` or one of the split's files is missing.
    """
    if split not in CIFAR10_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"CIFAR-10 directory {root} does not exist")
    directory = _directory(root)
    pixels, labels = zip(*(_read_batch(directory / name) for name in CIFAR10_FILES[split]))
    images = torch.from_numpy(np.concatenate(pixels)).reshape(-1, *IMAGE_SHAPE)
    return TensorDataset(images.float().div_(255.0), torch.from_numpy(np.concatenate(labels)).long())
