"""scatter, object collectives and the loader's defaults on 2 gloo ranks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import TensorDataset

from bunsan.comm.objects import broadcast_object, scatter_objects
from bunsan.data import ListDataset, loader, scatter


def _body_object_collectives(rank: int, world_size: int) -> tuple:
    got = broadcast_object({"from": rank} if rank == 1 else "ignored", src=1)
    part = scatter_objects([f"for {r}" for r in range(world_size)] if rank == 0 else None)
    return got, part


def _body_scatter_tensors(rank: int, world_size: int, n: int, root: int, shuffle: bool) -> tuple:
    dataset = None
    if rank == root:
        x = torch.arange(n, dtype=torch.float32).repeat_interleave(3).view(n, 3)
        dataset = TensorDataset(x, torch.arange(n), torch.arange(n) % 2 == 0)
    part = scatter(dataset, root=root, shuffle=shuffle, seed=5)
    assert isinstance(part, TensorDataset)
    x, y, even = part.tensors
    assert (x.dtype, y.dtype, even.dtype) == (torch.float32, torch.int64, torch.bool)
    assert torch.equal(x, y.float().unsqueeze(1).expand(-1, 3))  # rows stayed together
    assert torch.equal(even, y % 2 == 0)
    return y.tolist()


def _body_scatter_objects(rank: int, world_size: int) -> list:
    dataset = [{"id": i, "text": f"sample {i}"} for i in range(7)] if rank == 0 else None
    part = scatter(dataset)
    assert isinstance(part, ListDataset)
    return [sample["id"] for sample in part]


def _body_scatter_root_without_data(rank: int, world_size: int) -> str:
    # Rank 1 passes data, which is ignored; root passes None: every rank raises.
    with pytest.raises(ValueError, match="dataset is None on root rank 0") as error:
        scatter(None if rank == 0 else [1, 2, 3])
    with pytest.raises(ValueError, match="root must be a rank in"):
        scatter([1, 2], root=world_size)
    return str(error.value)


def _body_loader_defaults(rank: int, world_size: int) -> list:
    ld = loader(TensorDataset(torch.arange(11)), batch_size=2, seed=3)  # rank and size from the group
    assert (ld.partition.rank, ld.partition.world_size) == (rank, world_size)
    return [[i for batch in ld for i in batch[0].tolist()] for _ in range(2)]


def test_object_collectives(workers):
    assert workers.run(f"{__name__}:_body_object_collectives") == [({"from": 1}, "for 0"), ({"from": 1}, "for 1")]


@pytest.mark.parametrize(("n", "root", "shuffle"), [(10, 0, False), (11, 0, True), (11, 1, False), (1, 1, True)])
def test_scatter_tensors_disjoint_equal_and_covering(workers, n, root, shuffle):
    parts = workers.run(f"{__name__}:_body_scatter_tensors", n=n, root=root, shuffle=shuffle)
    size = -(-n // 2)
    assert [len(p) for p in parts] == [size, size]
    counts = Counter(parts[0] + parts[1])
    assert set(counts) == set(range(n))
    assert sum(counts.values()) - n == 2 * size - n  # only the declared padding repeats
    if not shuffle:
        assert parts[0] == list(range(0, n, 2))[:size]


def test_scatter_any_dataset_by_pickling(workers):
    parts = workers.run(f"{__name__}:_body_scatter_objects")
    assert parts == [[0, 2, 4, 6], [1, 3, 5, 0]]  # 7 samples on 2 ranks: sample 0 pads


def test_scatter_root_without_data_raises_everywhere(workers):
    messages = workers.run(f"{__name__}:_body_scatter_root_without_data")
    assert messages[0] == messages[1]


def test_loader_defaults_to_the_process_group(workers):
    epochs = workers.run(f"{__name__}:_body_loader_defaults")
    for epoch in range(2):
        assert len(epochs[0][epoch]) == len(epochs[1][epoch]) == 6
        assert set(epochs[0][epoch]) | set(epochs[1][epoch]) == set(range(11))
    assert epochs[0][0] != epochs[0][1]


class _Broken:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        raise KeyError(index)


def _body_scatter_broken_dataset(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="reading the data set on root rank 0 failed: KeyError"):
        scatter(_Broken() if rank == 0 else None)


def test_scatter_broken_dataset_raises_everywhere_instead_of_hanging(workers):
    workers.run(f"{__name__}:_body_scatter_broken_dataset")
