"""Keeping a model's buffers (BatchNorm running statistics, EMA tables) equal on every rank.

Rule (docs/experiments/design-notes.md, "Buffers"): after every exchange that makes the
replicas' parameters equal, every buffer that changed since the last
synchronization on any rank is replaced by its mean over the ranks that trained.

Why the mean rather than DDP's broadcast from rank 0 before every forward:

* it costs nothing per forward and, for models whose buffers never change (a
  causal mask, rotary tables), nothing at all: which buffers changed rides as one
  flag per module in the exchange's existing metadata, and only when a flag is
  set does a second, small all-reduce carry those buffers;
* for BatchNorm it is the closer match to one process on the global batch: the
  mean of the ranks' running means is exactly the running mean one process would
  keep over the whole batch (equal local batches), where rank 0's is computed
  from its share alone;
* every rank's evaluation then sees the same buffers after every step.

Changes are detected per module from the buffers' version counters (an in-place
update such as ``num_batches_tracked.add_(1)`` bumps it) and their identity (a
buffer re-assigned as a new tensor). BatchNorm's fused kernel updates
``running_mean`` in place without bumping its counter, but the same forward bumps
``num_batches_tracked``, so the module is flagged and all its buffers travel.
Integer buffers are averaged in float64 and rounded. Buffers of synchronized
batch norm layers are equal by construction and are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from bunsan.comm import Traffic, all_reduce, wait

__all__ = ["BufferSync", "synced_buffer_modules"]


def synced_buffer_modules(model: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """The modules whose own buffers must be kept equal across ranks, with those buffers' names.

    Skips synchronized batch norm (``torch.nn.SyncBatchNorm`` and bunsan's), whose
    running statistics are computed from the whole global batch on every rank.
    """
    from bunsan.nn.sync_batchnorm import SyncBatchNorm as BunsanSyncBatchNorm

    out = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.SyncBatchNorm, BunsanSyncBatchNorm)):
            continue
        names = [n for n, b in module.named_buffers(recurse=False) if b is not None]
        if names:
            out.append((name, module, names))
    return out


class BufferSync:
    """Per-module change flags and the averaging of changed buffers. See the module docstring.

    Two ways to average, both collective and decided identically on every rank:

    * :meth:`average` (blocking): the modules whose flag was set on some rank, after
      the exchange that carried the flags;
    * *riding* modules, for exchanges that run every step (``DataParallelSGD``): a
      module once averaged that way (``ride=True``) is averaged at every later
      exchange by an all-reduce launched beside the gradients' (:meth:`launch_riding`,
      :meth:`finish_riding`), so a BatchNorm model pays no extra wait per step.

    Args:
        modules: ``synced_buffer_modules(model)``.
        group: process group.
        traffic: counts the bytes of the buffer all-reduce.
    """

    def __init__(
        self, modules: Sequence[tuple[str, nn.Module, list[str]]], group: ProcessGroup | None, traffic: Traffic
    ) -> None:
        self.modules = list(modules)
        self.group = group
        self.traffic = traffic
        self._seen: list[list[tuple[int, int]]] = [self._stamp(i) for i in range(len(self.modules))]
        self.syncs = 0  # buffer all-reduces run
        self.riding: list[int] = []  # modules averaged at every exchange, beside the gradients
        self._flat: Tensor | None = None  # float64 staging of the riding buffers
        self._views: list[Tensor] = []  # each riding buffer's place in _flat
        self._riding_ids: list[int] = []  # the riding buffers _flat was laid out for
        self._work: Any = None

    def __len__(self) -> int:
        return len(self.modules)

    def _buffers(self, i: int) -> list[Tensor]:
        _, module, names = self.modules[i]
        return [getattr(module, n) for n in names]

    def _stamp(self, i: int) -> list[tuple[int, int]]:
        return [(id(b), b._version) for b in self._buffers(i)]

    def changed(self) -> list[float]:
        """One flag per module: 1.0 where any of its buffers changed since the last sync on this rank.

        Riding modules are averaged at every exchange whatever their flag, so they are not looked at.
        """
        riding = set(self.riding)
        return [0.0 if i in riding or self._stamp(i) == seen else 1.0 for i, seen in enumerate(self._seen)]

    def _copy_back(self, tensors: Sequence[Tensor], flat: Tensor) -> None:
        offset = 0
        for t in tensors:
            part = flat[offset : offset + t.numel()].view_as(t)
            t.copy_(part.round() if not t.dtype.is_floating_point and not t.dtype.is_complex else part)
            offset += t.numel()

    @torch.no_grad()
    def average(
        self, changed_anywhere: Sequence[float], *, contribute: bool, contributors: int, ride: bool = False
    ) -> None:
        """Collective: replace the flagged modules' buffers by their mean over the contributing ranks.

        ``changed_anywhere`` is the all-reduced sum of :meth:`changed`, the same on
        every rank, so every rank runs the same collective (or none). A rank with
        ``contribute=False`` (it has joined) sends zeros and takes the mean. Riding
        modules are skipped (their exchange already ran); with ``ride=True`` the
        modules averaged here ride from now on.
        """
        riding = set(self.riding)
        chosen = [i for i, flag in enumerate(changed_anywhere) if flag > 0 and i not in riding]
        if chosen and contributors > 0:
            tensors = [b for i in chosen for b in self._buffers(i)]
            device = tensors[0].device
            flat = (
                torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
                if contribute
                else torch.zeros(sum(t.numel() for t in tensors), dtype=torch.float64, device=device)
            )
            if contribute:
                flat.div_(contributors)
            all_reduce(flat, group=self.group, traffic=self.traffic)
            self._copy_back(tensors, flat)
            self.syncs += 1
            if ride:
                self.riding = sorted(riding | set(chosen))
                self._flat = None
        for i in range(len(self.modules)):
            self._seen[i] = self._stamp(i)

    def _riding_layout(self) -> tuple[list[Tensor], list[Tensor]]:
        """The riding buffers and their views in the float64 staging buffer, rebuilt when a buffer is replaced."""
        tensors = [b for i in self.riding for b in self._buffers(i)]
        ids = [id(t) for t in tensors]
        if self._flat is None or ids != self._riding_ids:
            self._flat = torch.zeros(sum(t.numel() for t in tensors), dtype=torch.float64, device=tensors[0].device)
            self._views, offset = [], 0
            for t in tensors:
                self._views.append(self._flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
            self._riding_ids = ids
        return tensors, self._views

    @torch.no_grad()
    def launch_riding(self, *, contribute: bool) -> None:
        """Collective: start the all-reduce of the riding modules' buffers (this rank's values, or zeros).

        Called once per round, as early as the buffers are final (``DataParallelSGD``: at
        the first gradient of backward, so the all-reduce overlaps the rest of backward);
        a second call in the same round does nothing.
        """
        if not self.riding or self._work is not None:
            return
        tensors, views = self._riding_layout()
        assert self._flat is not None
        if contribute:
            torch._foreach_copy_(views, tensors)  # one call, float32/int64 -> float64
        else:
            self._flat.zero_()
        self._work = all_reduce(self._flat, group=self.group, traffic=self.traffic, async_op=True)

    @torch.no_grad()
    def finish_riding(self, contributors: int) -> None:
        """Collective: wait for :meth:`launch_riding`'s all-reduce; the riding buffers become the mean."""
        if not self.riding or self._flat is None or self._work is None:
            return
        wait(self._work, "buffer all-reduce")
        self._work = None
        if contributors > 0:
            self._flat.div_(contributors)
            tensors, views = self._riding_layout()
            floats = [(t, v) for t, v in zip(tensors, views, strict=True) if t.dtype.is_floating_point]
            if floats:
                torch._foreach_copy_([t for t, _ in floats], [v for _, v in floats])
            for t, v in zip(tensors, views, strict=True):
                if not t.dtype.is_floating_point:  # counters (num_batches_tracked): the rounded mean
                    t.copy_(v.round())
            self.syncs += 1
        for i in self.riding:
            self._seen[i] = self._stamp(i)
