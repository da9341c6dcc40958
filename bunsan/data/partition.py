"""Each worker's share of an epoch: a pure split function and a torch ``Sampler``.

The contract every worker relies on (DESIGN.md, "Data"):

* every rank computes the same epoch order from ``(seed, epoch)`` alone, with no
  communication, so the shards are disjoint by construction;
* every rank gets the same number of samples, so every rank runs the same number
  of steps and the collectives of a step always have a partner;
* what happens to the ``num_samples % world_size`` remainder is explicit:
  ``drop_last=False`` pads, ``drop_last=True`` drops.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Sampler

from bunsan._validate import check_int

__all__ = ["Partition", "epoch_order", "shard_indices", "shard_size"]


def _default_rank_size() -> tuple[int, int]:
    """Return this worker's ``(rank, world_size)``, or ``(0, 1)`` outside a job.

    The one place of ``bunsan.data`` that asks for the defaults. A script
    started by a launcher as a job of several workers that builds its loader
    before ``bunsan.init()`` (a port that kept its DataLoader line first) joins
    the job here, as :func:`bunsan.distribute` does: otherwise every worker
    would silently train on all of the data as a job of one.
    """
    from bunsan.comm import get_rank, get_world_size, is_initialized

    if not is_initialized():
        from bunsan import runtime

        if runtime.detect_environment().world_size > 1:
            runtime.init()
    return get_rank(), get_world_size()


def _as_int(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as an int (numpy integers included), checked by :func:`bunsan._validate.check_int`."""
    if not isinstance(value, bool) and hasattr(type(value), "__index__"):
        value = operator.index(value)
    return int(check_int(name, value, minimum=minimum))


def _check(num_samples: int, rank: int, world_size: int, drop_last: bool) -> tuple[int, int, int]:
    world_size = _as_int("world_size", world_size, 1)
    rank = _as_int("rank", rank)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}; pass 0 <= rank < world_size")
    num_samples = _as_int("num_samples", num_samples, 0)
    if drop_last and num_samples < world_size:
        raise ValueError(
            f"num_samples={num_samples} < world_size={world_size} with drop_last=True leaves every "
            "worker without data; use drop_last=False (pads by repeating samples) or fewer workers"
        )
    if not drop_last and num_samples == 0:
        raise ValueError("num_samples must be >= 1 with drop_last=False: there is nothing to pad with")
    return num_samples, rank, world_size


def _generator_seed(seed: int, epoch: int) -> int:
    # A 64-bit hash of the pair rather than seed + epoch, so that (seed=0, epoch=1)
    # and (seed=1, epoch=0) give unrelated orders. blake2b, unlike hash(), is the
    # same in every process and on every platform: all ranks must agree.
    digest = hashlib.blake2b(f"bunsan:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def shard_size(num_samples: int, world_size: int, drop_last: bool = False) -> int:
    """Samples each worker gets per epoch: ``ceil(n / w)``, or ``n // w`` with ``drop_last``. Pure."""
    num_samples, _, world_size = _check(num_samples, 0, world_size, drop_last)
    if drop_last:
        return num_samples // world_size
    return -(-num_samples // world_size)


def epoch_order(num_samples: int, *, epoch: int = 0, seed: int = 0, shuffle: bool = True) -> Tensor:
    """The order of all ``num_samples`` indices in ``epoch``, the same on every rank. Pure.

    With ``shuffle`` it is ``torch.randperm`` drawn from a ``torch.Generator``
    seeded with a hash of ``(seed, epoch)``: deterministic for ``(seed, epoch)``
    and different from one epoch to the next. Without ``shuffle`` it is
    ``0, 1, ..., num_samples - 1`` for every epoch.

    Args:
        num_samples: Length of the dataset; must be >= 0.
        epoch: 0-based epoch; must be >= 0.
        seed: Any integer; the same on every rank.
        shuffle: Whether to permute.

    Returns:
        An int64 tensor of shape ``(num_samples,)``.
    """
    num_samples = _as_int("num_samples", num_samples, 0)
    epoch = _as_int("epoch", epoch, 0)
    seed = _as_int("seed", seed)
    if not shuffle:
        return torch.arange(num_samples, dtype=torch.int64)
    generator = torch.Generator().manual_seed(_generator_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator, dtype=torch.int64)


def shard_indices(
    num_samples: int,
    rank: int,
    world_size: int,
    *,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> Tensor:
    """Indices of worker ``rank``'s share of ``epoch``. Pure: no communication.

    The epoch's order (:func:`epoch_order`, the same on every rank) is first
    made a multiple of ``world_size`` long, then dealt out like cards: worker
    ``r`` gets positions ``r, r + w, r + 2w, ...`` (strided slicing).

    Remainder policy:

    * ``drop_last=False`` (pad): the order is extended by repeating it from its
      start, with exactly ``ceil(n / w) * w - n`` extra entries. Together the
      shards cover every sample at least once; when ``n >= w - 1`` at most
      ``w - 1`` samples appear twice. (With ``n < w - 1`` the order repeats
      cyclically, so a sample may appear more often; counts still differ by at
      most one between samples.)
    * ``drop_last=True`` (drop): the last ``n % w`` entries of the order are
      left out of this epoch. With ``shuffle`` a different tail is left out
      each epoch.

    Why strided and not contiguous blocks: batch ``t`` of every worker comes
    from positions ``[t * B * w, (t + 1) * B * w)`` of the order, so the
    global minibatch of ``w`` workers with batch ``B`` holds exactly the
    samples that one process with batch ``B * w`` would see at step ``t``
    (what the equivalence tests rely on); and with ``drop_last=False`` the
    padding duplicates land one per worker instead of all on the last one.

    Args:
        num_samples: Length of the dataset; >= 1 (pad) or >= ``world_size`` (drop).
        rank: This worker, ``0 <= rank < world_size``.
        world_size: Number of workers; must be >= 1.
        epoch: 0-based epoch; must be >= 0.
        seed: The shuffle seed; must be the same on every rank.
        shuffle: Whether to permute the order each epoch.
        drop_last: Drop the remainder instead of padding.

    Returns:
        An int64 tensor of :func:`shard_size` indices into the dataset.

    Raises:
        ValueError: For arguments out of range, naming the argument.
    """
    num_samples, rank, world_size = _check(num_samples, rank, world_size, drop_last)
    order = epoch_order(num_samples, epoch=epoch, seed=seed, shuffle=shuffle)
    if drop_last:
        order = order[: num_samples - num_samples % world_size]
    else:
        total = -(-num_samples // world_size) * world_size
        if total > num_samples:
            order = order.repeat(-(-total // num_samples))[:total]
    return order[rank::world_size]


class Partition(Sampler[int]):
    """A sampler over this worker's share of each epoch (see :func:`shard_indices`), compatible with
    ``torch.utils.data.DistributedSampler``.

    Call :meth:`set_epoch` before each epoch, as with ``DistributedSampler``, or let
    :func:`bunsan.data.loader` do it. The order depends only on ``(seed, epoch)``,
    never on global random state.

    It takes the place of ``DistributedSampler`` in any ``DataLoader``, with the same
    arguments in the same order (``Partition(dataset, num_replicas, rank, shuffle,
    seed, drop_last)``) and the same attributes (``dataset``, ``num_replicas``,
    ``rank``, ``num_samples``, ``total_size``, ``shuffle``, ``seed``, ``drop_last``,
    ``epoch``)::

        sampler = bunsan.data.Partition(train_set, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(train_set, batch_size=64, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader: ...

    The shards are DistributedSampler's: strided (rank ``r`` takes positions ``r,
    r + w, ...`` of the epoch's order), padded by repeating the order from its start
    or cut at its tail (``drop_last``); without ``shuffle`` a Partition yields
    exactly the indices of a ``DistributedSampler`` with the same arguments. The
    differences:

    * with ``shuffle``, the epoch's permutation is drawn from a hash of ``(seed,
      epoch)`` instead of ``seed + epoch`` (so ``(seed=0, epoch=1)`` and ``(seed=1,
      epoch=0)`` differ): the same shards as a DistributedSampler, in another order;
    * ``num_replicas`` and ``rank`` default to the process group of bunsan's
      runtime, which a launcher's job of several workers joins first (1 and 0 when
      there is none), where DistributedSampler requires a process group;
    * ``dataset`` may be a length instead of a data set; ``world_size`` is accepted
      for ``num_replicas``; :meth:`set_epoch` takes an optional ``start`` to resume
      inside an epoch.

    Args:
        dataset: A sized dataset, or its length as an int.
        num_replicas: Number of workers (also ``world_size``); ``None`` means the
            default group's size.
        rank: This worker; ``None`` means the rank in the default process group.
        shuffle: Reshuffle every epoch.
        seed: Shuffle seed; must be the same on every rank.
        drop_last: Drop the ``len % num_replicas`` remainder instead of padding.
        world_size: bunsan's name for ``num_replicas``; give one of the two.

    Attributes:
        dataset: The data set given, or ``None`` when a length was given.
        dataset_size: Length of the whole data set.
        num_samples: Samples this worker gets per epoch, the same on every worker
            (as ``DistributedSampler.num_samples``; also :attr:`shard_size`).
        epoch: The epoch the next iteration yields.
        start: Leading samples of the epoch's shard that iteration skips (for
            resuming mid-epoch); 0 unless set by :meth:`set_epoch`.

    Raises:
        TypeError: ``dataset`` is neither sized nor an int, or a count is not an int.
        ValueError: A count is out of range, or ``world_size`` and ``num_replicas`` disagree.
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        world_size: int | None = None,
    ) -> None:
        if num_replicas is not None and world_size is not None and world_size != num_replicas:
            raise ValueError(
                f"world_size={world_size} and num_replicas={num_replicas} disagree; "
                "they are the same thing: give one of them"
            )
        replicas = num_replicas if num_replicas is not None else world_size
        self.dataset = dataset if isinstance(dataset, Sized) else None
        if isinstance(dataset, Sized):
            size = len(dataset)
        elif isinstance(dataset, bool) or not hasattr(type(dataset), "__index__"):
            raise TypeError(
                f"dataset must be a sized dataset or an int, got {type(dataset).__name__}; "
                "an IterableDataset has no length to partition"
            )
        else:
            size = operator.index(dataset)
        if rank is None or replicas is None:
            default_rank, default_world_size = _default_rank_size()
            rank = default_rank if rank is None else rank
            replicas = default_world_size if replicas is None else replicas
        self.dataset_size, self.rank, self.world_size = _check(size, rank, replicas, drop_last)
        self.shuffle = bool(shuffle)
        self.seed = _as_int("seed", seed)
        self.drop_last = bool(drop_last)
        self.shard_size = shard_size(self.dataset_size, self.world_size, self.drop_last)
        self.epoch = 0
        self.start = 0

    @property
    def num_samples(self) -> int:
        """Samples this worker gets per epoch: ``DistributedSampler.num_samples``, :attr:`shard_size`."""
        return self.shard_size

    @property
    def num_replicas(self) -> int:
        """``DistributedSampler``'s name for :attr:`world_size`."""
        return self.world_size

    @property
    def total_size(self) -> int:
        """Samples of one epoch over all workers, padding included (as ``DistributedSampler.total_size``)."""
        return self.shard_size * self.world_size

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Make the next iterations yield ``epoch``'s shard, skipping its first ``start`` samples.

        Args:
            epoch: 0-based epoch; must be >= 0.
            start: Samples of the shard to skip, in ``[0, shard_size]``; a loader
                resuming after ``b`` batches of size ``B`` passes ``b * B``.
        """
        epoch = _as_int("epoch", epoch, 0)
        start = _as_int("start", start, 0)
        if start > self.shard_size:
            raise ValueError(f"start must be <= shard_size={self.shard_size}, got {start}")
        self.epoch, self.start = epoch, start

    def indices(self, epoch: int | None = None) -> Tensor:
        """This worker's whole shard of ``epoch`` (default: the current one), ignoring ``start``."""
        return shard_indices(
            self.dataset_size,
            self.rank,
            self.world_size,
            epoch=self.epoch if epoch is None else epoch,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start :].tolist())

    def __len__(self) -> int:
        """Samples the next iteration yields: ``shard_size - start``."""
        return self.shard_size - self.start

    def __repr__(self) -> str:
        return (
            f"Partition(dataset_size={self.dataset_size}, rank={self.rank}, world_size={self.world_size}, "
            f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, epoch={self.epoch})"
        )
