"""A DataLoader over this worker's partition that tracks its epoch and position."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, cast

from torch.utils.data import DataLoader, Dataset

from bunsan import elastic
from bunsan.data.partition import Partition, _as_int
from bunsan.elastic import member as _elastic_member

__all__ = ["DistributedLoader", "loader"]

# DataLoader arguments that the Partition owns; passing them would silently
# break the equal-batches-on-every-worker guarantee.
_RESERVED = ("sampler", "batch_sampler", "shuffle", "batch_size", "drop_last")

# Attributes of torch.utils.data.DataLoader that read the same on this loader (a
# ported script reads e.g. ``len(train_loader.dataset)`` or ``loader.num_workers``).
# The rest of DataLoader's attributes concern its own iteration, which this
# loader drives, and are not forwarded.
_FORWARDED = (
    "batch_sampler",
    "collate_fn",
    "generator",
    "in_order",
    "multiprocessing_context",
    "num_workers",
    "persistent_workers",
    "pin_memory",
    "pin_memory_device",
    "prefetch_factor",
    "timeout",
    "worker_init_fn",
)


class DistributedLoader:
    """Iterate this worker's share of ``dataset`` in batches, epoch after epoch.

    Built by :func:`loader`. Each ``for batch in loader`` is one epoch: the
    first iteration is epoch 0 and every new iteration starts the next epoch
    (also after a ``break``), reshuffled from ``seed``. Call :meth:`set_epoch`
    to pick the epoch yourself instead.

    Every worker yields ``len(loader)`` batches per epoch and batch ``t`` has
    the same size on every worker, so per-step collectives always match.

    The position is a checkpoint: :meth:`state_dict` holds the epoch and the
    batches consumed in it, and a loader given that state by
    :meth:`load_state_dict` continues at the next batch, with the same data
    in the same order as the uninterrupted run. (Random transforms inside the
    dataset, and ``num_workers > 0`` worker seeds, are the dataset's business.)

    It reads like the ``torch.utils.data.DataLoader`` it wraps, so a ported
    script keeps its ``len(loader)``, ``len(loader.dataset)``,
    ``loader.batch_size``, ``loader.sampler.set_epoch(epoch)`` and
    ``loader.num_workers``.

    Attributes:
        dataset: The whole data set (every worker's share together), as
            ``DataLoader.dataset``.
        sampler: The :class:`~bunsan.data.Partition` (also ``partition``).
        dataloader: The wrapped ``torch.utils.data.DataLoader``.
        batch_size: Samples per batch on this worker.
        drop_last: Whether the remainder and the last partial batch are dropped.
        num_workers, collate_fn, pin_memory, timeout, worker_init_fn,
        prefetch_factor, persistent_workers, batch_sampler, generator:
            Those of the wrapped DataLoader.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        self.batch_size = _as_int("batch_size", batch_size, 1)
        for name in _RESERVED:
            if name in dataloader_kwargs:
                raise ValueError(
                    f"{name}={dataloader_kwargs[name]!r} cannot be passed to bunsan.data.loader's DataLoader: "
                    "the partition decides sampling and batching; use loader(batch_size=, shuffle=, drop_last=)"
                )
        sized = cast(Sized, dataset)  # map-style: Partition refuses a data set without a length
        self.partition = Partition(
            sized, rank=rank, world_size=world_size, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        if drop_last and self.partition.shard_size < self.batch_size:
            raise ValueError(
                f"batch_size={self.batch_size} is larger than this worker's shard of "
                f"{self.partition.shard_size} samples, so drop_last=True leaves no batch; "
                "use a smaller batch_size or drop_last=False"
            )
        self.drop_last = bool(drop_last)
        self.dataloader = DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self.partition,
            drop_last=self.drop_last,
            **dataloader_kwargs,
        )
        self._epoch = 0
        self._batches = 0  # consumed in self._epoch
        self._continue = True  # the next iteration continues self._epoch instead of starting a new one

    @property
    def dataset(self) -> Dataset:
        """The whole data set, as ``DataLoader.dataset`` (``len()`` counts every worker's samples)."""
        return self.dataloader.dataset

    @property
    def sampler(self) -> Partition:
        """This worker's :class:`~bunsan.data.Partition`, as ``DataLoader.sampler``."""
        return self.partition

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found normally: forward DataLoader's settings.
        # The guard keeps copy/pickle (which probe before __init__ ran) from recursing.
        if name in _FORWARDED and "dataloader" in self.__dict__:
            return getattr(self.__dict__["dataloader"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def epoch(self) -> int:
        """The epoch being iterated, or the next one if no iteration has begun."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch yielded so far."""
        return self._batches

    @property
    def seed(self) -> int:
        return self.partition.seed

    def __len__(self) -> int:
        """Batches per epoch on every worker."""
        size = self.partition.shard_size
        return size // self.batch_size if self.drop_last else -(-size // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration yield ``epoch`` from its first batch."""
        self._epoch, self._batches, self._continue = _as_int("epoch", epoch, 0), 0, True

    def __iter__(self) -> Iterator[Any]:
        # The bookkeeping happens here, eagerly, not inside the generator:
        # iter(loader) alone must already fix the epoch.
        # A new iteration after one that began starts the next epoch; so does
        # resuming from a state whose epoch was complete.
        if not self._continue or self._batches >= len(self):
            self._epoch, self._batches = self._epoch + 1, 0
        self._continue = False
        self.partition.set_epoch(self._epoch, start=self._batches * self.batch_size)
        return self._generate(iter(self.dataloader))

    def _generate(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._batches += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch", "batches", "seed"}`` (``batches`` consumed in ``epoch``)."""
        return {"epoch": self._epoch, "batches": self._batches, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``: the next iteration yields batch ``state["batches"]`` of ``state["epoch"]``.

        If that epoch was complete, the next iteration starts the following
        epoch. The seed must match this loader's: another seed is another order.
        """
        missing = {"epoch", "batches", "seed"} - set(state)
        if missing:
            raise ValueError(f"loader state lacks {sorted(missing)}; pass a dict from DistributedLoader.state_dict()")
        if state["seed"] != self.seed:
            raise ValueError(
                f"state seed={state['seed']} differs from this loader's seed={self.seed}; "
                f"build the loader with seed={state['seed']} to resume the same data order"
            )
        epoch = _as_int("state['epoch']", state["epoch"], 0)
        batches = _as_int("state['batches']", state["batches"], 0)
        if batches > len(self):
            raise ValueError(
                f"state['batches']={batches} exceeds the {len(self)} batches per epoch of this loader; "
                "was the state saved with another dataset, batch_size or world size?"
            )
        self._epoch, self._batches, self._continue = epoch, batches, True

    def __repr__(self) -> str:
        return f"DistributedLoader({self.partition!r}, batch_size={self.batch_size}, batches={len(self)})"


def loader(dataset: Dataset, batch_size: int, *args: Any, **kwargs: Any) -> DistributedLoader:
    """Batches of this worker's partition of ``dataset``, reshuffled each epoch.

    ``batch_size`` is per worker: the global minibatch is ``batch_size`` times
    the world size. With ``drop_last=False`` the last ``world_size``-remainder
    of the epoch is padded by repeating samples and the last batch may be
    partial (the same size on every worker); with ``drop_last=True`` the
    remainder and the last partial batch are dropped.

    Example::

        train = bunsan.data.loader(dataset, batch_size=64, shuffle=True, num_workers=2)
        for epoch in range(10):
            for x, y in train:  # epoch 0, 1, ...: advances each time iteration restarts
                ...

    The arguments are :class:`DistributedLoader`'s, in its order:

    Args:
        dataset: A map-style dataset (it has ``__len__`` and ``__getitem__``).
        batch_size: Samples per batch on this worker; must be >= 1.
        shuffle: Reshuffle every epoch from ``seed``.
        seed: Shuffle seed; must be the same on every worker.
        drop_last: Drop the remainder (see :func:`~bunsan.data.shard_indices`).
        rank: This worker; default the rank in the default process group.
        world_size: Number of workers; default the default group's size.
        **dataloader_kwargs: Passed to ``torch.utils.data.DataLoader``
            (``num_workers``, ``collate_fn``, ``pin_memory``, ...), except
            ``sampler``, ``batch_sampler``, ``shuffle``, ``batch_size`` and ``drop_last``.

    Returns:
        A :class:`DistributedLoader`; in an elastic job (``bunsan run --min-np``) a
        :class:`bunsan.elastic.ElasticLoader`, which takes ``shuffle``, ``seed``, ``drop_last`` and ``collate_fn``.
    """
    if _elastic_member.current() is not None:
        return cast(DistributedLoader, elastic.loader(dataset, batch_size, *args, **kwargs))
    return DistributedLoader(dataset, batch_size, *args, **kwargs)
