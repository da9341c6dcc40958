"""Batches for an elastic job: one global order per epoch, cut among the step's members, advanced only on commit.

Every member holds the same position, ``(epoch, cursor)``: the next global batch is samples
``order[cursor : cursor + G]`` of the epoch's permutation, ``G`` the per-worker ``batch_size`` times the job's
starting size (``-np``). At each step the members of the quorum cut that global batch into contiguous parts
(sizes differing by at most one, in quorum-rank order) and take theirs. The position moves on when the step
commits; a dropped step leaves it where it was, so the next quorum, whoever is in it, trains the same samples:
each sample of an epoch is used once whatever the membership did (docs/explanation/elastic.md). A worker
that joins receives the position from a live peer with the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from bunsan._validate import check_int
from bunsan.elastic.member import Member

__all__ = ["ElasticLoader", "part_bounds"]


def part_bounds(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``total`` items are cut into ``parts`` contiguous parts whose
    sizes differ by at most one, the larger first."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class ElasticLoader:
    """``bunsan.data.loader`` in an elastic job (module docstring). ``for batch in loader`` is one epoch.

    Attributes:
        dataset: the whole data set.
        batch_size: samples per worker at the job's starting size; a step with fewer members gives each more.
        global_batch: samples per step, whatever the membership.
        epoch, cursor: the position: the next global batch starts at sample ``cursor`` of epoch ``epoch``.
    """

    def __init__(
        self,
        member: Member,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Any = None,
        name: str | None = None,
    ) -> None:
        self.batch_size = int(check_int("batch_size", batch_size, minimum=1))
        self.dataset = dataset
        self.samples = len(cast(Sized, dataset))
        self.global_batch = self.batch_size * member.start_size
        if self.samples < self.global_batch and drop_last:
            raise ValueError(
                f"a global batch of {self.global_batch} ({batch_size} x {member.start_size} workers) is larger "
                f"than the {self.samples} samples, so drop_last=True leaves no batch"
            )
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.collate_fn = collate_fn or default_collate
        self.epoch, self.cursor = 0, 0
        self._member = member
        self._order: torch.Tensor | None = None
        self._order_epoch = -1
        self._pending = 0  # samples handed out since the last commit (a step's, or a block's batches)
        member.register(name or member.unique_name("loader"), self.state_dict, self.load_state_dict)
        member.on_commit(self._committed)
        member.on_drop(self._dropped)

    def __len__(self) -> int:
        """Steps per epoch."""
        full, tail = divmod(self.samples, self.global_batch)
        return full + (1 if tail and not self.drop_last else 0)

    def _batch_size_at(self, cursor: int) -> int:
        left = self.samples - cursor
        if left >= self.global_batch:
            return self.global_batch
        return 0 if self.drop_last else left

    def _committed(self) -> None:
        if not self._pending:
            return
        self.cursor += self._pending
        self._pending = 0
        if self._batch_size_at(self.cursor) == 0:  # the epoch is used up
            self.epoch, self.cursor = self.epoch + 1, 0

    def _dropped(self) -> None:
        self._pending = 0  # the next quorum trains the same samples again

    def order(self) -> torch.Tensor:
        """The permutation of epoch :attr:`epoch` (the same on every worker)."""
        if self._order_epoch != self.epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.samples, generator=generator)
            else:
                self._order = torch.arange(self.samples)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def __iter__(self) -> Iterator[Any]:
        epoch: int | None = None
        while True:
            if epoch is not None and self.epoch != epoch:
                return  # the last step of the epoch committed
            self._member.begin_step()  # a joiner's position arrives here; inside a block, the block's quorum
            epoch = self.epoch if epoch is None else epoch
            if self.epoch != epoch:
                return
            members, rank = self._member.size(), self._member.rank()
            size = self._batch_size_at(self.cursor + self._pending)
            if size < members:  # nothing left for every member: the epoch ends (drop_last's rule)
                if self._pending and self._member.flush():
                    continue  # a block in flight ended with the epoch: committed, or dropped and done again
                self.epoch, self.cursor, self._pending = self.epoch + 1, 0, 0
                return
            start, stop = part_bounds(size, members, rank)
            first = self.cursor + self._pending
            indices = self.order()[first + start : first + stop]
            self._member.share = (stop - start) * members / size
            self._pending += size
            self._member.step_samples += size
            yield self._fetch(indices)

    def _fetch(self, indices: torch.Tensor) -> Any:
        if isinstance(self.dataset, TensorDataset) and self.collate_fn is default_collate:
            return [t[indices] for t in self.dataset.tensors]
        return self.collate_fn([self.dataset[int(i)] for i in indices])

    def state_dict(self) -> dict[str, int]:
        """The position (committed steps only)."""
        return {"epoch": self.epoch, "cursor": self.cursor, "samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state``'s position; the data set must have as many samples as the one it came from."""
        if int(state["samples"]) != self.samples:
            raise ValueError(f"the position is for {state['samples']} samples, this data set has {self.samples}")
        self.epoch, self.cursor, self._pending = int(state["epoch"]), int(state["cursor"]), 0
