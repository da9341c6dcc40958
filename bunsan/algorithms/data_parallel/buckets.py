"""Gradient buckets: parameters packed into a few flat messages, last layers first.

A bucket's all-reduce starts during backward as soon as its last gradient is ready
(:mod:`bunsan.algorithms.data_parallel`), so the buckets follow the order in which
backward produces gradients (the reverse of registration) and are capped in size; a
small first bucket starts communication early. Each bucket is a
:class:`bunsan.comm.layout.FlatGroup` (one dtype and device), with the state of the
round under way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from bunsan.comm.layout import FlatGroup

__all__ = ["FIRST_BUCKET_MB", "Bucket", "build_buckets"]

FIRST_BUCKET_MB = 1.0  # a small first bucket starts communication early in backward


@dataclass
class Bucket(FlatGroup):
    """One flat message of gradients and the state of its exchange in the round under way."""

    index: int
    buffer: Tensor  # flat gradients of ``params``, in this order
    ready: set[int] = field(default_factory=set)  # positions whose gradient hook fired in this round
    filled: bool = False  # every position's gradient (divided by the world size) is in ``buffer``
    work: Any = None
    wire: Tensor | None = None  # what travels (a half-precision copy, or ``buffer`` itself)
    with_meta: Tensor | None = None  # ``buffer`` plus the metadata slots, one allocation
    meta: Tensor | None = None  # the slots: samples, active ranks, gradient flags, buffer flags
    slots: list[Tensor] = field(default_factory=list)  # each parameter's gradient slot in ``buffer``
    indices: list[int] = field(default_factory=list)  # each parameter's position in the gradient flags


def build_buckets(named_params: Sequence[tuple[str, Tensor]], cap_bytes: int, meta_slots: int = 2) -> list[Bucket]:
    """Group parameters into buckets, last layers first (their gradients are ready first).

    Every bucket's storage has ``meta_slots`` trailing elements; only the last
    bucket's are used (see :meth:`bunsan.algorithms.data_parallel.DataParallelSGD.setup`).
    """
    buckets: list[Bucket] = []
    current: dict[tuple[torch.dtype, torch.device], list[tuple[str, Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}

    def close(key: tuple[torch.dtype, torch.device]) -> None:
        members = current.pop(key, [])
        sizes.pop(key, None)
        if not members:
            return
        fields = FlatGroup.fields_of(members)
        storage = torch.zeros(fields["numel"] + meta_slots, dtype=key[0], device=key[1])
        buckets.append(
            Bucket(
                **fields,
                index=len(buckets),
                buffer=storage[: fields["numel"]],
                with_meta=storage,
                meta=storage[fields["numel"] :],
            )
        )

    for name, p in reversed(list(named_params)):
        key = (p.dtype, p.device)
        current.setdefault(key, []).append((name, p))
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        limit = FIRST_BUCKET_MB * 2**20 if not buckets else cap_bytes
        if sizes[key] >= limit:
            close(key)
    for key in list(current):
        close(key)
    return buckets
