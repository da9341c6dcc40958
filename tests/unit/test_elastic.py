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
from bunsan.elastic.blocks import block_filter
from bunsan.launch.config import LaunchConfig, UsageError
from bunsan.launch.elastic import describe_exit, elastic_environment, replica_name
from bunsan.launch.plan import WorkerSpec


class FakeMember:
    """What ElasticLoader and ElasticOptimizer use of :class:`bunsan.elastic.Member`; the quorum is set by hand."""

    def __init__(self, start_size: int) -> None:
        self.start_size, self.min_size = start_size, 1
        self.states: dict = {}
        self.hooks: list = []
        self.drop_hooks: list = []
        self.members, self.index = start_size, 0
        self.share, self.in_step, self.epoch_source = 1.0, False, None
        self.step_samples, self.end_step, self.ok = 0, None, True

    def register(self, name, get, load):
        assert name not in self.states
        self.states[name] = (get, load)

    def unique_name(self, prefix):
        return next(f"{prefix}{n}" for n in itertools.count() if f"{prefix}{n}" not in self.states)

    def on_commit(self, hook):
        self.hooks.append(hook)

    def on_drop(self, hook):
        self.drop_hooks.append(hook)

    def on_flush(self, end_step):
        self.end_step = end_step

    def flush(self):
        if self.end_step is None or not self.in_step:
            return False
        self.end_step()
        return True

    def begin_step(self):
        self.in_step = True

    def size(self):
        return self.members

    def rank(self):
        return self.index

    def allgather(self, tensor):
        assert self.members == 1
        return [tensor.clone()]

    def allreduce_mean(self, tensors):
        assert self.members == 1  # one member: its own values are the mean

    def commit(self, ok: bool | None = None) -> bool:
        ok = self.ok if ok is None else ok
        self.in_step, self.step_samples = False, 0
        for hook in self.hooks if ok else self.drop_hooks:
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
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(NotImplementedError, match="1-bit Adam is not elastic yet"):
        bunsan.distribute(model, adam, bunsan.DataParallelSGD(bits=1))
    with pytest.raises(NotImplementedError, match="without a warm start"):
        bunsan.distribute(model, optimizer, bunsan.BlockMomentumSGD(block_size=8, warm_start=16))
    with pytest.raises(NotImplementedError, match="not elastic yet"):
        bunsan.distribute(model, optimizer, bunsan.DataParallelSGD(compression="fp16"))
    with pytest.raises(NotImplementedError, match="not elastic yet"):
        bunsan.distribute(model, optimizer, bunsan.DataParallelSGD(bits=1, warm_start=64))
    with pytest.raises(NotImplementedError, match="not elastic yet"):
        bunsan.distribute(model, optimizer, "auto")
    with pytest.raises(TypeError, match="name-built"):
        bunsan.distribute(model, optimizer, bunsan.DataParallelSGD(), bits=1)
    with pytest.raises(ValueError, match="not num_workers"):
        bunsan.data.loader(dataset(10), 2, num_workers=2)
    made = elastic.distribute(model, optimizer, bunsan.DataParallelSGD())
    assert made.param_groups is optimizer.param_groups and set(fake.states) == {"model0", "optimizer0"}
    _, quantized = bunsan.distribute(model, optimizer, "data_parallel", bits=1)
    assert isinstance(quantized, elastic.ElasticQuantizedOptimizer) and "quantized0" in fake.states
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


def test_a_blocks_batches_move_the_position_on_together_and_a_dropped_block_is_trained_again():
    member = FakeMember(2)
    loader = ElasticLoader(member, dataset(40), batch_size=5, shuffle=False)  # global batches of 10
    batches = iter(loader)
    first = [next(batches)[0].tolist() for _ in range(3)]  # a block of three steps: one quorum
    assert first == [list(range(0, 5)), list(range(10, 15)), list(range(20, 25))]
    assert member.step_samples == 30 and loader.cursor == 0
    member.commit(False)  # a member died: the block is dropped
    assert loader.cursor == 0 and member.step_samples == 0
    assert next(iter(loader))[0].tolist() == list(range(0, 5))  # the next quorum trains it again
    member.commit(True)
    assert loader.cursor == 10


def test_a_block_in_flight_ends_with_the_epoch():
    member = FakeMember(2)
    ended = []
    member.on_flush(lambda: ended.append(member.step_samples) or member.commit(True))
    loader = ElasticLoader(member, dataset(35), batch_size=5, shuffle=False)  # 3 full global batches, then 5
    seen = [x.tolist() for (x,) in loader]  # no step() ends the block: the epoch's end does
    assert seen[-1] == [30, 31, 32] and len(seen) == 4
    assert ended == [35] and (loader.epoch, loader.cursor) == (1, 0)


def test_the_block_filter_is_the_jobs_at_its_starting_size():
    bmuf = block_filter(bunsan.BlockMomentumSGD(block_size=64), workers=4)
    assert bmuf(64.0) == pytest.approx((0.75, 0.25 * 4 * 0.5))  # bm 1 - 1/4, block learning rate 1/sqrt(4)
    bm, gain = bmuf(32.0)  # half a block forgets half as much, in log scale
    assert bm == pytest.approx(0.75**0.5) and gain == pytest.approx((1 - 0.75**0.5) * 4 * 0.5)
    named = block_filter(bunsan.BlockMomentumSGD(block_size=64, block_momentum=0.9, block_learning_rate=1.0), 4)
    assert named(64.0) == pytest.approx((0.9, 0.1 * 4))
    assert block_filter(bunsan.ModelAveragingSGD(block_size=64), 4)(10.0) == (0.0, 1.0)


def test_a_block_optimizer_filters_a_committed_block_and_rolls_a_dropped_one_back(monkeypatch):
    member = FakeMember(2)
    member.members = 1  # one member left of a job started with 2: its change is the block's average
    monkeypatch.setattr(member_module, "_member", member)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    start = [p.detach().clone() for p in model.parameters()]
    _, optimizer = bunsan.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), bunsan.BlockMomentumSGD(block_size=4)
    )
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def local_step():
        member.begin_step()
        member.step_samples += 8  # what the loader counts: the global samples of a whole block
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    member.ok = False
    local_step()  # a full block (4 samples per worker at 2 workers), dropped
    for p, s in zip(model.parameters(), start, strict=True):
        assert torch.equal(p, s)
    assert not any(optimizer.optimizer.state.values())  # the momentum of the dropped block is gone too
    member.ok = True
    local_step()
    bm, gain = 0.5, (1 - 0.5) * 2 * 2**-0.5  # N = 2: bm 1/2, block learning rate 1/sqrt(2)
    for p, s, w in zip(model.parameters(), start, optimizer.global_model, strict=True):
        assert p.grad is not None
        local = s - 0.1 * p.grad  # the first SGD step: momentum buffer = gradient
        torch.testing.assert_close(w, s + gain * (local - s))
        torch.testing.assert_close(p.detach(), w + bm * gain * (local - s))  # Nesterov's look-ahead
    assert optimizer.blocks == 1 and not any(optimizer.optimizer.state.values())  # local momentum reset


def test_a_quantized_step_sends_the_momentum_with_its_residual_and_shows_the_gradient(monkeypatch):
    member = FakeMember(2)
    member.members = 1
    monkeypatch.setattr(member_module, "_member", member)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1)
    start = [p.detach().clone() for p in model.parameters()]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    _, optimizer = bunsan.distribute(model, sgd, bunsan.DataParallelSGD(bits=8))
    x, y = torch.randn(16, 64), torch.randn(16, 1)

    def step():
        member.begin_step()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # the exchange runs at the end of backward
        return [p.grad.clone() for p in model.parameters()]

    member.ok = False
    shown = step()
    optimizer.step()  # dropped: nothing moves, no residual or momentum is kept
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
    assert optimizer.residuals == {} and optimizer.job_momentum == {}
    member.ok = True
    shown = step()
    reference = torch.nn.Linear(64, 1)
    reference.load_state_dict(dict(zip(("weight", "bias"), start, strict=True)))
    torch.nn.functional.mse_loss(reference(x), y).backward()
    for seen, p in zip(shown, reference.parameters(), strict=True):  # the gradient, up to 8-bit rounding
        torch.testing.assert_close(seen, p.grad, rtol=0, atol=0.02 * float(p.grad.abs().max()))
    optimizer.step()
    sent = torch.cat([(p.grad + 0.01 * s).reshape(-1) for p, s in zip(reference.parameters(), start, strict=True)])
    kept = optimizer.residuals[-1]
    moved = torch.cat([(s - p.detach()).reshape(-1) / 0.1 for p, s in zip(model.parameters(), start, strict=True)])
    torch.testing.assert_close(moved + kept, sent, rtol=0, atol=1e-5)  # error feedback: nothing lost, delayed
    assert sgd.param_groups[0]["momentum"] == 0.9 and not any(sgd.state.values())  # momentum held, not used


def test_a_dropped_block_gives_adam_back_its_moments_and_step_count(monkeypatch):
    member = FakeMember(2)
    member.members = 1
    monkeypatch.setattr(member_module, "_member", member)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    unused = torch.nn.Linear(3, 1)  # a parameter no loss reaches: it has no gradient and no state
    params = [*model.parameters(), *unused.parameters()]
    _, optimizer = bunsan.distribute(model, torch.optim.Adam(params, lr=0.01), bunsan.ModelAveragingSGD(block_size=8))
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def local_step():
        member.begin_step()
        member.step_samples += 8
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    local_step()  # a half block: Adam has taken one local step
    kept = {k: v.clone() for k, v in optimizer.optimizer.state[model.weight].items()}
    weight = model.weight.detach().clone()
    member.ok = False
    local_step()  # the block ends and is dropped: back to its start, Adam's state as it was there
    assert torch.equal(model.weight, optimizer.start[0]) and not torch.equal(model.weight, weight)
    assert not optimizer.optimizer.state[model.weight] and unused.weight.grad is None
    member.ok = True
    local_step()
    local_step()  # trained again from the start: the same first step
    assert optimizer.blocks == 1
    assert float(optimizer.optimizer.state[model.weight]["step"]) == 2.0
    assert kept["step"] == 1.0
