"""shard_indices, Partition and the loader, single process (ranks simulated by rank=)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from bunsan.data import Partition, epoch_order, loader, shard_indices, shard_size

SIZES = [(10, 1), (10, 2), (10, 3), (10, 4), (12, 4), (3, 4), (1, 4), (2, 5), (7, 7), (100, 8), (101, 8)]


def _shards(n, w, **kw):
    return [shard_indices(n, r, w, **kw).tolist() for r in range(w)]


@pytest.mark.parametrize(("n", "w"), SIZES)
@pytest.mark.parametrize("shuffle", [True, False])
def test_pad_covers_every_sample_with_declared_padding(n, w, shuffle):
    shards = _shards(n, w, epoch=3, seed=7, shuffle=shuffle, drop_last=False)
    size = -(-n // w)
    assert [len(s) for s in shards] == [size] * w == [shard_size(n, w)] * w
    counts = Counter(i for s in shards for i in s)
    assert set(counts) == set(range(n))  # every sample at least once
    padding = size * w - n
    assert sum(counts.values()) - n == padding
    assert max(counts.values()) - min(counts.values()) <= 1
    if n >= w - 1:  # then the padding repeats distinct samples: at most w - 1 of them twice
        assert sum(c == 2 for c in counts.values()) == padding <= w - 1
    # Dealt like cards: interleaving the shards gives the order, then its start again.
    order = epoch_order(n, epoch=3, seed=7, shuffle=shuffle).tolist()
    dealt = [shards[r][k] for k in range(size) for r in range(w)]
    assert dealt == (order * (-(-size * w // n)))[: size * w]


@pytest.mark.parametrize(("n", "w"), [(n, w) for n, w in SIZES if n >= w])
def test_drop_is_disjoint_and_drops_only_the_tail(n, w):
    shards = _shards(n, w, epoch=1, seed=0, drop_last=True)
    assert [len(s) for s in shards] == [n // w] * w == [shard_size(n, w, drop_last=True)] * w
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat))
    order = epoch_order(n, epoch=1, seed=0).tolist()
    assert set(flat) == set(order[: n - n % w])


def test_deterministic_for_seed_and_epoch_and_different_across_epochs():
    a = shard_indices(100, 1, 4, epoch=2, seed=5)
    assert torch.equal(a, shard_indices(100, 1, 4, epoch=2, seed=5))
    assert not torch.equal(a, shard_indices(100, 1, 4, epoch=3, seed=5))
    assert not torch.equal(a, shard_indices(100, 1, 4, epoch=2, seed=6))
    # Not seed + epoch: (0, 1) and (1, 0) are unrelated orders.
    assert not torch.equal(epoch_order(100, epoch=1, seed=0), epoch_order(100, epoch=0, seed=1))
    assert torch.equal(epoch_order(5, epoch=9, shuffle=False), torch.arange(5))
    assert a.dtype == torch.int64


def test_global_batch_equals_one_big_batch():
    # w workers x batch B see, at step t, exactly the samples of one process with batch w * B.
    n, w, batch = 48, 4, 3
    order = epoch_order(n, epoch=1, seed=2).tolist()
    shards = _shards(n, w, epoch=1, seed=2)
    for t in range(n // (w * batch)):
        step = {i for s in shards for i in s[t * batch : (t + 1) * batch]}
        assert step == set(order[t * w * batch : (t + 1) * w * batch])


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"num_samples": 10, "rank": 0, "world_size": 0}, "world_size"),
        ({"num_samples": 10, "rank": -1, "world_size": 2}, "rank"),
        ({"num_samples": 10, "rank": 2, "world_size": 2}, "rank"),
        ({"num_samples": -1, "rank": 0, "world_size": 2}, "num_samples"),
        ({"num_samples": 0, "rank": 0, "world_size": 2}, "num_samples"),
        ({"num_samples": 3, "rank": 0, "world_size": 4, "drop_last": True}, "drop_last"),
        ({"num_samples": 3, "rank": 0, "world_size": 1, "epoch": -1}, "epoch"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        shard_indices(**kwargs)


@pytest.mark.parametrize("rank", [True, 0.5, "0"])
def test_a_count_of_the_wrong_type_is_a_type_error(rank):
    with pytest.raises(TypeError, match="rank must be an int"):
        shard_indices(10, rank, 2)
    assert (
        shard_indices(10, np.int64(1), np.int32(2)).tolist() == shard_indices(10, 1, 2).tolist()
    )  # numpy ints are ints


def test_partition_is_a_sampler_over_the_shard():
    data = TensorDataset(torch.arange(10))
    parts = [Partition(data, rank=r, world_size=3, seed=4) for r in range(3)]
    assert [len(p) for p in parts] == [4, 4, 4]
    for p in parts:
        p.set_epoch(2)
    assert [list(p) for p in parts] == _shards(10, 3, epoch=2, seed=4)
    assert list(parts[0]) == list(parts[0])  # iterating again: the same epoch
    parts[0].set_epoch(2, start=3)
    assert len(parts[0]) == 1 and list(parts[0]) == _shards(10, 3, epoch=2, seed=4)[0][3:]
    with pytest.raises(ValueError, match="start"):
        parts[0].set_epoch(0, start=5)


def test_partition_defaults_to_one_worker_without_process_group():
    p = Partition(5, shuffle=False)
    assert (p.rank, p.world_size, list(p)) == (0, 1, [0, 1, 2, 3, 4])
    with pytest.raises(TypeError, match="dataset must be a sized dataset or an int"):
        Partition(object())


@pytest.mark.parametrize(("n", "w"), [(n, w) for n, w in SIZES if n >= w])
@pytest.mark.parametrize("drop_last", [False, True])
def test_without_shuffle_a_partition_yields_what_distributed_sampler_yields(n, w, drop_last):
    """Same arguments in the same order, same attributes, same shards (DistributedSampler's interface)."""
    data = TensorDataset(torch.arange(n))
    for rank in range(w):
        ours = Partition(data, w, rank, False, 0, drop_last)  # DistributedSampler's positional order
        theirs = DistributedSampler(data, w, rank, False, 0, drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
        for name in ("num_replicas", "rank", "num_samples", "total_size", "shuffle", "seed", "drop_last", "epoch"):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert ours.dataset is data and len(ours) == len(theirs)
        # As the sampler of a plain DataLoader: the same batches.
        assert [b.tolist() for (b,) in DataLoader(data, batch_size=3, sampler=ours)] == [
            b.tolist() for (b,) in DataLoader(data, batch_size=3, sampler=theirs)
        ]


def test_with_shuffle_the_shards_are_distributed_samplers_layout_of_another_permutation():
    ours = Partition(10, 3, 1, shuffle=True, seed=2)
    order = epoch_order(10, epoch=0, seed=2).tolist()
    assert list(ours) == (order + order[:2])[1::3]  # padded from the start, dealt like cards
    assert ours.dataset is None and ours.dataset_size == 10 and ours.num_samples == ours.shard_size == 4


def test_a_positional_call_in_the_old_rank_world_size_order_fails_loudly():
    # Partition(data, rank, world_size) was the order before issue 18; read as (num_replicas, rank)
    # every valid old pair has rank >= num_replicas, so it is refused instead of misread.
    with pytest.raises(ValueError, match="rank must be"):
        Partition(10, 1, 3)
    with pytest.raises(ValueError, match="world_size"):
        Partition(10, 0, 2)


def _epoch_batches(loaders):
    return [[b[0].tolist() for b in ld] for ld in loaders]


@pytest.mark.parametrize(
    ("n", "w", "batch", "drop_last"), [(23, 3, 4, False), (23, 3, 4, True), (24, 4, 3, False), (2, 4, 3, False)]
)
def test_loader_batches_match_across_ranks_and_cover(n, w, batch, drop_last):
    data = TensorDataset(torch.arange(n))
    loaders = [loader(data, batch, seed=1, drop_last=drop_last, rank=r, world_size=w) for r in range(w)]
    for epoch in range(2):
        per_rank = _epoch_batches(loaders)
        assert all(ld.epoch == epoch for ld in loaders)
        assert {len(b) for b in per_rank} == {len(loaders[0])}  # same batch count everywhere
        for t in range(len(loaders[0])):
            assert len({len(batches[t]) for batches in per_rank}) == 1  # same batch size at each step
        seen = [i for batches in per_rank for b in batches for i in b]
        assert sorted(seen) == sorted(
            i
            for r in range(w)
            for i in shard_indices(n, r, w, epoch=epoch, seed=1, drop_last=drop_last).tolist()[
                : len(loaders[0]) * batch
            ]
        )
        if not drop_last:
            assert set(seen) == set(range(n))


def test_loader_epoch_advances_on_each_new_iteration():
    ld = loader(TensorDataset(torch.arange(20)), 4, rank=0, world_size=2)
    assert len(ld) == 3 and ld.epoch == 0
    first = _epoch_batches([ld])[0]
    for _ in ld:  # a new iteration after a break also starts the next epoch
        break
    assert ld.epoch == 1
    assert _epoch_batches([ld])[0] != first and ld.epoch == 2
    ld.set_epoch(0)
    assert _epoch_batches([ld])[0] == first


@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_resumes_mid_epoch_with_the_same_order(drop_last):
    data = TensorDataset(torch.arange(37))
    make = lambda: loader(data, 4, seed=3, drop_last=drop_last, rank=1, world_size=2)  # noqa: E731
    reference = make()
    expected = _epoch_batches([reference])[0] + _epoch_batches([reference])[0] + _epoch_batches([reference])[0]
    per_epoch = len(reference)

    interrupted, got = make(), []
    _epoch_batches([interrupted])  # epoch 0
    for batch in interrupted:  # epoch 1, stopped after 2 batches: a checkpoint
        got.append(batch[0].tolist())
        if len(got) == 2:
            break
    state = interrupted.state_dict()
    assert state == {"epoch": 1, "batches": 2, "seed": 3}

    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    got += _epoch_batches([resumed])[0]  # the rest of epoch 1
    assert resumed.epoch == 1 and resumed.batches_consumed == per_epoch
    got += _epoch_batches([resumed])[0]  # epoch 2
    assert got == expected[per_epoch:]

    # A state saved at the end of an epoch resumes at the next epoch.
    at_end = make()
    at_end.load_state_dict({"epoch": 0, "batches": per_epoch, "seed": 3})
    assert _epoch_batches([at_end])[0] == expected[per_epoch : 2 * per_epoch] and at_end.epoch == 1


def test_loader_rejects_what_it_owns_and_foreign_states():
    data = TensorDataset(torch.arange(10))
    with pytest.raises(ValueError, match="sampler"):
        loader(data, 2, sampler=None)
    with pytest.raises(ValueError, match="batch_size"):
        loader(data, 0)
    with pytest.raises(ValueError, match="batch_size=6"):
        loader(data, 6, drop_last=True, rank=0, world_size=2)
    ld = loader(data, 2, seed=1)
    with pytest.raises(ValueError, match="seed=1"):
        ld.load_state_dict({"epoch": 0, "batches": 0, "seed": 2})
    with pytest.raises(ValueError, match="batches"):
        ld.load_state_dict({"epoch": 0, "batches": 99, "seed": 1})
