"""The cost model's validation harness: its predicted step time against the measured one, side by side.

Campaign tooling, run from a checkout (not part of the installed package; ``bunsan plan`` is what users
run)::

    python tools/predict.py --models digits_cnn,mnist1d_cnn -np 2 --steps 4 --rounds 2

For every network (loopback, or links shaped with ``--network``-style specs),
every worker count and every model, one job measures what the cost model needs
over its own process group, predicts every algorithm's step time, then trains
every algorithm for a few steps and measures it::

    python tools/predict.py --models digits_cnn,mnist1d_cnn,mlp-10m,resnet20 -np 2,4 \\
        --networks loopback,rate=1gbit,rate=100mbit

Inside a job (one ``bunsan run -np N``, or the shaped-network launcher of
:mod:`bunsan.bench.netns`), in this order:

1. the network: all-reduces and all-gathers of 4 B to 16 MB, fitted to alpha
   and beta (:func:`bunsan.bench.measure.measure_network`); on a shaped link, with
   the burst its token bucket was given (``--network rate=RATE[,burst=SIZE]``: 1 ms
   of traffic, at least 16 KiB), which the probe's back-to-back messages cannot see
   and a step's first bytes get after its compute (``cost_model``'s burst credit);
2. per model, its sizes;
3. every algorithm gets its own copy of the model (``bunsan.distribute``) and a
   warm-up; then ``--rounds`` rounds of ``--steps`` steps of every algorithm, each
   algorithm's just after a slice of the compute alone (steps of forward + backward
   + SGD update with no communication, ``--compute-steps`` in all, timed one by one
   on every rank), so that the machine's noise hits all alike; a round of short steps
   takes a multiple of them that lasts ``--round-s`` (:func:`round_steps`, from a
   warm step of each, the slowest rank's). Each round starts with the codec's
   time per element and per call, every rank at once (:func:`median_codec` takes
   the rounds' median), then what every algorithm's step costs beyond the model's
   arithmetic, timed on a tiny model
   (:func:`bunsan.algorithms.measure.measure_fixed_costs`; the rounds' median is
   the profile's ``fixed_s``); where the model's step is short (``FILLER_CAP_S``: the two small
   CNNs), again with a step of the model's compute before each tiny step (the ``filler`` of
   :func:`~bunsan.algorithms.measure.measure_fixed_costs`), which prices ``predicted_filled_s``
   beside the row's prediction. A row's prediction is the mean over the rounds of
   each round priced with the job's compute (every slice of every round: a row's own
   slice of a round, recorded as ``compute_rounds_s``, is a tenth of a second of steps
   whose noise moved the price: priced with it, eleven runs expected 4.65 rows outside
   20% a run, with the job's 3.35) and the round's own fixed costs and codec
   (:func:`round_profiles`, :func:`paired_prediction`; the job's profile pooled over
   the rounds prices ``predicted_pooled_s`` beside it). The pooled compute is the mean
   of the local steps, the straggler wait the mean excess of the slowest rank
   (:func:`bunsan.algorithms.cost_model.compute_with_stragglers`; each row also
   prices the wait of as many more compute steps that every rank starts together,
   :func:`synced_straggler`); the measured step is the mean over the rounds of the
   job's step in each, ``N / sum(1 / step_r)`` over the ranks (all equal but for
   async SGD, whose rank 0 never waits; each rank's own median is recorded too), so
   that the prediction and the measurement hold the same rounds
   (:func:`measured_step`; both sides' medians are recorded as well,
   ``predicted_median_s`` and ``measured_median_s``, the bench's figures up to
   predict-27); the bytes are the last
   rank's own count (``stats()``). Where ranks share cores (more ranks than cores),
   every round also times the compute with one rank per core at once, the others
   waiting (:func:`bunsan.algorithms.measure.in_turns`: ``Profile.core_compute_s``,
   at which async's rank 0 worker is priced). Async SGD is also timed over a common
   window of time in every round, after its steps, every rank stepping through it at
   its own pace (:func:`steps_within`; ``window_s``, the mean of the rounds' job steps
   over their windows, beside the row's measure, which stays the equal step counts'), and
   its first step of a round is timed apart from the rest (each rank's means over the rounds,
   ``first_rank_steps_s`` and ``later_rank_steps_s``: the first is the one every rank computes
   at once, which rank 0's worker, through with its steps long before the remote workers,
   meets once in its few).
   Each round also probes the link again and is priced on that probe (the job's first
   probe and the rounds' give the model's median one, :func:`median_network`, which
   prices ``predicted_pooled_s``). Each job also records every model's whole profile
   and its networks, from which ``docs/experiments/predict_reprice.py`` prices the rows
   again offline.

Columns: ``predicted`` and ``measured`` ms per step, ``error`` = predicted /
measured - 1, ``rounds max/min`` (the slowest of the ``--rounds`` rounds' job step over
the fastest's: how far the measurement itself moved within the job), and the bytes per
step predicted and counted. Timings on a
shared machine are noisy: re-measure on an idle one.

This script imports no torch at the top; the same script is
the job every worker runs (``python tools/predict.py --worker SPEC``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's bunsan, for the harness and for every worker it starts

from bunsan._table import format_table  # noqa: E402
from bunsan.bench import write_json  # noqa: E402
from bunsan.bench._common import (  # noqa: E402
    check_at_least,
    command_main,
    job_command,
    job_environment,
    load_average,
    refuse,
    report_failures,
    run_recorded_job,
)
from bunsan.bench.specs import parse_workers  # noqa: E402
from bunsan.bench.synthetic import time_steps  # noqa: E402

__all__ = [
    "DESCRIPTION",
    "EPILOG",
    "MODELS",
    "add_arguments",
    "main",
    "measured_step",
    "median_codec",
    "median_network",
    "paired_prediction",
    "parse_networks",
    "plot_predict",
    "round_steps",
    "run",
    "steps_within",
    "synced_straggler",
    "table_rows",
]

PROG = "tools/predict.py"
MODELS = ("digits_cnn", "mnist1d_cnn", "mlp-10m", "resnet20")

DESCRIPTION = """\
Validate the cost model of `bunsan plan` and `algorithm="auto"` on this
machine: for each network (loopback, or links shaped to a rate with network
namespaces, root only), worker count and model, one job measures the network
over its own process group, the compute per step and the codec speed, predicts
the step time of every algorithm, then trains every algorithm a few steps and
measures it. Prints predicted against measured ms per step, the error, and the
bytes per step predicted and counted; writes JSON and a PNG."""

EPILOG = """\
examples:
  python tools/predict.py --models digits_cnn,mnist1d_cnn -np 2 --steps 4 --rounds 2
  python tools/predict.py --models digits_cnn,mnist1d_cnn,mlp-10m,resnet20 -np 2,4 \\
      --networks loopback,rate=1gbit,rate=100mbit --out runs/predict"""


def parse_networks(text: str) -> list[str | None]:
    """``"loopback,rate=1gbit"`` -> ``[None, "rate=1gbit"]`` (None is loopback).

    Raises:
        ValueError: a spec that :func:`bunsan.bench.netns.parse_network` refuses.
    """
    from bunsan.bench import netns

    networks: list[str | None] = []
    for item in text.split(","):
        item = item.strip()
        if item in ("loopback", "none", ""):
            networks.append(None)
            continue
        netns.parse_network(item)
        networks.append(item)
    return list(dict.fromkeys(networks))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of the harness to ``parser``."""
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated; default %(default)s")
    parser.add_argument("-np", "--np", dest="workers", default="2,4", help="worker counts; default %(default)s")
    parser.add_argument(
        "--networks",
        default="loopback",
        help="loopback and/or rate=RATE specs (shaped links, root only), comma-separated; default %(default)s",
    )
    parser.add_argument("--batch", type=int, default=32, help="samples per worker per step; default %(default)s")
    parser.add_argument(
        "--block-size", type=int, default=256, help="block algorithms' block, samples per worker; default %(default)s"
    )
    parser.add_argument("--steps", type=int, default=8, help="steps per timed round; default %(default)s")
    parser.add_argument(
        "--compute-steps",
        type=int,
        default=24,
        help="steps timed without communication for the compute profile, spread over the rounds; default %(default)s",
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per algorithm; default %(default)s")
    parser.add_argument(
        "--round-s",
        type=float,
        default=1.0,
        help="shortest timed round, seconds: a round of short steps takes more steps, a multiple of --steps "
        "(the compute's: of its share of --compute-steps); 0 for exactly --steps; default %(default)s",
    )
    # the 4-worker job at 100 Mbit/s ran 22 min before the probe and async's window in every round, and
    # past 30 min with them (predict-32, stopped at 1800 s)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per job; default %(default)s")
    parser.add_argument("--out", default="runs/predict", help="directory of outputs; default %(default)s")


# -- the job ----------------------------------------------------------------------------------------
def _build(name: str) -> tuple[Any, tuple[int, ...]]:
    from bunsan import models
    from bunsan.bench.quantized import MODELS as BENCH_MODELS
    from bunsan.bench.synthetic import model_inputs

    if name in BENCH_MODELS:  # the communication-heavy 10.5M MLP of bench.quantized
        return BENCH_MODELS[name]()
    kwargs, shape = model_inputs(name, None, 10)
    return models.create(name, **kwargs), shape


def _compute_steps(model: Any, optimizer: Any, batch: tuple[Any, Any], count: int) -> list[float]:
    """``count`` steps of the compute alone, timed one by one."""
    return [time_steps(model, optimizer, [batch]) for _ in range(count)]


FIXED_STEPS = 16  # a timed run of the tiny model's steps (measure_fixed_costs), rounded up to whole blocks
# the fixed costs timed again with a step of the model's compute before each tiny step (measure_fixed_costs's
# filler) where its step takes at most this long: the two small CNNs (2-16 ms), not the MLP (48-93 ms) or
# ResNet-20 (180-330 ms), whose 56 filled steps a candidate would add 20-150 s a round
FILLER_CAP_S = 0.025


def synced_straggler(times: Sequence[Sequence[float]], compute_s: float) -> float:
    """The wait for the slowest rank of a synchronous step: ``times[rank][step]`` of compute steps that
    every rank started together (after a barrier), the mean over steps of the slowest rank's, less
    ``compute_s`` (the mean step of every rank computing on its own); 0 where it is less.

    Where ranks share cores (4 on the 2 of the docs), a rank that ends its step early leaves its
    core to the others, so the slowest ends well before the slowest of steps run free: at 4
    workers ResNet-20's slowest came 33-36 ms past a 215-219 ms mean started together, 107-119 ms
    run free; the digits CNN's 0.3-0.5 ms against 6-7. Priced with it, 6 rows at 4 workers came
    within 20% (ResNet-20's exact and fp16, +21% to +26% -> -4% to -6%; the digits CNN's exact at 1
    Gbit/s, +28% -> 0%; MNIST-1D's exact and block momentum at 100 Mbit/s), but 18 left it: the
    two small CNNs' fp16 and quantized rows at 4 workers on every network and their exact on
    loopback (-20% to -29%), the 10.5M MLP's 1-bit (-20% to -25%); 138 of 168 against 150
    (6d73f2c, docs/experiments/plan.md "Checking the predictions"). The bench prices its rows with the wait
    of steps run free and records this one beside it.
    """
    from bunsan.algorithms.cost_model import compute_with_stragglers

    mean, excess = compute_with_stragglers(times)  # the slowest rank's mean step is mean + excess
    return max(0.0, mean + excess - compute_s)


def round_steps(step_s: float, steps: int, round_s: float) -> int:
    """Steps in one timed round: the fewest multiple of ``steps`` that lasts ``round_s`` at ``step_s`` a step.

    ``steps`` itself where its steps already last ``round_s`` (or ``round_s`` is 0). A multiple,
    so that a block algorithm's round holds whole blocks (``--steps`` 8 is one block of 256
    samples at 32 a step). Rounds of a few milliseconds (8 steps of a 2 ms CNN) move 1.2-1.7x
    from one to the next on this shared machine (``rounds max/min`` at 2ed9dff), where the
    scheduler's pauses are a large share of a round; a second-long round averages them.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if round_s <= 0 or step_s <= 0 or steps * step_s >= round_s:
        return steps
    return steps * math.ceil(round_s / (steps * step_s))


def median_codec(
    rounds: Sequence[tuple[dict[str, float], Sequence[Sequence[float]]]],
) -> tuple[dict[str, Any], tuple[tuple[float, ...], ...]]:
    """The median over rounds of each codec figure: ``rounds`` holds each round's ``(measure_codec's dict,
    measure_codecs's entries)``; the entries' bit widths stay as they are, every other field its median.
    ``codec_call_s`` is the mean of the two calls' medians, as :func:`bunsan.algorithms.measure.measure_codec`
    makes it."""
    if not rounds:
        raise ValueError("need the codec of at least one round")
    fields = {k: statistics.median(r[0][k] for r in rounds) for k in rounds[0][0]}
    if "encode_call_s" in fields and "decode_call_s" in fields:
        fields["codec_call_s"] = (fields["encode_call_s"] + fields["decode_call_s"]) / 2
    entries = []
    for i, first in enumerate(rounds[0][1]):
        values = [statistics.median(float(r[1][i][j]) for r in rounds) for j in range(1, len(first))]
        if len(first) == 6:
            values[2] = (values[3] + values[4]) / 2
        entries.append((first[0], *values))
    return fields, tuple(entries)


def round_profiles(
    profile: Any,
    compute_rounds: Sequence[float],
    fixed_rounds: Sequence[dict[str, float]],
    codec_rounds: Sequence[tuple[dict[str, float], Sequence[Sequence[float]]]],
) -> list[Any]:
    """One :class:`~bunsan.algorithms.cost_model.Profile` per timed round: ``profile`` (the job's, pooled
    over the rounds) with the compute ``compute_rounds[r]`` (the bench passes the job's pooled compute for
    every round; up to predict-34 each row's own slice of the compute alone, timed just before its
    algorithm in round ``r``) and that round's own fixed costs and codec; the straggler wait and the sizes
    stay the pooled ones (a round's few compute steps set a mean, not a slowest rank's excess), and the
    compute of one rank per core (``core_compute_s``, where timed) moves with the round's compute.

    A row's prediction is the mean of its rounds' (:func:`paired_prediction`): the machine's
    speed, which moved a whole round 1.3-1.4x on a busy day (ResNet-20's model averaging at 2
    workers ran 226, 159 and 160 ms a step in predict-21's three rounds), then moves the priced
    compute with the measured step instead of pricing every round with one pooled mean. Over eleven
    runs (predict-23 to predict-34-small) the row's own slice, a tenth of a second of steps, moved the
    price more by its own noise than it followed the machine: 4.65 rows expected outside 20% a run
    against 3.35 with the job's compute in every round (3.36 with the round's, every slice of that
    round; ``docs/experiments/predict_reprice.py --variant own-compute``), so the bench now prices
    each round with the job's compute; the fixed costs, codec and probe of each round stay paired."""
    from dataclasses import replace

    if not (len(compute_rounds) == len(fixed_rounds) == len(codec_rounds)) or not compute_rounds:
        raise ValueError(
            f"need one compute, fixed-cost and codec entry per round, got {len(compute_rounds)}, "
            f"{len(fixed_rounds)} and {len(codec_rounds)}"
        )
    out = []
    for compute_s, fixed, codec_round in zip(compute_rounds, fixed_rounds, codec_rounds, strict=True):
        codec, codecs = median_codec([codec_round])
        out.append(
            replace(
                profile,
                compute_s=float(compute_s),
                core_compute_s=profile.core_compute_s * float(compute_s) / profile.compute_s,
                fixed_s=tuple((label, float(s)) for label, s in fixed.items()),
                codecs=codecs,
                **{k: v for k, v in codec.items() if k in profile.__dataclass_fields__},
            )
        )
    return out


def paired_prediction(step_s: Callable[[Any], float], profiles: Sequence[Any]) -> tuple[float, list[float]]:
    """``(mean, each)`` of ``step_s(profile)`` over the rounds' profiles (:func:`round_profiles`).

    The mean, set against :func:`measured_step`'s mean of the same rounds: the rows' error is
    then their predicted time over their measured time for the whole of the rounds, and each
    round's price stays paired with that round's measurement. The medians of each side (the
    bench's figures up to predict-27) may take the two from different rounds, and of three
    rounds they keep one: in predict-23 to 27 a round's error (the log of its predicted over its
    measured step) moved by 10.8% about its run's mean (1,848 degrees of freedom), the mean of a
    run's 3 rounds by 6.4% from run to run, what independent rounds give (``10.8 / sqrt 3`` =
    6.3%), and a row's error between medians by 7.5%: the rounds are independent draws of one
    noise, which the mean of all of them reduces most (``docs/experiments/predict_reprice.py``
    over those records; docs/experiments/plan.md, "The rounds' mean").
    """
    each = [float(step_s(p)) for p in profiles]
    return statistics.fmean(each), each


def measured_step(rounds_s: Sequence[float]) -> float:
    """A row's measured step: the mean over its rounds of the job's step (each round the same number of
    steps, so the whole of the rounds' time over their steps), set against :func:`paired_prediction`."""
    if not rounds_s:
        raise ValueError("need the job's step of at least one round")
    return statistics.fmean(float(s) for s in rounds_s)


def median_network(networks: Sequence[Any]) -> Any:
    """Each field's median over ``networks`` (probes of one link: the job's first and one per round).

    One probe priced every row of a job: predict-30's at 1 Gbit/s and 4 workers found 0.674 Gbit/s
    and 782 us of latency where the nine runs before it found 0.93-0.95 Gbit/s and 156-496 us, and
    the digits CNN's exact came +36% (+12% to +27% in six runs before), the 10.5M MLP's +25%
    (predict-28's at 2 workers: 1563 us). A model's rows are priced with the median of the job's
    first probe and one at the start of each of its rounds, which one bad probe cannot move."""
    from dataclasses import fields, replace

    if not networks:
        raise ValueError("need at least one probe of the network")
    values = {}
    for f in fields(networks[0]):
        # an optional field (None where a probe did not time it): the median of the probes that have it
        present = [float(v) for v in (getattr(net, f.name) for net in networks) if v is not None]
        if present:
            values[f.name] = statistics.median(present)
    return replace(networks[0], **values)


ASYNC_WINDOW_STEPS = 3  # the remote workers' steps a common window of async holds at the least


def steps_within(
    step: Callable[[], Any], window_s: float, clock: Callable[[], float] | None = None
) -> tuple[int, float]:
    """``(steps, seconds)``: call ``step`` until ``window_s`` has passed (at least once), the seconds from the
    first call's start to the last's end.

    Async SGD's ranks step at their own pace: timed each over the same number of steps (as every
    other algorithm, whose rounds are collective), rank 0's worker, which never waits, finishes
    its steps while the remote workers are still in their first few (8 steps at 100 Mbit/s and 4
    workers, 0.1 s of rank 0's against 1.8 s of theirs), and the job's step ``N / sum(1 / step_r)``
    then joins speeds of different moments. Every rank stepping through one common window gives
    the job's steps per second while all of them run (docs/experiments/plan.md, "Rank 0's worker on a core of
    its own")."""
    if not window_s > 0:
        raise ValueError(f"window_s must be positive, got {window_s!r}")
    clock = clock or time.perf_counter
    start = clock()
    steps = 0
    while True:
        step()
        steps += 1
        elapsed = clock() - start
        if elapsed >= window_s:
            return steps, elapsed


def _step_of(round_: tuple[Any, Any], *, model: Any, candidate: Any, n: int, overlap: bool, spare_core: bool) -> float:
    """The cost model's step time of ``candidate`` at ``n`` workers priced from a round's ``(profile, network)``."""
    profile, network = round_
    return float(model.predict(profile, network, candidate, n, overlap=overlap, spare_core=spare_core).step_s)


def _algorithm(candidate: Any) -> Any:
    from bunsan import algorithms

    options = {k: v for k, v in candidate.options.items()}
    return algorithms.create(candidate.algorithm, **options)


def _worker(spec: dict[str, Any]) -> int:
    from dataclasses import asdict, replace

    import torch

    import bunsan
    from bunsan import comm
    from bunsan.algorithms import async_model as am
    from bunsan.algorithms import cost_model as cm
    from bunsan.algorithms.measure import (
        CODEC_NUMEL_CAP,
        FIXED_COST_BATCH,
        can_overlap,
        in_turns,
        measure_core_copy,
    )
    from bunsan.bench.measure import (
        measure_codec,
        measure_codecs,
        measure_compute,
        measure_fixed_costs,
        measure_network,
    )
    from bunsan.launch.hosts import usable_cores

    torch.set_num_threads(1)
    bunsan.init(timeout_s=spec["timeout_s"])
    rank, n = bunsan.rank(), bunsan.size()
    network = measure_network()
    if spec["network"] is not None:  # the shaped link's token bucket, as netns set it up
        from bunsan.bench.netns_plan import parse_network

        network = replace(network, burst_bytes=float(parse_network(spec["network"]).burst_bytes))
    candidates = am.default_candidates(spec["block_size"])
    overlap = can_overlap("cpu", bunsan.local_size(), over_memory=spec["network"] is None)
    # async: the server's transfers travel through memory on loopback; they find a spare core
    # where every worker has one (async_model.predict)
    spare_core = spec["network"] is not None or usable_cores() >= bunsan.local_size()
    # every rank runs on this machine (loopback, or network namespaces of it): the compute below is
    # timed with all of them busy on its cores (async_model.shared_compute)
    ranks_per_core = max(1.0, n / usable_cores())
    bits = sorted({int(c.options["bits"]) for c in candidates if "bits" in c.options})
    rows = []
    profiles: dict[str, dict[str, Any]] = {}  # every model's whole profile: the rows re-priced offline
    for name in spec["models"]:
        torch.manual_seed(0)
        model, shape = _build(name)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(spec["batch"], *shape, generator=g)
        y = torch.randint(0, 10, (spec["batch"],), generator=g)
        measured = measure_compute(model, x, y, steps=3)  # sizes and the forward share
        local = torch.optim.SGD(model.parameters(), lr=1e-3)  # the compute alone: no communication
        local_times: list[float] = []
        synced_times: list[float] = []
        core_times: list[float] = []  # ranks_per_core above 1: one rank per core computing (in_turns)
        trainers: list[tuple[Any, Any, Any, dict[str, Any], list[float]]] = []
        guesses = [time_steps(model, local, [(x, y)])]  # a step of the compute alone, warm
        for candidate in candidates:
            torch.manual_seed(0)
            copy, _ = _build(name)
            sgd = torch.optim.SGD(copy.parameters(), lr=1e-3 / (n if candidate.algorithm == "async" else 1))
            copy, optimizer = bunsan.distribute(copy, sgd, _algorithm(candidate))
            time_steps(copy, optimizer, [(x, y)])  # warm up (buffers, first-step allocations)
            guesses.append(time_steps(copy, optimizer, [(x, y)]))  # a warm step: the round's length
            trainers.append((candidate, copy, optimizer, optimizer.algorithm.stats(), []))
        # Every rank takes the same number of steps (the block algorithms' rounds are collective):
        # the slowest rank's guess sets it.
        slowest = torch.tensor(guesses, dtype=torch.float64)
        comm.all_reduce(slowest, op="max")
        per_round = round_steps(float(slowest[0]), max(1, spec["compute_steps"] // spec["rounds"]), spec["round_s"])
        steps = [round_steps(float(s), spec["steps"], spec["round_s"]) for s in slowest[1:]]
        window_lengths = [
            max(spec["round_s"], min(count, ASYNC_WINDOW_STEPS) * float(s))
            for count, s in zip(steps, slowest[1:], strict=True)
        ]
        # Rounds alternate between the compute alone and every algorithm, so that the machine's
        # noise hits all alike; the compute's steps are timed one by one, for the stragglers.
        fixed_rounds: list[dict[str, float]] = []
        # and after a step of the compute, where it is short (FILLER_CAP_S): the rows' predicted_filled_s
        filled = float(slowest[0]) <= FILLER_CAP_S
        filled_rounds: list[dict[str, float]] = []
        network_rounds: list[Any] = []  # a probe of the link in every round, which prices that round
        codec_rounds: list[tuple[dict[str, float], Any]] = []
        # the compute alone runs in slices, one just before each algorithm's steps in every round: the
        # row is priced with the compute of its own moments (round_profiles), the job's pooled over all
        slice_steps = max(1, math.ceil(per_round / len(trainers)))
        slices: list[list[list[float]]] = [[] for _ in trainers]  # [trainer][round] -> this rank's steps
        block = cm.block_steps(spec["block_size"], FIXED_COST_BATCH)  # the tiny model's runs hold whole blocks
        fixed_steps = block * math.ceil(FIXED_STEPS / block)
        window_times: list[list[tuple[int, float]]] = [[] for _ in trainers]  # async: (steps, s) per round
        first_times: list[list[tuple[float, float]]] = [[] for _ in trainers]  # async: (first step, the rest's mean)
        for _ in range(spec["rounds"]):
            comm.barrier()
            round_network = replace(measure_network(), burst_bytes=network.burst_bytes)
            network_rounds.append(round_network)
            # the codec, every rank at once as the job's exchange encodes (measure_codec), in every
            # round as the rest (timed once at the job's start, one moment of the machine priced every
            # coded row of the model; a small CNN's coded rows are mostly the calls' fixed time)
            round_codec = measure_codec(measured["params"], collective=True)
            if ranks_per_core > 1:  # and with one rank per core copying at once (async's passes)
                round_codec.update(measure_core_copy(measured["params"], ranks_per_core))
            codec_rounds.append((round_codec, measure_codecs(measured["params"], bits, collective=True)))
            # what a step costs beyond the model's arithmetic, on a tiny model, in every round as the
            # rest (taken once at the job's start, exact's moved from 0.8 to 2.8 ms a step at 1 Gbit/s
            # and 2 workers between two runs, model averaging's from 15 to 6 ms a block at 4: the
            # small CNNs' rows rest on it); the median of the rounds
            fixed_costs = partial(  # beyond the model's price on this round's own probe
                measure_fixed_costs,
                candidates,
                round_network,
                overlap=overlap,
                distribute=bunsan.distribute,
                steps=fixed_steps,
                warmup=block,
                spare_core=spare_core,
            )
            fixed_rounds.append(dict(fixed_costs()))
            if filled:  # and after a step of the model's compute
                filled_rounds.append(dict(fixed_costs(filler=partial(time_steps, model, local, [(x, y)]))))
            for _ in range(per_round):  # the same steps started together: the wait a synchronous step sees
                comm.barrier()
                synced_times.append(time_steps(model, local, [(x, y)]))
            if ranks_per_core > 1:  # the same steps on a core of their own: async's rank 0 worker
                core_times += in_turns(partial(_compute_steps, model, local, (x, y), per_round), ranks_per_core)
            for i, ((candidate, copy, optimizer, _, times), count) in enumerate(zip(trainers, steps, strict=True)):
                comm.barrier()
                own_slice = [time_steps(model, local, [(x, y)]) for _ in range(slice_steps)]
                slices[i].append(own_slice)
                local_times += own_slice
                comm.barrier()
                if candidate.algorithm == "async" and n > 1 and count > 1:  # its first step apart from the rest
                    first = time_steps(copy, optimizer, [(x, y)])
                    rest = time_steps(copy, optimizer, [(x, y)] * (count - 1))
                    first_times[i].append((first, rest))
                    times.append((first + (count - 1) * rest) / count)
                else:
                    times.append(time_steps(copy, optimizer, [(x, y)] * count))
                if candidate.algorithm == "async" and n > 1:  # and over a common window, every rank stepping
                    comm.barrier()
                    window_times[i].append(
                        steps_within(partial(time_steps, copy, optimizer, [(x, y)]), window_lengths[i])
                    )
        mine = torch.tensor(local_times + synced_times, dtype=torch.float64)
        everyone = torch.empty(n * mine.numel(), dtype=torch.float64)
        comm.all_gather_into(everyone, mine)
        free, synced = everyone.view(n, -1).split([len(local_times), len(synced_times)], dim=1)
        compute_s, straggler_s = cm.compute_with_stragglers(free.tolist())
        synced_straggler_s = synced_straggler(synced.tolist(), compute_s)
        core_compute_s = 0.0
        if core_times:  # every rank's mean, their mean
            core = torch.tensor([statistics.fmean(core_times)], dtype=torch.float64)
            comm.all_reduce(core)
            core_compute_s = float(core[0]) / n
        fixed = tuple((label, statistics.median(f[label] for f in fixed_rounds)) for label in fixed_rounds[0])
        codec, codecs = median_codec(codec_rounds)
        profile = cm.Profile(
            compute_s=compute_s,
            straggler_s=straggler_s,
            params=measured["params"],
            batch=spec["batch"],
            backward_fraction=measured["backward_fraction"],
            tensors=measured["tensors"],
            chunks=measured["chunks"],
            codecs=codecs,
            fixed_s=fixed,
            ranks_per_core=ranks_per_core,
            core_compute_s=core_compute_s,
            synced_straggler_s=synced_straggler_s,  # exact's wait where its ranks leave a wire together
            **codec,
        )
        # each slice's mean over its steps and every rank: [trainer][round]
        mine = torch.tensor([[statistics.fmean(r) for r in t] for t in slices], dtype=torch.float64)
        comm.all_reduce(mine)
        slice_means = (mine / n).tolist()
        model_network = median_network([network, *network_rounds])
        profiles[name] = {
            **asdict(profile),
            # the link as each round's probe found it (that round's price) and their median with the job's
            # first (the pooled price)
            "network_rounds": [asdict(net) for net in network_rounds],
            "network": asdict(model_network),
            "codec_rounds": [{"codec": c, "codecs": cs} for c, cs in codec_rounds],
            "fixed_rounds": fixed_rounds,
            **({"fixed_filled_rounds": filled_rounds} if filled else {}),
        }
        # every round priced with the job's compute, the mean of every slice of every round: a row's own
        # slice (a tenth of a second) moved its price by its noise (below, "round_profiles")
        job_compute = [profile.compute_s] * spec["rounds"]
        for i, ((candidate, _, optimizer, before, times), count, compute_rounds) in enumerate(
            zip(trainers, steps, slice_means, strict=True)
        ):
            async_fields: dict[str, Any] = {}  # async only: its common windows, its first steps apart
            if window_times[i]:  # async's common windows: [round][rank] steps of each rank
                each = torch.zeros(len(window_times[i]), n, dtype=torch.float64)
                for r, (taken, elapsed) in enumerate(window_times[i]):
                    each[r, rank] = elapsed / taken
                comm.all_reduce(each)
                window_rounds = [[float(v) for v in r] for r in each]
                job_steps = [n / sum(1 / v for v in r) for r in window_rounds]  # N / sum(1 / step_r) a round
                async_fields = {
                    "window_rounds_s": job_steps,
                    "window_s": measured_step(job_steps),
                    "window_rank_rounds_s": window_rounds,
                    "window_rank_steps_s": [statistics.fmean(r[k] for r in window_rounds) for k in range(n)],
                    "window_length_s": window_lengths[i],
                }
            if first_times[i]:  # async's first step of a round apart from the rest: each rank's mean over the rounds
                apart = torch.zeros(2, n, dtype=torch.float64)
                apart[0, rank] = statistics.fmean(f for f, _ in first_times[i])
                apart[1, rank] = statistics.fmean(r for _, r in first_times[i])
                comm.all_reduce(apart)
                async_fields["first_rank_steps_s"] = [float(v) for v in apart[0]]
                async_fields["later_rank_steps_s"] = [float(v) for v in apart[1]]
            stats = optimizer.algorithm.stats()
            optimizer.join()
            sent = (stats["bytes_sent"] - before["bytes_sent"]) / max(stats["steps"] - before["steps"], 1)
            # the job's step: N / sum of the ranks' steps per second (all equal but for async);
            # the bytes of the last rank (a remote worker for async, the same as all others otherwise)
            # and each round's own job step: how far the measurement moved within this one job
            # and each rank's own median step (async: rank 0's worker against the remote ones)
            own = [statistics.median(times) if r == rank else 0.0 for r in range(n)]
            mine = torch.tensor(
                [1 / statistics.median(times), sent if rank == n - 1 else 0.0, *own, *(1 / t for t in times)],
                dtype=torch.float64,
            )
            comm.all_reduce(mine)
            measured_median_s, sent = n / float(mine[0]), float(mine[1])
            rank_steps_s = [float(v) for v in mine[2 : 2 + n]]
            rounds_s = [n / float(v) for v in mine[2 + n :]]
            measured_s = measured_step(rounds_s)
            # the row's prediction: each round priced with the job's compute and the round's own fixed costs,
            # codec and probe of the link, the mean of the rounds (round_profiles) against the rounds' mean
            # step (the row's own slices, compute_rounds_s, recorded beside it); the job's
            # pooled profile's beside it, on the median of the job's probes (median_network)
            step_of = partial(_step_of, model=am, candidate=candidate, n=n, overlap=overlap, spare_core=spare_core)
            predicted_s, predicted_rounds = paired_prediction(
                step_of,
                list(zip(round_profiles(profile, job_compute, fixed_rounds, codec_rounds), network_rounds)),
            )
            predicted = am.predict(profile, model_network, candidate, n, overlap=overlap, spare_core=spare_core)
            # a quantized row also as the model priced it before encode and decode calls were timed apart
            before_split = (
                {
                    "predicted_mean_call_s": am.predict(
                        cm.mean_call_profile(profile, min(profile.params, CODEC_NUMEL_CAP)),
                        model_network,
                        candidate,
                        n,
                        overlap=overlap,
                        spare_core=spare_core,
                    ).step_s
                }
                if "bits" in candidate.options
                else {}
            )
            # and with the fixed costs timed after a step of the compute (FILLER_CAP_S)
            filled_fields: dict[str, Any] = {}
            if filled:
                filled_fields = {
                    "predicted_filled_s": paired_prediction(
                        step_of,
                        list(zip(round_profiles(profile, job_compute, filled_rounds, codec_rounds), network_rounds)),
                    )[0],
                    "fixed_filled_rounds_s": [f[candidate.label] for f in filled_rounds],
                }
                if candidate.algorithm == "async":
                    remote = am.async_fixed_labels(candidate.label)[1]
                    filled_fields["fixed_filled_remote_rounds_s"] = [f[remote] for f in filled_rounds]
            # and priced with the wait of the compute steps started together (synced_straggler)
            synced_wait = paired_prediction(
                step_of,
                list(
                    zip(
                        round_profiles(
                            replace(profile, straggler_s=synced_straggler_s), job_compute, fixed_rounds, codec_rounds
                        ),
                        network_rounds,
                    )
                ),
            )[0]
            rows.append(
                {
                    "model": name,
                    "workers": n,
                    "network": spec["network"] or "loopback",
                    "label": candidate.label,
                    "predicted_s": predicted_s,
                    "measured_s": measured_s,
                    "error": predicted_s / measured_s - 1,
                    "rounds_s": rounds_s,
                    "predicted_rounds_s": predicted_rounds,
                    # each side's median over the rounds (the ranks' medians for the measured): the
                    # bench's figures up to predict-27
                    "predicted_median_s": statistics.median(predicted_rounds),
                    "measured_median_s": measured_median_s,
                    "compute_rounds_s": compute_rounds,
                    # priced with the job's profile pooled over every round (the bench's figure before)
                    "predicted_pooled_s": predicted.step_s,
                    "rank_steps_s": rank_steps_s,
                    "round_steps": count,
                    "compute_round_steps": per_round,
                    "predicted_bytes": predicted.bytes_per_step,
                    "measured_bytes": sent,
                    "compute_s": profile.compute_s,
                    "exposed_s": predicted.exposed_s,
                    # async: the compute on shared cores and a remote worker's step beyond it
                    "predicted_compute_s": predicted.compute_s,
                    "communication_s": predicted.communication_s,
                    "codec_s": predicted.codec_s,
                    "params": profile.params,
                    "straggler_s": profile.straggler_s,
                    "synced_straggler_s": synced_straggler_s,
                    "predicted_synced_straggler_s": synced_wait,
                    "fixed_s": profile.fixed(candidate.label),
                    "fixed_rounds_s": [f[candidate.label] for f in fixed_rounds],
                    # async: a remote worker's own (rank 0's worker's is fixed_s; async_model.async_fixed_labels)
                    **(
                        {"fixed_remote_s": profile.fixed(am.async_fixed_labels(candidate.label)[1])}
                        if candidate.algorithm == "async"
                        else {}
                    ),
                    "overlap": overlap,
                    "spare_core": spare_core,
                    "ranks_per_core": ranks_per_core,
                    "copy_s_per_element": profile.copy_s_per_element,
                    "core_copy_s_per_element": profile.core_copy_s_per_element,
                    "core_compute_s": profile.core_compute_s,
                    **before_split,
                    **async_fields,
                    **filled_fields,
                }
            )
        del trainers
    if rank == 0:
        write_json(
            spec["result"],
            {
                "network": {
                    "latency_s": network.latency_s,
                    "bandwidth": network.bandwidth,
                    "gather_bandwidth": network.gather_bandwidth,
                    "half_bandwidth": network.half_bandwidth,
                    "burst_bytes": network.burst_bytes,
                },
                "rows": rows,
                "profiles": profiles,
            },
        )
    bunsan.finalize()
    return 0


# -- the parent -------------------------------------------------------------------------------------
def _within(rows: Sequence[dict[str, Any]], predicted: str, measured: str = "measured_s") -> int:
    """Rows whose ``predicted`` field is within 20% of their ``measured`` one."""
    return sum(abs(r[predicted] / r[measured] - 1) <= 0.20 for r in rows)


COLUMNS = (
    "network",
    "workers",
    "model",
    "algorithm",
    "predicted (ms)",
    "of it fixed",
    "measured (ms)",
    "error",
    "rounds max/min",
    "MB/step pred.",
    "MB/step counted",
)


def rounds_spread(row: dict[str, Any]) -> float | None:
    """The slowest round's job step over the fastest's in the row's job (``None`` in records before it):
    the resolution of the row's measurement, as the rounds ran side by side with the others'."""
    rounds = row.get("rounds_s") or []
    return max(rounds) / min(rounds) if len(rounds) > 1 and min(rounds) > 0 else None


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The table's cells, one per (network, workers, model, algorithm) row."""
    return [
        [
            r["network"],
            str(r["workers"]),
            r["model"],
            r["label"],
            f"{r['predicted_s'] * 1e3:.2f}",
            f"{r.get('fixed_s', 0.0) * 1e3:.2f}",
            f"{r['measured_s'] * 1e3:.2f}",
            f"{100 * r['error']:+.0f}%",
            f"{rounds_spread(r):.2f}" if rounds_spread(r) is not None else "-",
            f"{r['predicted_bytes'] / 1e6:.3f}",
            f"{r['measured_bytes'] / 1e6:.3f}",
        ]
        for r in rows
    ]


def plot_predict(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Predicted against measured step time, log-log, with the +-20% band; one marker per network."""
    from bunsan.bench.plots import new_figure, save_figure

    figure, (axes,) = new_figure(1, size=(6, 5.5))
    for network in dict.fromkeys(r["network"] for r in rows):
        mine = [r for r in rows if r["network"] == network]
        axes.scatter([r["measured_s"] * 1e3 for r in mine], [r["predicted_s"] * 1e3 for r in mine], s=18, label=network)
    values = [v * 1e3 for r in rows for v in (r["measured_s"], r["predicted_s"])]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    axes.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
    axes.fill_between([lo, hi], [0.8 * lo, 0.8 * hi], [1.2 * lo, 1.2 * hi], color="grey", alpha=0.2, label="within 20%")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("measured step (ms)")
    axes.set_ylabel("predicted step (ms)")
    axes.legend(fontsize="small")
    axes.grid(True, alpha=0.3, which="both")
    return save_figure(figure, path)


def run(args: argparse.Namespace, *, say: Callable[[str], None] = print) -> int:
    """The harness: run the jobs, print the table, write JSON and PNG. 0 ok, 1 a job failed, 2 bad input."""
    try:
        workers = parse_workers(args.workers)
        networks = parse_networks(args.networks)
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in names if m not in MODELS]
        if unknown:
            raise ValueError(f"--models: {unknown[0]!r} is not one of {', '.join(MODELS)}")
        check_at_least(
            ("--batch", args.batch, 1),
            ("--block-size", args.block_size, 1),
            ("--steps", args.steps, 1),
            ("--rounds", args.rounds, 1),
            ("--compute-steps", args.compute_steps, 1),
        )
        if not (math.isfinite(args.round_s) and args.round_s >= 0):
            raise ValueError(f"--round-s must be a finite number of seconds, 0 or more, got {args.round_s}")
        if any(w < 2 for w in workers):
            raise ValueError("-np: predictions are checked at 2 or more workers")
        if any(networks):
            from bunsan.bench import netns

            netns.check_privileges()
    except (TypeError, ValueError, PermissionError, FileNotFoundError) as err:
        return refuse(PROG, err)
    out = Path(args.out)
    env = job_environment(1)
    rows: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    failed = 0
    for network in networks:
        for n in workers:
            slug = f"{(network or 'loopback').replace('=', '_').replace(',', '_')}-np{n}"
            directory = out / slug
            result = (directory / "result.json").resolve()
            result.unlink(missing_ok=True)
            spec = {
                "models": names,
                "batch": args.batch,
                "compute_steps": args.compute_steps,
                "block_size": args.block_size,
                "steps": args.steps,
                "rounds": args.rounds,
                "round_s": args.round_s,
                "network": network,
                "timeout_s": min(args.timeout_s, 300.0),
                "result": str(result),
            }
            command = job_command(str(Path(__file__).resolve()), "--worker", spec, n, network)
            record: dict[str, Any] = {"label": slug, "workers": n, "dir": str(directory)}
            job = run_recorded_job(command, directory, result, record, args.timeout_s, env)
            if job is None:
                failed += 1
                report_failures([record], say)
                continue
            say(
                f"{slug}: latency {job['network']['latency_s'] * 1e6:.1f} us, bandwidth "
                f"{job['network']['bandwidth'] * 8 / 1e9:.3f} Gbit/s ({record['total_s']:.0f} s)"
            )
            rows += job["rows"]
            profiles[slug] = {"network": job["network"], "models": job.get("profiles", {})}
    if rows:
        say(format_table(COLUMNS, table_rows(rows), right=set(COLUMNS) - {"network", "model", "algorithm"}))
        worst = max(rows, key=lambda r: abs(r["error"]))
        within = sum(abs(r["error"]) <= 0.20 for r in rows)
        say(
            f"{within} of {len(rows)} rows within 20%; worst: {worst['network']} -np {worst['workers']} "
            f"{worst['model']} {worst['label']} ({100 * worst['error']:+.0f}%)"
        )
        coded = [r for r in rows if "predicted_mean_call_s" in r]
        if coded:
            say(
                f"quantized rows: {_within(coded, 'predicted_s')} of {len(coded)} within 20%; with every codec "
                "call at the mean of an encode and a decode (the model before the two were timed apart): "
                f"{_within(coded, 'predicted_mean_call_s')}"
            )
        # the same rows priced or measured another way: (predicted, measured, what the other way is)
        for predicted, measured, other in (
            (
                "predicted_median_s",
                "measured_median_s",
                "with each side's median over the rounds instead of their mean (the bench's measure up to predict-27)",
            ),
            (
                "predicted_synced_straggler_s",
                "measured_s",
                "with the straggler of compute steps started together instead of run free",
            ),
            (
                "predicted_filled_s",
                "measured_s",
                "with the fixed costs timed after a step of the model's compute (the models whose step is short)",
            ),
            (
                "predicted_s",
                "window_s",
                "async measured over a common window of time, every rank stepping through it, instead of "
                "the same number of steps on every rank",
            ),
        ):
            kept = [r for r in rows if predicted in r and measured in r]
            if kept:
                say(f"{other}: {_within(kept, predicted, measured)} of {len(kept)} within 20%")
        spreads = [(r, rounds_spread(r)) for r in rows]
        loose = [(r, v) for r, v in spreads if v is not None and v > 1.2]
        if loose:
            missed = sum(abs(r["error"]) > 0.20 for r, _ in loose)
            say(
                f"{len(loose)} rows' own rounds differ by more than 20% (slowest over fastest), {missed} of them "
                "outside 20%: their measurement does not resolve the bar"
            )
        write_json(
            str(out / "predict.json"),
            {
                "arguments": {k: v for k, v in vars(args).items() if k != "handler"},
                "load_average": load_average(),
                "rows": rows,
                "profiles": profiles,
            },
        )
        say(f"JSON: {out / 'predict.json'}\nPNG: {plot_predict(rows, out / 'predict.png')}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python tools/predict.py`` (or ``--worker SPEC`` inside a job)."""
    return command_main(argv, PROG, DESCRIPTION, EPILOG, add_arguments, run, worker=_worker, allow_abbrev=True)


if __name__ == "__main__":
    sys.exit(main())
