"""Issue 67: the pure parts of elastic training, with a stand-in for torchft's quorum.

The loaders of several members are driven in one process by :class:`Quorum`, which plays what torchft
decides for each step (who is in, whether the step commits); the multi-process jobs with the real torchft
are tests/launch/test_elastic.py.
"""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from torch.utils.data import TensorDataset

import bunsan
from bunsan import elastic
from bunsan.elastic import ElasticLoader, part_bounds
from bunsan.elastic import member as member_module
from bunsan.launch.config import LaunchConfig, UsageError
from bunsan.launch.elastic import describe_exit, elastic_environment, replica_name
from bunsan.launch.plan import WorkerSpec


class FakeMember:
    """What ElasticLoader and ElasticOptimizer use of :class:`bunsan.elastic.Member`; the quorum is set by hand."""

    def __init__(self, start_size: int) -> None:
        self.start_size, self.min_size = start_size, 1
        self.states: dict = {}
        self.hooks: list = []
        self.members, self.index = start_size, 0
        self.share, self.in_step, self.epoch_source = 1.0, False, None

    def register(self, name, get, load):
        assert name not in self.states
        self.states[name] = (get, load)

    def unique_name(self, prefix):
        return next(f"{prefix}{n}" for n in itertools.count() if f"{prefix}{n}" not in self.states)

    def on_commit(self, hook):
        self.hooks.append(hook)

    def begin_step(self):
        self.in_step = True

    def size(self):
        return self.members

    def rank(self):
        return self.index

    def commit(self, ok: bool = True) -> bool:
        self.in_step = False
        if ok:
            for hook in self.hooks:
                hook()
        return ok


def dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def step(loaders, iterators, members: list[int], commit: bool = True) -> list[list[int]]:
    """One step of the quorum ``members`` (indices into ``loaders``): each takes its part, then all commit or not."""
    taken = []
    for rank, i in enumerate(members):
        loaders[i]._member.members, loaders[i]._member.index = len(members), rank
        taken.append(next(iterators[i])[0].tolist())
    for i in members:
        loaders[i]._member.commit(commit)
    return taken


def flat(parts: list[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(parts))


def test_part_bounds_cut_contiguous_parts_that_differ_by_one_at_most():
    for total, parts in itertools.product(range(0, 30), range(1, 7)):
        bounds = [part_bounds(total, parts, i) for i in range(parts)]
        assert bounds[0][0] == 0 and bounds[-1][1] == total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        sizes = [stop - start for start, stop in bounds]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_a_dropped_step_is_trained_again_and_a_lost_member_loses_no_sample():
    loaders = [ElasticLoader(FakeMember(3), dataset(60), batch_size=4, seed=7) for _ in range(3)]
    iterators = [iter(loader) for loader in loaders]
    seen: collections.Counter[int] = collections.Counter()
    for _ in range(2):
        for part in step(loaders, iterators, [0, 1, 2]):
            seen.update(part)
    dropped = step(loaders, iterators, [0, 1, 2], commit=False)  # member 1 died in the exchange
    again = step(loaders, iterators, [0, 2])
    assert sorted(flat(dropped)) == sorted(flat(again))  # the same 12 samples, cut in two
    assert [len(p) for p in again] == [6, 6]
    seen.update(flat(again))
    while loaders[0].epoch == 0:
        for part in step(loaders, iterators, [0, 2]):
            seen.update(part)
    assert sorted(seen) == list(range(60)) and set(seen.values()) == {1}
    assert loaders[0].state_dict() == loaders[2].state_dict() == {"epoch": 1, "cursor": 0, "samples": 60}


def test_the_shares_weight_an_uneven_cut_to_the_global_batch_mean():
    loaders = [ElasticLoader(FakeMember(2), dataset(50), batch_size=5) for _ in range(3)]
    iterators = [iter(loader) for loader in loaders]
    parts = step(loaders, iterators, [0, 1, 2])
    assert [len(p) for p in parts] == [4, 3, 3]
    shares = [loader._member.share for loader in loaders]
    assert shares == pytest.approx([4 * 3 / 10, 3 * 3 / 10, 3 * 3 / 10])
    assert sum(shares) / 3 == pytest.approx(1.0)  # the members' mean of share x part-mean = the global mean


@pytest.mark.parametrize("drop_last, steps", [(False, 4), (True, 3)])
def test_the_last_partial_global_batch_follows_drop_last(drop_last, steps):
    loaders = [ElasticLoader(FakeMember(2), dataset(70), batch_size=10, drop_last=drop_last) for _ in range(2)]
    assert len(loaders[0]) == steps
    iterators = [iter(loader) for loader in loaders]
    sizes = []
    while loaders[0].epoch == 0:
        sizes.append(sum(len(p) for p in step(loaders, iterators, [0, 1])))
    assert sizes == [20, 20, 20, 10][:steps]
    with pytest.raises(StopIteration):
        next(iterators[0])


def test_a_joiner_continues_at_the_peers_position_and_epoch():
    old, new = ElasticLoader(FakeMember(2), dataset(40), 5), ElasticLoader(FakeMember(2), dataset(40), 5)
    for _ in range(6):
        batch = next(iter(old), None)  # a fresh iteration continues the epoch, or starts the next one
        assert batch is not None
        old._member.commit()
    assert old.state_dict() == {"epoch": 1, "cursor": 20, "samples": 40}
    new.load_state_dict(old.state_dict())
    assert (new.epoch, new.cursor) == (1, 20)
    assert torch.equal(new.order(), old.order())
    with pytest.raises(ValueError, match="position is for 40 samples"):
        ElasticLoader(FakeMember(2), dataset(30), 5).load_state_dict(old.state_dict())


def test_a_global_batch_larger_than_the_data_with_drop_last_is_refused():
    with pytest.raises(ValueError, match="global batch of 40"):
        ElasticLoader(FakeMember(4), dataset(30), batch_size=10, drop_last=True)


def test_outside_an_elastic_job_epochs_is_range_and_register_does_nothing():
    assert list(bunsan.epochs(3)) == [0, 1, 2]
    elastic.register("scheduler", object())  # no member: nothing to hand over
    assert not elastic.requested() or member_module.current() is None


def test_an_elastic_job_refuses_what_it_cannot_do_yet(monkeypatch):
    fake = FakeMember(2)
    monkeypatch.setattr(member_module, "_member", fake)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="not elastic yet"):
        elastic.distribute(model, optimizer, bunsan.DataParallelSGD(bits=1))
    with pytest.raises(NotImplementedError, match="not elastic yet"):
        elastic.distribute(model, optimizer, "block_momentum")
    with pytest.raises(NotImplementedError, match="not elastic yet"):
        elastic.distribute(model, optimizer, bunsan.DataParallelSGD(compression="fp16"))
    with pytest.raises(NotImplementedError, match=r"with \{'bits': 1\}"):
        elastic.distribute(model, optimizer, "data_parallel", bits=1)
    with pytest.raises(ValueError, match="not num_workers"):
        bunsan.data.loader(dataset(10), 2, num_workers=2)
    made = elastic.distribute(model, optimizer, bunsan.DataParallelSGD())
    assert made.param_groups is optimizer.param_groups and set(fake.states) == {"model0", "optimizer0"}
    assert isinstance(bunsan.data.loader(dataset(10), 2, False), ElasticLoader)


def test_the_launcher_gives_each_start_of_a_slot_its_own_name_and_no_fixed_group():
    spec = WorkerSpec(1, 1, "localhost", ("python", "t.py"), {"BUNSAN_JOB_ID": "j1", "MASTER_PORT": "5", "X": "y"})
    env = elastic_environment(spec, "http://127.0.0.1:9", 4, 2, 3, "/tmp/d").env
    assert "MASTER_PORT" not in env and env["X"] == "y"
    assert env["BUNSAN_ELASTIC_REPLICA"] == replica_name("j1", 1, 3) == "j1-1-3"
    assert (env["BUNSAN_ELASTIC_NP"], env["BUNSAN_ELASTIC_MIN_NP"], env["BUNSAN_RESTART"]) == ("4", "2", "3")
    assert describe_exit(2, -9) == "rank 2 was killed by SIGKILL (exit code 137)"
    assert describe_exit(0, 3) == "rank 0 exited with code 3"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"nproc": 2, "min_np": 3}, "between 1 and -np"),
        ({"nproc": 2, "min_np": 0}, "between 1 and -np"),
        ({"min_np": 1}, "needs -np"),
        ({"nproc": 2, "max_np": 3}, "--max-np is for elastic jobs and needs --min-np"),
        ({"nproc": 2, "host_discovery_script": "d.sh"}, "--host-discovery-script is for elastic jobs"),
        ({"nproc": 2, "min_np": 1, "max_np": 1}, r"--max-np must be >= -np \(2\), got 1"),
        ({"nproc": 2, "min_np": 1, "max_np": 3}, "--max-np 3 needs slots to grow onto"),
        ({"nproc": 2, "min_np": 1, "hosts": "a:2", "host_discovery_script": "d.sh"}, "both given"),
        ({"nproc": 2, "min_np": 1, "host_discovery_script": " "}, "is empty"),
    ],
)
def test_min_np_is_checked(options, message):
    with pytest.raises(UsageError, match=message):
        LaunchConfig(command=("t.py",), **options)
