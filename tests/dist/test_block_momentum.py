"""BlockMomentumSGD and ModelAveragingSGD on 2 gloo ranks.

Correctness by equivalence: every run is compared, inside the worker body, with a
single-process simulation of DESIGN.md's equations fed with both ranks' data.
"""

from __future__ import annotations

import copy
import io
import json
import time
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import bunsan
from bunsan.algorithms.block_momentum import BlockMomentumSGD
from bunsan.algorithms.data_parallel import DataParallelSGD
from bunsan.algorithms.model_averaging import ModelAveragingSGD
from bunsan.optim import DistributedOptimizer

Batch = tuple[torch.Tensor, torch.Tensor]


def _data(rank: int, n_batches: int, batch: int, features: int = 4) -> list[Batch]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(batch, features, generator=g), torch.randn(batch, 2, generator=g)) for _ in range(n_batches)]


def _flat(model: nn.Module) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach().clone()


def _make(kind: str, options: dict) -> bunsan.Algorithm:
    return {"bm": BlockMomentumSGD, "ma": ModelAveragingSGD, "dp": DataParallelSGD}[kind](**options)


def _coefficients(
    kind: str, options: dict, world_size: int
) -> tuple[Callable[[float], tuple[float, float]], float, bool]:
    """The filter of DESIGN.md for the reference: (bm_s, zeta_s) per block, the look-ahead bm, Nesterov."""
    if kind == "ma":
        return (lambda s: (0.0, 1.0)), 0.0, False
    bm = options.get("block_momentum")
    bm = 1 - 1 / world_size if bm is None else bm
    blr, block_size = options.get("block_learning_rate", world_size**-0.5), options["block_size"]  # 1/sqrt(N)

    def coefficients(samples_per_worker: float) -> tuple[float, float]:
        bm_s = bm ** (samples_per_worker / block_size)  # the momentum held as a time constant
        return bm_s, (1 - bm_s) * world_size * blr

    return coefficients, bm, options.get("nesterov", True)


def _simulate(
    init: nn.Module, batches: list[list[Batch]], *, kind: str, options: dict, lr: float, momentum: float
) -> torch.Tensor:
    """One process plays every worker: exact SGD during the warm start, then DESIGN.md's blocks."""
    n = len(batches)
    coefficients, lookahead, nesterov = _coefficients(kind, options, n)
    block_size, warm_start = options["block_size"], options.get("warm_start", 0)
    reset = kind == "bm" and options.get("reset_local_momentum", True)
    pos = [0] * n
    shared = copy.deepcopy(init)
    shared_opt = torch.optim.SGD(shared.parameters(), lr=lr, momentum=momentum)
    samples = 0
    # 1. Warm start: one model; the gradient is the mean over the workers that still have data.
    while samples < warm_start:
        active = [i for i in range(n) if pos[i] < len(batches[i])]
        if not active:
            return _flat(shared)
        grads = []
        for i in active:
            x, y = batches[i][pos[i]]
            pos[i] += 1
            samples += len(x)
            shared.zero_grad()
            F.mse_loss(shared(x), y).backward()
            grads.append([p.grad.clone() for p in shared.parameters()])
        for k, p in enumerate(shared.parameters()):
            total = sum(g[k] / n for g in grads)
            p.grad = total * (n / len(active)) if len(active) != n else total
        shared_opt.step()
    # 2. Blocks: G = mean_i(w_i) - W_start over the workers that trained; D = bm D + zeta G; W = W + D.
    w = _flat(shared)
    d = torch.zeros_like(w)
    start = w.clone()
    workers = [copy.deepcopy(shared) for _ in range(n)]
    opts = []
    for m in workers:
        opts.append(torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum))
        opts[-1].load_state_dict(copy.deepcopy(shared_opt.state_dict()))
    while any(pos[i] < len(batches[i]) for i in range(n)):
        changes, total = [], 0
        for i in range(n):
            s = steps = 0
            while pos[i] < len(batches[i]) and s < block_size:
                x, y = batches[i][pos[i]]
                pos[i] += 1
                opts[i].zero_grad()
                F.mse_loss(workers[i](x), y).backward()
                opts[i].step()
                s, steps = s + len(x), steps + 1
            if steps:
                changes.append(_flat(workers[i]) - start)
                total += s
        bm, zeta = coefficients(total / len(changes))
        d = bm * d + zeta * torch.stack(changes).mean(0)
        w = w + d
        start = w + lookahead * d if nesterov else w.clone()
        for m, o in zip(workers, opts):
            vector_to_parameters(start.clone(), m.parameters())  # it re-points .data at the vector: one copy each
            if reset:
                o.state.clear()  # SGD's only state is its momentum buffer
    return start


def _body_train(rank, world_size, kind, options, n_batches, batch=4, lr=0.1, momentum=0.0, features=4):
    """Train on this rank's share (n_batches[rank] batches), join, compare with the simulation."""
    model = nn.Linear(features, 2)
    init = copy.deepcopy(model)
    algorithm = _make(kind, options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = bunsan.distribute(
            model, torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum), algorithm
        )
        data = [_data(r, n_batches[r], batch, features) for r in range(world_size)]
        t0 = time.perf_counter()
        for x, y in data[rank]:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
        stats = algorithm.stats()  # before join: the training's own traffic
        optimizer.join()
        elapsed = time.perf_counter() - t0
    final = _flat(model)
    diff = None
    if kind != "dp":
        reference = _simulate(init, data, kind=kind, options=options, lr=lr, momentum=momentum)
        diff = (final - reference).abs().max().item()
    return {
        "params": final.tolist(),
        "diff": diff,
        "stats": stats,
        "elapsed": elapsed,
        "warnings": [str(w.message) for w in caught],
    }


def _assert_equal_replicas_matching_reference(results, atol=1e-6):
    assert results[0]["params"] == results[1]["params"]  # bit-identical replicas
    for r in results:
        assert r["diff"] <= atol, r["diff"]


# -- equivalence with the equations -----------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "options", "momentum"),
    [
        ("bm", {"block_size": 8}, 0.9),  # defaults: Nesterov, bm = 1 - 1/N, local momentum reset
        ("bm", {"block_size": 8, "block_momentum": 0.7, "block_learning_rate": 0.8, "nesterov": False}, 0.0),
        ("bm", {"block_size": 12, "block_momentum": 0.9, "reset_local_momentum": False}, 0.9),
        ("bm", {"block_size": 8, "block_momentum": 0.6, "nesterov": False, "reset_local_momentum": False}, 0.5),
        ("ma", {"block_size": 12}, 0.5),
    ],
    ids=["nesterov-defaults", "classic", "nesterov-keep-momentum", "classic-keep-momentum", "model-averaging"],
)
def test_matches_single_process_equations(workers, kind, options, momentum):
    # 7 minibatches of 4: full blocks, then a partial one that join() finishes
    results = workers.run(f"{__name__}:_body_train", kind=kind, options=options, n_batches=[7, 7], momentum=momentum)
    _assert_equal_replicas_matching_reference(results)


def test_block_not_multiple_of_minibatch_warns_once_and_scales_momentum(workers):
    # block_size 10 with minibatches of 4: blocks of 12 samples, bm ** (12 / 10)
    options = {"block_size": 10, "block_momentum": 0.8}
    results = workers.run(f"{__name__}:_body_train", kind="bm", options=options, n_batches=[8, 8])
    _assert_equal_replicas_matching_reference(results)
    for r in results:
        assert len(r["warnings"]) == 1
        assert "block_size=10 is not a multiple of this worker's minibatch of 4 samples" in r["warnings"][0]
        assert "block_size=12" in r["warnings"][0]


def _body_compare(rank, world_size, first, second, n_batches=6, batch=4, lr=0.1):
    """Train the same model, data and optimizer with two algorithms; return both results."""
    out = []
    data = _data(rank, n_batches, batch)
    for kind, options in (first, second):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=lr), _make(kind, options))
        for x, y in data:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
        optimizer.join()
        out.append(_flat(model))
    return out[0].tolist(), out[1].tolist(), (out[0] - out[1]).abs().max().item()


def test_zero_block_momentum_with_unit_gain_is_model_averaging(workers):
    # zeta = (1 - 0) * N * (1/N) = 1: bit for bit the same arithmetic as ModelAveragingSGD
    bm = ("bm", {"block_size": 8, "block_momentum": 0.0, "block_learning_rate": 0.5, "reset_local_momentum": False})
    ma = ("ma", {"block_size": 8})
    results = workers.run(f"{__name__}:_body_compare", first=bm, second=ma)
    for a, b, _ in results:
        assert a == b


def test_model_averaging_every_minibatch_equals_data_parallel(workers):
    results = workers.run(f"{__name__}:_body_compare", first=("ma", {"block_size": 4}), second=("dp", {}))
    for _, _, diff in results:
        assert diff <= 1e-6


# -- uneven data ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "warm_start"),
    [
        ("bm", 0),
        ("bm", 24),  # 3 exact steps, then blocks
        ("bm", 56),  # rank 1 runs out during the warm start; rank 0 switches to blocks alone
        ("bm", 1000),  # the warm start never ends: join() must still equalize
        ("ma", 0),
        ("ma", 48),  # the warm start ends exactly with rank 1's data
    ],
)
def test_uneven_data_ends_together_with_equal_models(workers, kind, warm_start):
    options = {"block_size": 8, "warm_start": warm_start}
    if kind == "bm":
        options["block_momentum"] = 0.6
    # rank 1 has 3 batches fewer than rank 0
    results = workers.run(f"{__name__}:_body_train", kind=kind, options=options, n_batches=[9, 6], momentum=0.9)
    _assert_equal_replicas_matching_reference(results)
    for r in results:
        assert r["elapsed"] < 5.0  # no hang: a few ms in practice


def test_rank_without_any_data_joins_at_once(workers):
    options = {"block_size": 8, "warm_start": 8}
    results = workers.run(f"{__name__}:_body_train", kind="bm", options=options, n_batches=[5, 0], momentum=0.9)
    _assert_equal_replicas_matching_reference(results)


def test_uneven_data_four_workers(workers4):
    options = {"block_size": 8, "warm_start": 16}
    results = workers4.run(f"{__name__}:_body_train", kind="bm", options=options, n_batches=[6, 3, 5, 4], momentum=0.9)
    for r in results:
        assert r["params"] == results[0]["params"]
        assert r["diff"] <= 1e-6


# -- sync_replicas() ----------------------------------------------------------------------
def _body_synchronize(rank, world_size, warm_start):
    model = nn.Linear(4, 2)
    algorithm = BlockMomentumSGD(block_size=12, warm_start=warm_start)
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), algorithm)
    out = []
    for i, (x, y) in enumerate(_data(rank, 6, 4)):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if i in (1, 4):  # mid-block (blocks hold 3 minibatches)
            sent = algorithm.traffic.sent
            optimizer.sync_replicas()
            out.append((_flat(model).tolist(), algorithm.traffic.sent - sent, algorithm.block_steps))
    optimizer.join()
    return out, _flat(model).tolist()


def test_synchronize_mid_block_makes_replicas_equal(workers):
    results = workers.run(f"{__name__}:_body_synchronize", warm_start=0)
    (syncs0, final0), (syncs1, final1) = results
    for (p0, sent0, steps0), (p1, sent1, steps1) in zip(syncs0, syncs1):
        assert p0 == p1 and sent0 > 0 and steps0 == steps1 == 0
    assert final0 == final1


def test_synchronize_during_warm_start_sends_nothing(workers):
    # 2 ranks x 4 samples a step: the warm start covers steps 1-3, blocks begin at step 4
    (syncs0, _), (syncs1, _) = workers.run(f"{__name__}:_body_synchronize", warm_start=24)
    (p0, sent0, _), (p1, sent1, _) = syncs0[0], syncs1[0]  # after step 2: still warm
    assert p0 == p1 and sent0 == sent1 == 0
    assert syncs0[1][0] == syncs1[1][0] and syncs0[1][1] > 0  # in block mode: a real round


# -- checkpoints ---------------------------------------------------------------------------
def _body_resume(rank, world_size, options, save_after, n_batches=7):
    data = _data(rank, n_batches, 4)

    def build():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return bunsan.distribute(model, optimizer, BlockMomentumSGD(**options))

    def train(model, optimizer, batches):
        for x, y in batches:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()

    model, optimizer = build()
    train(model, optimizer, data)
    optimizer.join()
    uninterrupted = _flat(model)

    model, optimizer = build()
    train(model, optimizer, data[:save_after])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    mid_block = optimizer.algorithm.block_steps
    del model, optimizer
    model, optimizer = build()  # fresh objects, rank 0's initial model broadcast again
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    model.load_state_dict(checkpoint["model"])  # this rank's own replica, mid-block
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(model, optimizer, data[save_after:])
    optimizer.join()
    return (_flat(model) - uninterrupted).abs().max().item(), mid_block, _flat(model).tolist()


@pytest.mark.parametrize(
    ("options", "save_after"),
    [
        ({"block_size": 8}, 3),  # in the middle of block 2, local momentum in the optimizer
        ({"block_size": 12, "reset_local_momentum": False, "nesterov": False}, 4),
        ({"block_size": 8, "warm_start": 16}, 1),  # during the warm start
        ({"block_size": 8, "warm_start": 16}, 3),  # the first step of block 1
    ],
)
def test_state_dict_round_trip_resumes_exactly(workers, options, save_after):
    results = workers.run(f"{__name__}:_body_resume", options=options, save_after=save_after)
    for diff, _, _ in results:
        assert diff == 0.0  # bit for bit
    assert results[0][2] == results[1][2]
    if options.get("warm_start", 0) == 0:
        assert all(mid_block > 0 for _, mid_block, _ in results)


# -- traffic -----------------------------------------------------------------------------
def test_bytes_per_sample_drop_by_minibatches_per_block(workers):
    # Linear(32, 2): 66 floats; DP sends them every step, blocks of 4 minibatches every 4 steps
    dp = workers.run(f"{__name__}:_body_train", kind="dp", options={}, n_batches=[8, 8], features=32)
    bm = workers.run(f"{__name__}:_body_train", kind="bm", options={"block_size": 16}, n_batches=[8, 8], features=32)
    for d, b in zip(dp, bm):
        ratio = d["stats"]["bytes_sent_per_sample"] / b["stats"]["bytes_sent_per_sample"]
        assert ratio == pytest.approx(4.0, rel=0.15)
        assert b["stats"]["blocks"] == 2 and b["stats"]["local_samples"] == 32
        # per block: the 66 floats plus 3 float64 counts, sent once (ring over 2 ranks)
        assert b["stats"]["bytes_sent"] == 2 * (66 * 4 + 24)


# -- misuse -------------------------------------------------------------------------------
def _body_no_optimizer(rank, world_size):
    model = nn.Linear(4, 2)
    algorithm = BlockMomentumSGD(block_size=8)
    algorithm.setup(list(model.named_parameters()))
    algorithm.optimizer = None  # as if built without bunsan.distribute()
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), algorithm)
    F.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 2)).backward()
    try:
        optimizer.step()
    except RuntimeError as e:
        return str(e)
    return None


def test_missing_optimizer_for_momentum_reset_fails_on_every_rank(workers):
    messages = workers.run(f"{__name__}:_body_no_optimizer")
    assert messages[0] == messages[1]
    assert "reset_local_momentum=True" in messages[0] and "attach_optimizer" in messages[0]


def _train_with_and_without(flag: str, **spec: object) -> dict:
    """``bunsan.bench.job.train`` of the same spec with ``flag`` False, then True (both collective)."""
    from bunsan.bench.job import JobSpec, train

    return {value: train(JobSpec(**spec, **{flag: value})) for value in (False, True)}


def _body_curve_leaves_training_alone(rank: int, world_size: int, algorithm: str, options: dict) -> dict | None:
    if algorithm == "auto":  # a given network of 50 ms latency: only blocks amortize it, whatever the timings
        from bunsan.algorithms.cost_model import Network

        options = {**options, "network": Network(latency_s=0.05, bandwidth=1e9)}
    results = _train_with_and_without(
        "curves",
        model="digits_cnn",
        dataset="digits",
        algorithm=algorithm,
        options=options,
        epochs=2,
        batch=64,
        lr=0.1,
        momentum=0.9,
    )
    if rank != 0:
        return None
    keys = ("train_loss", "test_error", "test_loss", "steps", "samples", "bytes_sent_per_sample", "replicas_equal")
    return {
        "plain": {k: results[False][k] for k in keys},
        "with_curve": {k: results[True][k] for k in keys},
        "curve": results[True]["test_error_curve"],
        "chosen": results[True]["algorithm_repr"],
        "decision": json.loads(json.dumps(results[True].get("auto_decision"))),  # as the result file keeps it
    }


@pytest.mark.parametrize(
    ("algorithm", "options"),
    [
        ("model_averaging", {"block_size": 512}),  # 16 steps of 32: both epoch ends fall inside a block
        ("block_momentum", {"block_size": 512, "warm_start": 128}),
        ("auto", {"risk": "high", "fixed_costs": False, "verbose": False, "measure_steps": 4}),
    ],
    ids=["model_averaging", "block_momentum", "auto"],
)
def test_test_error_curve_is_the_synchronized_model_and_leaves_training_alone(workers, algorithm, options):
    result = workers.run(f"{__name__}:_body_curve_leaves_training_alone", algorithm=algorithm, options=options)[0]
    # The curve's copies (a block round, then everything put back) change nothing in the training:
    # the same losses in every epoch, the same final model, the same traffic counted.
    assert result["with_curve"] == result["plain"]
    assert result["plain"]["replicas_equal"]
    # The last epoch's copy is the model join() ends with: the block round it runs is the same.
    assert len(result["curve"]) == 2 and result["curve"][-1] == result["plain"]["test_error"]
    if algorithm == "auto":
        assert "chosen='block_momentum" in result["chosen"] or "chosen='model_averaging" in result["chosen"]
        # the record keeps Auto's decision: what it chose, at which step, from what it measured
        decision = result["decision"]
        assert f"chosen={decision['label']!r}" in result["chosen"]
        assert decision["measured"]["latency_s"] == 0.05 and decision["predictions"]
    else:
        assert result["decision"] is None  # no decision record for a fixed setting


SLOW_STEP_S = 0.01  # rank 1's extra time per training forward


def _body_slow_rank(rank: int, world_size: int, algorithm: str, options: dict) -> dict | None:
    from bunsan.bench import job

    build = job.build_model

    def slow_on_rank_1(name, info):  # every training step of rank 1 takes SLOW_STEP_S longer
        model = build(name, info)
        if rank == 1:
            model.register_forward_pre_hook(lambda m, args: time.sleep(SLOW_STEP_S) if m.training else None)
        return model

    job.build_model = slow_on_rank_1
    try:
        result = job.train(
            job.JobSpec(
                model="digits_cnn", dataset="digits", algorithm=algorithm, options=options, epochs=2, batch=64, lr=0.1
            )
        )
    finally:
        job.build_model = build
    if rank != 0:
        return None
    return {k: result[k] for k in ("epoch_end_s", "paused_s", "wall_s", "steps")}


@pytest.mark.parametrize(
    ("algorithm", "options"),
    [("model_averaging", {"block_size": 2048}), ("block_momentum", {"block_size": 2048})],
    ids=["model_averaging", "block_momentum"],
)
def test_epoch_times_count_the_wait_for_the_slowest_rank(workers, algorithm, options):
    # Blocks of 64 steps, longer than an epoch (23 steps a rank): no exchange in the first epoch. Rank 1
    # sleeps SLOW_STEP_S in each step; rank 0's clock must still cover rank 1's epoch, as the next
    # exchange would have made it wait. The curve's copy at the epoch's end synchronizes, and its
    # time is left out: the wait before it must not be (it was, until the barrier on the clock).
    result = workers.run(f"{__name__}:_body_slow_rank", algorithm=algorithm, options=options)[0]
    steps_per_epoch = result["steps"] // 2
    for epoch, end_s in enumerate(result["epoch_end_s"]):
        assert end_s >= (epoch + 1) * steps_per_epoch * SLOW_STEP_S, result
    assert len(result["paused_s"]) == 2


def _body_recompute_bn(rank: int, world_size: int) -> dict | None:
    results = _train_with_and_without(
        "recompute_bn",
        model="resnet20",
        dataset="digits32",
        algorithm="data_parallel",
        epochs=1,
        batch=64,
        lr=0.1,
        momentum=0.0,
    )
    if rank != 0:
        return None
    return {
        k: {
            key: results[k][key]
            for key in ("train_loss", "test_loss", "test_error_curve", "test_error", "replicas_equal")
        }
        for k in (False, True)
    }


def test_recomputed_batch_norm_changes_only_the_evaluation(workers):
    result = workers.run(f"{__name__}:_body_recompute_bn")[0]
    plain, recomputed = result[False], result[True]
    assert plain["train_loss"] == recomputed["train_loss"] and plain["replicas_equal"] and recomputed["replicas_equal"]
    # the same weights evaluated with other statistics: another test loss (after one epoch the running
    # statistics lag far behind), and the curve's last point is again the final model's error
    assert plain["test_loss"] != recomputed["test_loss"]
    assert recomputed["test_error_curve"][-1] == recomputed["test_error"]
