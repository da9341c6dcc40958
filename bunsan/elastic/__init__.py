"""Elastic training: a job that loses a worker goes on with the others, and a worker that comes back rejoins.

Started by ``bunsan run -np 4 --min-np 2 train.py``; the script is the README's, with one change: the epoch
loop reads ``for epoch in bunsan.epochs(12):`` instead of ``range(12)``, so that a worker that joins late
picks up the job's epoch (:func:`epochs`; in a job that is not elastic it is ``range``). Inside such a job
:func:`bunsan.init` joins torchft's per-step quorum (:mod:`bunsan.elastic.member`),
:func:`bunsan.distribute` returns an :class:`ElasticOptimizer` and :func:`bunsan.data.loader` an
:class:`ElasticLoader`. State other than the model, the optimizer and the loaders that a joining worker must
receive (a learning-rate scheduler, a step counter) is registered with :func:`register`.

Why torchft (Meta's fault-tolerance library for torch): its lighthouse holds the membership outside every
worker, its quorum is per step, its process groups are rebuilt without the lost member, and a member behind
the others receives their state over HTTP from a live peer. These are the parts a protocol of bunsan's own
would have had to build; bunsan adds what its users need on top: the global batch cut among the step's
members so that no sample is lost or repeated, the launcher that keeps the job going and restarts lost
workers, and the one-line change to a script (docs/explanation/elastic.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from bunsan import _allocator
from bunsan.elastic.loader import ElasticLoader, part_bounds
from bunsan.elastic.member import Member, current, join, leave, requested
from bunsan.elastic.optimizer import ElasticOptimizer
from bunsan.elastic.quantized import ElasticQuantizedOptimizer
from bunsan.environment import WorldInfo
from bunsan.errors import ConfigurationError

__all__ = [
    "ElasticLoader",
    "ElasticOptimizer",
    "ElasticQuantizedOptimizer",
    "Member",
    "current",
    "distribute",
    "epochs",
    "join",
    "leave",
    "loader",
    "part_bounds",
    "register",
    "requested",
    "start",
]


def start(backend: str) -> WorldInfo:
    """Join the elastic job the launcher started (:func:`bunsan.init` calls it). ``rank`` and ``world_size`` of
    the result are the worker's slot and the job's starting size; a step's members are :func:`current`'s."""
    if backend != "gloo":
        raise ConfigurationError(f"an elastic job (bunsan run --min-np) runs on gloo for now, not {backend!r}")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # as bunsan.init() does for every worker on CPU
    _allocator.tune()
    member = join(backend)
    slot = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return WorldInfo(
        "elastic", slot, member.start_size, local, local_size, None, 0, os.environ.get("BUNSAN_JOB_ID", "")
    )


def _member() -> Member:
    member = current()
    if member is None:
        raise RuntimeError("not in an elastic job: start the script with bunsan run --min-np, and call bunsan.init()")
    return member


def register(name: str, obj: Any) -> None:
    """Hand ``obj.state_dict()`` to every worker that joins later (it calls ``obj.load_state_dict``).

    For state beyond the model, the optimizer and the loaders, e.g. a learning-rate scheduler. Outside an
    elastic job it does nothing, so a script can call it unconditionally.
    """
    member = current()
    if member is not None:
        member.register(name, obj.state_dict, obj.load_state_dict)


def epochs(total: int) -> Iterator[int]:
    """``range(total)``, except that in an elastic job a worker that joined late continues at the job's epoch.

    Each epoch starts with the next step's quorum, where a joining worker receives the live peers' state
    (loaders included), so the epoch it is told is the job's; the epoch after one ends is the first
    loader's (:class:`ElasticLoader`). A loop that leaves an epoch early still moves on by one.
    """
    member = current()
    if member is None:
        yield from range(total)
        return
    last = -1
    while True:
        member.begin_step()
        source = member.epoch_source
        epoch = max(last + 1, source() if source is not None else 0)
        if epoch >= total:
            return
        last = epoch
        yield epoch


def distribute(
    model: nn.Module, optimizer: torch.optim.Optimizer, algorithm: Any = None
) -> ElasticOptimizer | ElasticQuantizedOptimizer:
    """:func:`bunsan.distribute` in an elastic job with ``DataParallelSGD``: exact, or quantized with error
    feedback (``bits < 32``); its steps commit or drop together. (:func:`bunsan.distribute` builds a
    name-given algorithm first, and sends the block algorithms to :func:`bunsan.elastic.blocks.distribute`.)"""
    if algorithm is None:
        return ElasticOptimizer(model, optimizer, _member())
    if type(algorithm).__name__ == "DataParallelSGD" and algorithm.compression is None and not algorithm.warm_start:
        if algorithm.bits >= 32:
            return ElasticOptimizer(model, optimizer, _member())
        return ElasticQuantizedOptimizer(model, optimizer, _member(), algorithm)
    raise NotImplementedError(
        f"an elastic job (bunsan run --min-np) trains with DataParallelSGD (exact or bits < 32, without "
        f"compression or warm_start), BlockMomentumSGD or ModelAveragingSGD; {algorithm!r} is not elastic yet: "
        "drop --min-np to use it"
    )


_LOADER_OPTIONS = ("shuffle", "seed", "drop_last", "collate_fn")


def loader(dataset: Any, batch_size: int, *args: Any, **options: Any) -> ElasticLoader:
    """:func:`bunsan.data.loader` in an elastic job: an :class:`ElasticLoader`."""
    options.update(zip(("shuffle", "seed", "drop_last"), args, strict=False))
    unknown = sorted(set(options) - set(_LOADER_OPTIONS))
    if unknown:
        raise ValueError(
            f"bunsan.data.loader in an elastic job (bunsan run --min-np) takes {', '.join(_LOADER_OPTIONS)}; "
            f"not {', '.join(unknown)}"
        )
    made = ElasticLoader(_member(), dataset, batch_size, **options)
    member = _member()
    if member.epoch_source is None:
        member.epoch_source = lambda: made.epoch
    return made
