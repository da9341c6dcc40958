"""The training data of a :class:`bunsan.TrainingSession`: this rank's share of each epoch, cut into minibatches.

The session's data arguments (``train_data``, ``seed``, ``shuffle``, ``collate_fn``,
``dataloader_kwargs``) belong together here. The epoch's order is fixed by ``(seed,
epoch)`` (:class:`bunsan.data.Partition` with ``drop_last``: every rank gets the same
number of samples, none twice), and minibatches are cut from it on the fly, so that the
size may change inside an epoch and the position in the epoch is just a count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from typing import Any, cast

from torch.utils.data import DataLoader

from bunsan.data.partition import Partition
from bunsan.train.metrics import as_dataset, fetch

__all__ = ["TrainFeed"]


class TrainFeed:
    """This rank's minibatches of ``train_data``, epoch after epoch.

    Args:
        train_data: A map-style dataset of ``(inputs..., target)`` items, or a tuple of tensors ``(x, y)``.
        rank, world_size: This rank in the training group, and the group's size.
        seed: Seed of the data order; the same on every rank.
        shuffle: Reshuffle the training data every epoch.
        collate_fn: Turns a list of items into a batch; default torch's.
        dataloader_kwargs: When given, batches are read through a ``torch.utils.data.DataLoader``
            with these arguments, one per epoch; otherwise in this process.
    """

    def __init__(
        self,
        train_data: Any,
        rank: int,
        world_size: int,
        *,
        seed: int,
        shuffle: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        dataloader_kwargs: Mapping[str, Any] | None,
    ) -> None:
        self.dataset = as_dataset(train_data, "train_data")
        # drop_last: every worker gets the same number of samples, none twice.
        self.partition = Partition(
            len(cast(Sized, self.dataset)), rank=rank, world_size=world_size, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.seed = seed
        self.collate_fn = collate_fn
        self.dataloader_kwargs = dict(dataloader_kwargs) if dataloader_kwargs is not None else None

    @property
    def shard_size(self) -> int:
        """Samples of each epoch on this rank, the same on every rank."""
        return self.partition.shard_size

    def batches(self, epoch: int, position: int, plan: Sequence[int]) -> Iterator[Any]:
        """The minibatches of ``plan`` (local sizes), from sample ``position`` of this rank's shard of ``epoch``."""
        indices = self.partition.indices(epoch=epoch)  # this rank's shard, fixed by (seed, epoch)
        cuts, start = [], position
        for local in plan:
            cuts.append(indices[start : start + local])
            start += local
        if self.dataloader_kwargs is None:
            return (fetch(self.dataset, cut, self.collate_fn) for cut in cuts)
        kwargs = dict(self.dataloader_kwargs)
        if self.collate_fn is not None:
            kwargs.setdefault("collate_fn", self.collate_fn)
        return iter(DataLoader(self.dataset, batch_sampler=[cut.tolist() for cut in cuts], **kwargs))
