"""Random inputs and labels of any shape: for throughput benchmarks and tests."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch.utils.data import TensorDataset

__all__ = ["synthetic"]


def synthetic(
    num_samples: int,
    input_shape: int | Sequence[int],
    num_classes: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> TensorDataset:
    """``num_samples`` standard-normal inputs with uniformly random labels.

    The labels do not depend on the inputs: a model can only memorize them.
    Use it to measure speed, and the bundled data sets to measure accuracy.
    Deterministic for ``seed``, whatever the global random state.

    Args:
        num_samples: Number of samples; must be >= 1.
        input_shape: Shape of one input, e.g. ``(3, 32, 32)``, or an int for 1-D inputs.
        num_classes: Labels are drawn from ``0 .. num_classes - 1``; must be >= 1.
        seed: Seed of a private ``torch.Generator``.
        dtype: Floating dtype of the inputs.

    Returns:
        ``TensorDataset(x, y)``: ``x`` of shape ``(num_samples, *input_shape)``,
        ``y`` int64 of shape ``(num_samples,)``.
    """
    if isinstance(input_shape, int):
        input_shape = (input_shape,)
    shape = tuple(operator.index(d) for d in input_shape)
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if any(d < 1 for d in shape):
        raise ValueError(f"input_shape must have positive sizes, got {shape}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}; labels are int64 anyway")
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn((num_samples, *shape), generator=generator, dtype=dtype)
    y = torch.randint(num_classes, (num_samples,), generator=generator, dtype=torch.int64)
    return TensorDataset(x, y)
