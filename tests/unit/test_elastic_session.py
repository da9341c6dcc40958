"""A TrainingSession in an elastic job, in one process: the feed's arithmetic, and the session's steps driven by a
stand-in for torchft's quorum (:class:`Quorum`: one member whose steps commit or drop as told, and that may hand
it a peer's state at a quorum). The multi-process jobs with the real torchft are tests/launch/test_elastic_session.py.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import bunsan
from bunsan.elastic import member as member_module
from bunsan.train import TrainingSession, classification_error, schedule
from bunsan.train.elastic_feed import ElasticFeed, member_part
from bunsan.train.feed import TrainFeed
from bunsan.train.schedules import plan_minibatches

SAMPLES = 90


class Quorum:
    """What a session uses of :class:`bunsan.elastic.Member`, for a quorum of one: the tries in ``drops`` are
    dropped; ``heal`` maps a try to the peer state loaded at its quorum (as torchft's heal does)."""

    start_size = min_size = 1

    def __init__(self, drops: tuple[int, ...] = (), heal: dict | None = None, members: int = 1, rank: int = 0) -> None:
        self.members, self.index = members, rank
        self.states: dict = {}
        self.drops, self.heal = set(drops), dict(heal or {})
        self.tries, self.in_step, self.share, self.epoch_source = 0, False, 1.0, None
        self.snapshots: list[dict] = []  # the registered state at each quorum, as a peer would send it

    def register(self, name, get, load):
        assert name not in self.states
        self.states[name] = (get, load)

    def unique_name(self, prefix):
        return next(f"{prefix}{n}" for n in itertools.count() if f"{prefix}{n}" not in self.states)

    def on_commit(self, hook):
        pass

    def begin_step(self):
        if self.in_step:
            return
        self.in_step, self.share = True, 1.0
        if self.tries in self.heal:
            for name, (_, load) in self.states.items():
                load(copy.deepcopy(self.heal[self.tries][name]))
        self.snapshots.append(copy.deepcopy({name: get() for name, (get, _) in self.states.items()}))

    def size(self):
        return self.members

    def rank(self):
        return self.index

    def allreduce_mean(self, tensors):
        pass

    def allreduce_sum(self, tensors):
        pass

    def commit(self):
        self.in_step, self.tries = False, self.tries + 1
        return self.tries not in self.drops


def data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def elastic_session(monkeypatch, quorum: Quorum, **options) -> TrainingSession:
    monkeypatch.setattr(member_module, "_member", quorum)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    session = TrainingSession(
        model,
        F.cross_entropy,
        torch.optim.SGD(model.parameters(), lr=0.0),
        None,
        data(SAMPLES, 1),
        minibatch_size=schedule([16, 25], epoch_size=SAMPLES),
        max_epochs=2,
        metrics={"error": classification_error},
        learning_rate_per_sample=schedule([0.01, 0.005], epoch_size=60),
        momentum_time_constant=50,
        progress=False,
        **options,
    )
    assert session.elastic is not None and (session.rank, session.world_size) == (0, 1)
    return session


def outcome(session: TrainingSession, summary) -> tuple:
    params = [p.detach().clone() for p in session.model.parameters()]
    return params, summary.samples, summary.steps, [(e.loss, e.metrics) for e in summary.epochs]


def same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)) and a[1:] == b[1:]


@pytest.mark.parametrize("size, members", list(itertools.product([1, 2, 7, 20, 25], [1, 2, 3, 5])))
def test_each_member_takes_its_part_and_the_shares_make_the_global_mean(size, members):
    values = torch.randn(size, dtype=torch.float64)
    parts = [member_part(size, members, rank) for rank in range(members)]
    assert [i for start, stop, _ in parts for i in range(start, stop)] == list(range(size))
    weighted = [share * values[start:stop].mean() if stop > start else 0.0 for start, stop, share in parts]
    assert float(sum(weighted)) / members == pytest.approx(float(values.mean()), rel=1e-12, abs=1e-12)
    assert all(share == 0 for start, stop, share in parts if stop == start)  # fewer samples than members


def test_the_global_minibatches_are_one_processs_order_from_any_position():
    dataset = data(SAMPLES, 1)
    feed = ElasticFeed(Quorum(), dataset, 3, True, None)
    alone = TrainFeed(dataset, 0, 1, seed=3, shuffle=True, collate_fn=None, dataloader_kwargs=None)
    sizes = schedule([16, 25], epoch_size=SAMPLES)
    for epoch, position in ((0, 0), (1, 0), (1, 50)):
        plan = plan_minibatches(feed.shard_size, position, epoch * SAMPLES + position, sizes, 1)
        cut = list(feed.batches(epoch, position, plan))
        assert [len(c) for c in cut] == plan and sum(plan) == SAMPLES - position
        assert torch.equal(torch.cat(cut), alone.partition.indices(epoch=epoch)[position:])


def test_a_dropped_step_changes_nothing_and_is_trained_again(monkeypatch):
    straight = elastic_session(monkeypatch, Quorum())
    expected = outcome(straight, straight.train())
    dropped = elastic_session(monkeypatch, Quorum(drops=(3, 4, 9)))
    summary = dropped.train()
    assert same(outcome(dropped, summary), expected)
    assert summary.stats == {"dropped_steps": 3.0} and summary.samples == 2 * SAMPLES


def test_a_worker_that_receives_a_peers_later_state_plans_again_from_it(monkeypatch):
    peer = Quorum()
    straight = elastic_session(monkeypatch, peer)
    expected = outcome(straight, straight.train())
    # Try 5 is dropped here but committed by the peer: the next quorum hands over the peer's state after it.
    behind = elastic_session(monkeypatch, Quorum(drops=(5,), heal={5: peer.snapshots[5]}))
    assert same(outcome(behind, behind.train()), expected)
    # A late joiner receives the state at its first quorum, mid-epoch, with the learning-rate schedule's
    # position and the partial sums of the epoch.
    joiner = elastic_session(monkeypatch, Quorum(heal={0: peer.snapshots[7]}))
    summary = joiner.train()
    assert same(outcome(joiner, summary), expected)
    assert summary.steps == straight.steps and joiner.learning_rate_per_sample == straight.learning_rate_per_sample


def test_a_member_whose_part_is_empty_sends_zeros_and_counts_the_step(monkeypatch):
    """A global minibatch of 2 on 3 members: the third trains nothing, takes part in both exchanges, commits."""
    quorum = Quorum(members=3, rank=2)
    session = elastic_session(monkeypatch, quorum, max_samples=6)
    session.minibatch_schedule = schedule(2)
    before = [p.detach().clone() for p in session.model.parameters()]
    summary = session.train()
    assert (summary.samples, summary.steps, quorum.tries) == (6, 3, 3)
    assert all(torch.equal(a, b) for a, b in zip(before, session.model.parameters(), strict=True))  # zeros sent
    assert all(p.grad is not None and not p.grad.any() for p in session.model.parameters())


def test_a_session_takes_an_algorithm_by_name_and_refuses_a_block_algorithm_in_an_elastic_job(monkeypatch):
    from bunsan.train import elastic_feed

    quorum = Quorum()
    monkeypatch.setattr(member_module, "_member", quorum)
    model = torch.nn.Linear(2, 2)
    made = elastic_feed.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), "data_parallel", quorum)
    assert isinstance(made, elastic_feed.ElasticSessionOptimizer)
    with pytest.raises(NotImplementedError, match="not in a session yet"):
        elastic_feed.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1), bunsan.BlockMomentumSGD(block_size=8), quorum
        )
