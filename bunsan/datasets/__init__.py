"""Data sets that ship offline, by function or by name.

``digits`` (scikit-learn's 8x8 digits), ``digits32`` (the same images at 32x32
on 3 channels, for CIFAR-shaped models; ``digits32_gray`` on one) and ``mnist1d`` (generated from code)
carry accuracy claims; ``synthetic`` carries speed measurements. ``mnist1d_20k`` is MNIST-1D generated
at four times the default size (20,000 sequences: 16,000 to train, 4,000 to test), for measurements that
a 1,000-sequence test set makes coarse (one sequence is 0.1 point of error) or that a 4,000-sequence
epoch makes too short to time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch.utils.data import TensorDataset

from bunsan.datasets.bundled import digits, digits32, mnist1d, stratified_split
from bunsan.datasets.cifar import cifar10
from bunsan.datasets.idx import mnist_idx, read_idx, write_idx
from bunsan.datasets.synthetic import synthetic

__all__ = [
    "DatasetInfo",
    "cifar10",
    "digits",
    "digits32",
    "info",
    "load",
    "mnist1d",
    "mnist_idx",
    "names",
    "read_idx",
    "stratified_split",
    "synthetic",
    "write_idx",
]


MNIST1D_20K_SAMPLES = 20_000  # mnist1d_20k: get_dataset_args() with num_samples=20000 (train_split 0.8)


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a named data set (default arguments)."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    train_size: int
    test_size: int


_INFO = {
    "digits": DatasetInfo("digits", (1, 8, 8), 10, 1437, 360),
    "digits32": DatasetInfo("digits32", (3, 32, 32), 10, 1437, 360),
    "digits32_gray": DatasetInfo("digits32_gray", (1, 32, 32), 10, 1437, 360),
    "mnist1d": DatasetInfo("mnist1d", (1, 40), 10, 4000, 1000),
    "mnist1d_20k": DatasetInfo("mnist1d_20k", (1, 40), 10, 16000, 4000),
}
_LOADERS: dict[str, Callable[..., TensorDataset]] = {
    "digits": digits,
    "digits32": digits32,
    "digits32_gray": partial(digits32, channels=1),  # 1024 inputs: the 10.5M MLP's (models.MLP10M)
    "mnist1d": mnist1d,
    "mnist1d_20k": partial(mnist1d, num_samples=MNIST1D_20K_SAMPLES),
}


def names() -> list[str]:
    """Names accepted by :func:`info` and :func:`load`."""
    return sorted(_INFO)


def _check_name(name: str) -> None:
    if name not in _INFO:
        raise ValueError(f"unknown data set {name!r}; choose one of: {', '.join(names())}")


def info(name: str) -> DatasetInfo:
    """Input shape, number of classes and split sizes of data set ``name``."""
    _check_name(name)
    return _INFO[name]


def load(name: str, split: str = "train", **kwargs: Any) -> TensorDataset:
    """Load data set ``name``; ``kwargs`` go to its function (:func:`digits`, :func:`digits32`, :func:`mnist1d`)."""
    _check_name(name)
    return _LOADERS[name](split, **kwargs)
