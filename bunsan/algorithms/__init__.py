"""Parallel SGD algorithms and their registry by name; DataParallelSGD's exchange as a DDP communication hook.

>>> from bunsan import algorithms
>>> algorithms.create("data_parallel", compression="fp16")
DataParallelSGD(bits=32, compression='fp16', warm_start=0)
"""

from __future__ import annotations

from typing import Any

from bunsan.algorithms.async_sgd import AsyncSGD
from bunsan.algorithms.auto import Auto
from bunsan.algorithms.averagers import AveragingOptimizer, BlockMomentumAverager, ModelAverager
from bunsan.algorithms.base import Algorithm
from bunsan.algorithms.block_momentum import BlockMomentumSGD
from bunsan.algorithms.data_parallel import DataParallelSGD, HookOptimizer, QuantizedHookState, quantized_hook
from bunsan.algorithms.model_averaging import ModelAveragingSGD

__all__ = [
    "Algorithm",
    "AsyncSGD",
    "Auto",
    "AveragingOptimizer",
    "BlockMomentumAverager",
    "BlockMomentumSGD",
    "DataParallelSGD",
    "HookOptimizer",
    "ModelAverager",
    "ModelAveragingSGD",
    "QuantizedHookState",
    "create",
    "names",
    "quantized_hook",
    "register",
]

_REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Make ``cls`` available to :func:`create` under ``cls.name`` (usable as a decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no `name` class attribute to register it under")
    if _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"algorithm name {cls.name!r} is taken by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    """The registered algorithm names."""
    return sorted(_REGISTRY)


def create(name: str, **options: Any) -> Algorithm:
    """Build the algorithm registered as ``name`` with ``options``."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {names()}") from None
    return cls(**options)


register(DataParallelSGD)
register(BlockMomentumSGD)
register(ModelAveragingSGD)
register(AsyncSGD)
register(Auto)
