"""Bare torch.distributed collectives, for ``bunsan bench comm`` to time beside bunsan's wrappers.

These call torch.distributed directly: no traffic counting, no error
translation, no collective sequence number. They exist so that the benchmark
can show what the wrappers of :mod:`bunsan.comm.collectives` cost on top of
torch, and they live here because this package is the only one of bunsan
that calls torch.distributed. Training code should use the wrappers.

Every function is collective on the world group.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

__all__ = ["raw_all_gather_into", "raw_all_reduce", "raw_barrier"]


def raw_all_reduce(tensor: Tensor) -> None:
    """Sum ``tensor`` in place over the world with ``torch.distributed.all_reduce``. Collective."""
    dist.all_reduce(tensor)


def raw_all_gather_into(output: Tensor, tensor: Tensor) -> None:
    """Gather every rank's ``tensor`` into ``output``, rank-major, with torch's single-tensor all-gather. Collective."""
    # torch 2.13 names it all_gather_single; older releases all_gather_into_tensor (as collectives.py does)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor)


def raw_barrier() -> None:
    """``torch.distributed.barrier()``. Collective."""
    dist.barrier()
