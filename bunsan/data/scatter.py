"""Scatter a data set held by one rank to every rank (ChainerMN's ``scatter_dataset``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from bunsan.comm.objects import broadcast_object, group_rank, group_size, scatter_objects, scatter_tensor
from bunsan.data.partition import _as_int, shard_indices

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ListDataset", "scatter"]


class ListDataset(Dataset):
    """A map-style data set over a list of samples, as :func:`scatter` returns for non-tensor data."""

    def __init__(self, samples: Sequence[Any]) -> None:
        self.samples = list(samples)

    def __getitem__(self, index: int) -> Any:
        return self.samples[index]

    def __len__(self) -> int:
        return len(self.samples)


def _tensors_of(dataset: Any) -> tuple[Tensor, ...] | None:
    if isinstance(dataset, TensorDataset):
        return tuple(dataset.tensors)
    if isinstance(dataset, Tensor):
        return (dataset,)
    if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(t, Tensor) for t in dataset):
        return tuple(dataset)
    return None


def _describe(dataset: Any, root: int) -> dict[str, Any]:
    """The header ``root`` broadcasts: what is coming, or why nothing is."""
    if dataset is None:
        return {
            "error": f"dataset is None on root rank {root}; pass the data set on rank {root} "
            "(the other ranks may pass None)"
        }
    tensors = _tensors_of(dataset)
    if tensors is not None:
        lengths = {len(t) if t.dim() else -1 for t in tensors}
        if len(lengths) != 1 or -1 in lengths:
            shapes = [tuple(t.shape) for t in tensors]
            return {
                "error": f"the tensors on root rank {root} must share their first dimension, got shapes "
                f"{shapes}; pass (inputs, targets) with one row per sample"
            }
        num_samples = lengths.pop()
        specs = [(tuple(t.shape[1:]), t.dtype) for t in tensors]
        header: dict[str, Any] = {"kind": "tensors", "num_samples": num_samples, "specs": specs}
    elif hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        header = {"kind": "objects", "num_samples": len(dataset)}
    else:
        return {
            "error": f"dataset on root rank {root} is a {type(dataset).__name__} without __len__ and "
            "__getitem__; pass a map-style data set, a TensorDataset or a tuple of tensors"
        }
    if header["num_samples"] < 1:
        return {"error": f"dataset on root rank {root} is empty; there is nothing to scatter"}
    return header


def scatter(
    dataset: Any,
    root: int = 0,
    shuffle: bool = False,
    seed: int = 0,
    group: ProcessGroup | None = None,
) -> Dataset:
    """Split the data set held by rank ``root`` among the ranks of ``group``. Collective.

    Only ``root`` reads the data (from disk, say); each rank receives its part,
    chosen as in :func:`~bunsan.data.shard_indices` with epoch 0: the parts
    are disjoint except for padding, have the same length on every rank, and
    together cover the data set (``ceil(n / w) * w - n`` samples are sent
    twice when ``w`` does not divide ``n``). ``shuffle`` and ``seed`` are read
    on ``root`` only.

    Tensors (a ``TensorDataset``, one tensor, or a tuple of tensors with a
    common first dimension) travel as tensors with one scatter per tensor, and
    come back as a ``TensorDataset`` on the CPU. Any other map-style data set
    is pickled sample by sample and comes back as a :class:`ListDataset`.

    The result is already this rank's share: iterate it with a plain
    ``DataLoader`` or ``loader(part, batch_size, rank=0, world_size=1)``, not
    with a loader that would partition it again.

    Args:
        dataset: On ``root``, the data set; on other ranks ignored (pass ``None``).
        root: The rank, within ``group``, that holds the data set.
        shuffle: Deal out a permutation instead of the data set's order.
        seed: Seed of that permutation.
        group: Process group; ``None`` means the world.

    Returns:
        This rank's part.

    Raises:
        ValueError: On every rank, when ``root`` passed ``None``, an empty or
            unsized data set, or tensors of different lengths; or when ``root``
            is not a rank of the group.
    """
    size, rank = group_size(group), group_rank(group)
    root = _as_int("root", root, 0)
    seed = _as_int("seed", seed)
    if root >= size:
        raise ValueError(f"root must be a rank in [0, {size}) of the group, got {root}")
    header, payload, failure = None, None, None
    if rank == root:
        header, payload, failure = _prepare(dataset, root, size, shuffle, seed)
    # Root says what is coming before anything large moves, so that a bad
    # data set on root raises on every rank instead of leaving them waiting.
    header = broadcast_object(header, src=root, group=group)
    if "error" in header:
        raise ValueError(f"scatter: {header['error']}") from failure
    if header["kind"] == "tensors":
        part_size = -(-header["num_samples"] // size)
        received = []
        for index, (tail, dtype) in enumerate(header["specs"]):
            out = torch.empty((part_size, *tail), dtype=dtype)
            received.append(scatter_tensor(None if payload is None else payload[index], out, src=root, group=group))
        return TensorDataset(*received)
    return ListDataset(scatter_objects(payload, src=root, group=group))


def _prepare(
    dataset: Any, root: int, size: int, shuffle: bool, seed: int
) -> tuple[dict[str, Any], list[Any] | None, BaseException | None]:
    """On root: the header, every rank's part (per tensor, or per rank), and what went wrong."""
    header = _describe(dataset, root)
    if "error" in header:
        return header, None, None
    try:
        parts = [
            shard_indices(header["num_samples"], r, size, epoch=0, seed=seed, shuffle=shuffle) for r in range(size)
        ]
        if header["kind"] == "tensors":
            payload = []
            tensors = _tensors_of(dataset)
            assert tensors is not None  # the header's kind says so
            for tensor in tensors:
                source = tensor.detach().cpu()
                payload.append([source[part] for part in parts])
        else:
            payload = [[dataset[i] for i in part.tolist()] for part in parts]
    except Exception as error:
        message = f"reading the data set on root rank {root} failed: {type(error).__name__}: {error}"
        return {"error": message}, None, error
    return header, payload, None
