"""MNIST in its original IDX files, read from a local directory (never downloaded).

The IDX format (LeCun, Cortes and Burges, "The MNIST database of handwritten
digits", 1998) is a 4-byte magic number, big-endian: two zero bytes, a type
code (``0x08`` unsigned byte, ``0x09`` signed byte, ``0x0B`` int16, ``0x0C``
int32, ``0x0D`` float32, ``0x0E`` float64) and the number of dimensions; then
one big-endian int32 per dimension; then the data in C order, big-endian.
MNIST's label files have magic 2049 (``0x00000801``: bytes, 1 dimension) and
its image files 2051 (``0x00000803``: bytes, 3 dimensions). Files may be
gzip-compressed, as they are distributed (``train-images-idx3-ubyte.gz``).
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import TensorDataset

__all__ = ["IMAGES_MAGIC", "LABELS_MAGIC", "mnist_idx", "read_idx", "write_idx"]

LABELS_MAGIC = 2049
IMAGES_MAGIC = 2051

# type code -> big-endian numpy dtype
_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_CODES = {np.dtype(v).newbyteorder("=").str: k for k, v in _DTYPES.items()}

_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _read_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip's magic, whatever the file is called
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as error:
            raise ValueError(f"{path} looks gzip-compressed but cannot be decompressed: {error}") from None
    return raw


def read_idx(path: str | os.PathLike[str], expected_magic: int | None = None) -> Tensor:
    """Read one IDX file (optionally gzip-compressed) into a tensor of its shape.

    Args:
        path: The file.
        expected_magic: When given (2049 for labels, 2051 for images), a file
            with another magic number is refused.

    Returns:
        A tensor of the file's dtype (``uint8`` for MNIST) and shape.

    Raises:
        ValueError: Not an IDX file, the wrong magic number, an unknown type
            code, or a file shorter or longer than its header says; the
            message names the file.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise ValueError(f"{path} is too short to be an IDX file ({len(data)} bytes)")
    magic = int.from_bytes(data[:4], "big")
    if expected_magic is not None and magic != expected_magic:
        raise ValueError(
            f"{path} has magic number {magic}, expected {expected_magic} "
            f"({'labels' if expected_magic == LABELS_MAGIC else 'images'}); is it the right file?"
        )
    if data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise ValueError(f"{path} is not an IDX file (magic number {magic:#010x})")
    dtype, ndim = np.dtype(_DTYPES[data[2]]), data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path} is truncated inside its header")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(
            f"{path} holds {len(data) - header} data bytes but its header {list(shape)} of {dtype.name} says {expected}"
        )
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), copy=True))


def write_idx(path: str | os.PathLike[str], tensor: Tensor, compress: bool | None = None) -> Path:
    """Write ``tensor`` as an IDX file (gzip-compressed when ``compress``, default: a ``.gz`` name).

    Supported dtypes: uint8, int8, int16, int32, float32, float64.
    """
    path = Path(path)
    array = tensor.detach().cpu().numpy()
    code = _CODES.get(array.dtype.newbyteorder("=").str)
    if code is None:
        raise ValueError(f"IDX cannot store dtype {tensor.dtype}; use uint8, int8, int16, int32, float32 or float64")
    header = bytes([0, 0, code, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    data = header + np.ascontiguousarray(array, dtype=np.dtype(_DTYPES[code])).tobytes()
    if compress if compress is not None else path.suffix == ".gz":
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def _find(root: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(
        f"no {stem} or {stem}.gz in {root}; put the MNIST IDX files there "
        "(train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz)"
    )


def mnist_idx(root: str | os.PathLike[str], split: str = "train") -> TensorDataset:
    """MNIST (or any data set in MNIST's IDX layout, e.g. Fashion-MNIST) from local files.

    Looks in ``root`` for ``train-images-idx3-ubyte`` / ``train-labels-idx1-ubyte``
    (``split="train"``) or ``t10k-images-idx3-ubyte`` / ``t10k-labels-idx1-ubyte``
    (``split="test"``), each with or without ``.gz``.

    Args:
        root: The directory holding the files.
        split: ``"train"`` or ``"test"``.

    Returns:
        ``TensorDataset(x, y)``: ``x`` float32 ``(N, 1, H, W)`` in ``[0, 1]``,
        ``y`` int64 ``(N,)``.

    Raises:
        FileNotFoundError: A file is missing (the message lists the names).
        ValueError: A bad split, a file that is not IDX or has the wrong magic
            number, or images and labels of different counts.
    """
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root)
    images_stem, labels_stem = _FILES[split]
    images_path, labels_path = _find(root, images_stem), _find(root, labels_stem)
    images = read_idx(images_path, IMAGES_MAGIC)
    labels = read_idx(labels_path, LABELS_MAGIC)
    if len(images) != len(labels):
        raise ValueError(f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels")
    x = images.to(torch.float32).div_(255.0).unsqueeze(1)
    return TensorDataset(x, labels.to(torch.int64))
