"""AsyncSGD on 2 gloo ranks: the server's update rule, no global barrier, clean ends, state.

Correctness by recomputation: every worker records the updates it pushed and the
models it pulled; rank 0's server records the arrival order; the final model and
every pulled model must equal the initial model plus the pushed updates applied
in that order, bit for bit.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

import bunsan
from bunsan.algorithms.async_sgd import AsyncSGD
from bunsan.comm import all_gather_object, barrier
from bunsan.errors import CommunicationError

BATCH = 4


def _flat(model: nn.Module) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach().clone()


def _data(rank: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 2, generator=g)) for _ in range(n_batches)]


def _build(algorithm: AsyncSGD, lr: float = 0.1) -> tuple[nn.Module, bunsan.DistributedOptimizer]:
    model = nn.Linear(4, 2)  # the pool seeds every body alike; distribute() broadcasts rank 0's anyway
    return bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=lr), algorithm)


def _step(model: nn.Module, optimizer: bunsan.DistributedOptimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()


def _server_model(algorithm: AsyncSGD) -> torch.Tensor:
    server = algorithm.server
    assert server is not None
    with server.cond:
        return torch.cat([v.clone() for v in server.layout.views(server.model)])


# -- the update rule ------------------------------------------------------------------
def _body_update_rule(rank: int, world_size: int, staleness_aware: bool, sync_steps: int, steps: int) -> dict:
    algorithm = AsyncSGD(sync_period=sync_steps * BATCH, staleness_aware=staleness_aware, timeout_s=20)
    model, optimizer = _build(algorithm)
    initial = _flat(model)
    pushed: list[torch.Tensor] = []  # this worker's updates, in push order
    pulled: list[torch.Tensor] = []  # the model it received for each push
    versions: list[int] = []  # the server's update count that model includes
    base = initial.clone()
    local = initial.clone()

    def record_local(*_: object) -> None:  # runs inside optimizer.step(), before a push
        nonlocal local
        local = _flat(model)

    optimizer.optimizer.register_step_post_hook(record_local)
    for i, (x, y) in enumerate(_data(rank, steps)):
        time.sleep(0.001 + 0.001 * (rank == 1 and i % 2))  # let the two workers' pushes interleave
        _step(model, optimizer, x, y)
        if algorithm.pushes > len(pushed):  # this step ended with a push and a pull
            pushed.append(local - base)
            base = _flat(model)
            pulled.append(base.clone())
            versions.append(algorithm.server_version)
    pushed.append(_flat(model) - base)  # join() pushes what is left
    optimizer.join()
    final = _flat(model)
    everyone = all_gather_object({"pushed": pushed, "pulled": pulled, "versions": versions, "final": final})
    if rank != 0:
        return {}

    # Recompute the server: W = W0 + sum of updates in arrival order, weighted by staleness if asked.
    arrivals = algorithm.arrivals
    pushes = steps // sync_steps + 1  # one per sync period, plus join's
    assert sorted((w, k) for w, k, _ in arrivals) == sorted(
        (w, k) for w in range(world_size) for k in range(1, pushes + 1)
    ), "every push is applied exactly once"
    states = [initial.clone()]  # states[v]: the model after v updates
    for v, (w, k, staleness) in enumerate(arrivals):
        # Staleness: updates applied since the model this one was computed from (its previous pull).
        pulled_version = everyone[w]["versions"][k - 2] if k > 1 else 0
        assert staleness == v - pulled_version, (w, k, staleness, v, pulled_version)
        scale = 1.0 / max(staleness, 1) if staleness_aware else 1.0
        model_at = states[-1].clone()
        if scale == 1.0:
            model_at.add_(everyone[w]["pushed"][k - 1])
        else:
            model_at.add_(everyone[w]["pushed"][k - 1], alpha=scale)
        states.append(model_at)
    for w in range(world_size):
        for k, (received, version) in enumerate(zip(everyone[w]["pulled"], everyone[w]["versions"]), start=1):
            # A reply is the model of the moment it is sent: this push and any applied since.
            assert version >= [a[:2] for a in arrivals].index((w, k)) + 1
            assert torch.equal(received, states[version]), f"pull {k} of rank {w} (version {version})"
    for w in range(world_size):
        assert torch.equal(everyone[w]["final"], model_at), f"rank {w} does not hold the server's final model"
    assert torch.equal(_server_model(algorithm), model_at)
    stats = algorithm.stats()
    assert stats["server_updates"] == len(arrivals) == world_size * pushes
    assert stats["server_samples"] == world_size * steps * BATCH
    return {"orders": [w for w, _, _ in arrivals], "max_staleness": stats["max_staleness"]}


@pytest.mark.parametrize(("staleness_aware", "sync_steps"), [(False, 1), (True, 1), (False, 3)])
def test_server_applies_every_update_in_arrival_order(workers, staleness_aware, sync_steps):
    result = workers.run(
        f"{__name__}:_body_update_rule", staleness_aware=staleness_aware, sync_steps=sync_steps, steps=13
    )[0]
    assert set(result["orders"]) == {0, 1}
    assert result["max_staleness"] > 0  # the workers' pushes did interleave


def _body_staleness_bound(rank: int, world_size: int, bound: int, steps: int) -> dict:
    algorithm = AsyncSGD(sync_period=BATCH, staleness_bound=bound, timeout_s=20)
    model, optimizer = _build(algorithm)
    for x, y in _data(rank, steps):
        if rank == 1:
            time.sleep(0.01)  # rank 1 is 5-10x slower: rank 0 runs into the bound
        _step(model, optimizer, x, y)
    optimizer.join()
    finals = all_gather_object(_flat(model))
    assert torch.equal(finals[0], finals[1])
    if rank != 0:
        return {}
    counts = {0: 0, 1: 0}
    for w, k, _ in algorithm.arrivals:
        other = 1 - w
        # push k + 1 is possible only after the reply to push k, which waited until
        # the other worker was at most `bound` pushes behind (or done).
        if k <= steps and counts[other] < steps + 1:
            assert counts[other] >= k - 1 - bound, (w, k, counts)
        counts[w] += 1
    return {"held_back": algorithm.stats()["held_back"]}


def test_staleness_bound_holds_the_fast_worker_back(workers):
    result = workers.run(f"{__name__}:_body_staleness_bound", bound=1, steps=10)[0]
    assert result["held_back"] > 0


# -- no global barrier ------------------------------------------------------------------
def _body_throughput(rank: int, world_size: int, step_s: float, slow_factor: float, phase_s: float) -> list[float]:
    """Steps/s of this rank in three phases: both fast, rank 0 slow, rank 1 slow."""
    rates = []
    x, y = _data(rank, 1)[0]
    for slow_rank in (None, 0, 1):
        algorithm = AsyncSGD(sync_period=BATCH, timeout_s=20)  # a push and a pull every step
        model, optimizer = _build(algorithm)
        sleep_s = step_s * (slow_factor if rank == slow_rank else 1.0)
        barrier()
        steps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < phase_s:
            _step(model, optimizer, x, y)
            time.sleep(sleep_s)  # the "compute" of this worker
            steps += 1
        rates.append(steps / elapsed)
        optimizer.join()
    return rates


def test_a_slow_worker_does_not_slow_the_other(workers):
    # A synchronous algorithm would run both ranks at the slow rank's pace (ratio ~ 1/5).
    rates = workers.run(f"{__name__}:_body_throughput", step_s=0.01, slow_factor=5.0, phase_s=0.7)
    (both_fast_0, slow0_0, slow1_0), (both_fast_1, slow0_1, slow1_1) = rates
    assert slow1_0 / both_fast_0 > 0.8, f"rank 0 with rank 1 slow: {slow1_0:.0f} vs {both_fast_0:.0f} steps/s"
    assert slow0_1 / both_fast_1 > 0.8, (
        f"rank 1 with rank 0 (the server's host) slow: {slow0_1:.0f} vs {both_fast_1:.0f} steps/s"
    )
    # ...and the slowed rank did slow down, so the claim above is not vacuous.
    assert slow0_0 / both_fast_0 < 0.5 and slow1_1 / both_fast_1 < 0.5


# -- clean ends -------------------------------------------------------------------------
def _body_uneven(rank: int, world_size: int, short_rank: int) -> dict:
    algorithm = AsyncSGD(sync_period=2 * BATCH, lr_warmup=16, timeout_s=20)
    model, optimizer = _build(algorithm)
    batches = _data(rank, 3 if rank == short_rank else 11)  # 11: the last sync period is partial
    for x, y in batches:
        _step(model, optimizer, x, y)
        time.sleep(0.002)
    optimizer.join()
    optimizer.join()  # a second join does nothing
    finals = all_gather_object(_flat(model))
    assert torch.equal(finals[0], finals[1]), "the replicas differ after join()"
    if rank == 0:
        assert torch.equal(_server_model(algorithm), finals[0]), "the replicas are not the server's model"
        stats = algorithm.stats()
        assert stats["server_samples"] == (3 + 11) * BATCH
    assert algorithm.samples == (3 + 11) * BATCH
    return algorithm.stats()


@pytest.mark.parametrize("short_rank", [0, 1])
def test_uneven_data_ends_cleanly_with_the_server_model(workers, short_rank):
    stats = workers.run(f"{__name__}:_body_uneven", short_rank=short_rank)
    assert stats[1]["bytes_sent"] > 0 and stats[0]["server_bytes_sent"] > 0
    assert stats[0]["bytes_sent"] == stats[0]["server_bytes_sent"]  # rank 0's own worker sends nothing


def _body_synchronize(rank: int, world_size: int) -> None:
    algorithm = AsyncSGD(sync_period=3 * BATCH, timeout_s=20)
    model, optimizer = _build(algorithm)
    for x, y in _data(rank, 4 + 3 * rank):
        _step(model, optimizer, x, y)
    optimizer.sync_replicas()
    models = all_gather_object(_flat(model))
    assert torch.equal(models[0], models[1])
    if rank == 0:
        assert torch.equal(_server_model(algorithm), models[0])
    barrier()  # rank 1's next push must not change the server's model before rank 0 looked
    for x, y in _data(rank, 2):  # training goes on after it
        _step(model, optimizer, x, y)
    optimizer.join()


def test_synchronize_gives_every_replica_the_server_model(workers):
    workers.run(f"{__name__}:_body_synchronize")


def _body_silent_worker(rank: int, world_size: int) -> str:
    algorithm = AsyncSGD(sync_period=BATCH, timeout_s=1.0)
    model, optimizer = _build(algorithm)
    x, y = _data(rank, 1)[0]
    if rank == 1:
        for _ in range(3):
            _step(model, optimizer, x, y)
        return "went silent"  # never pushes again, never joins: as a hung worker
    deadline = time.monotonic() + 15
    try:
        while time.monotonic() < deadline:
            _step(model, optimizer, x, y)
            time.sleep(0.01)
    except CommunicationError as e:
        return str(e)
    return "no error"


def test_a_silent_worker_is_reported(workers):
    message = workers.run(f"{__name__}:_body_silent_worker")[0]
    assert "worker rank 1" in message and "timed out" in message


# -- state ------------------------------------------------------------------------------
def _body_state_round_trip(rank: int, world_size: int) -> None:
    algorithm = AsyncSGD(sync_period=2 * BATCH, staleness_bound=3, timeout_s=20)
    model, optimizer = _build(algorithm)
    for x, y in _data(rank, 5):  # 5 steps: one partial sync period pending
        _step(model, optimizer, x, y)
    barrier()  # every push is answered: the server is quiet
    state = optimizer.state_dict()
    assert ("server" in state["algorithm"]) == (rank == 0)

    fresh = AsyncSGD(sync_period=2 * BATCH, staleness_bound=3, timeout_s=20)
    other, other_optimizer = _build(fresh)
    other.load_state_dict(model.state_dict())
    other_optimizer.load_state_dict(state)
    again = other_optimizer.state_dict()["algorithm"]
    for key, value in state["algorithm"].items():
        if key in ("base", "server"):
            continue
        assert again[key] == value, key
    for name, tensor in state["algorithm"]["base"].items():
        assert torch.equal(again["base"][name], tensor)
    if rank == 0:
        saved, loaded = state["algorithm"]["server"], again["server"]
        for name, tensor in saved["model"].items():
            assert torch.equal(loaded["model"][name], tensor)
        assert {k: v for k, v in loaded.items() if k != "model"} == {k: v for k, v in saved.items() if k != "model"}
    # Both instances finish cleanly: the original first, then the restored one.
    optimizer.join()
    for x, y in _data(rank, 3):
        _step(other, other_optimizer, x, y)
    other_optimizer.join()
    finals = all_gather_object(_flat(other))
    assert torch.equal(finals[0], finals[1])
    assert fresh.samples == (5 + 3) * BATCH * world_size  # the restored server went on counting


def test_state_round_trip(workers):
    workers.run(f"{__name__}:_body_state_round_trip")
