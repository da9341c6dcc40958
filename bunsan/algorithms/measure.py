"""Measurements an algorithm can take of its own job: the codec's speed and the network's alpha and beta.

They feed :mod:`bunsan.algorithms.cost_model` at run time (``Auto``) and in the
benchmarks (:mod:`bunsan.bench.measure`, ``tools/predict.py``).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch

from bunsan import comm
from bunsan._validate import check_int
from bunsan.algorithms.data_parallel.graphs import CapturedCalls, graphs_enabled, run_call
from bunsan.algorithms.data_parallel.stripes import coded_per_bucket
from bunsan.algorithms.network_model import Network, network_from_timings, ring_allreduce_bytes

T = TypeVar("T")

__all__ = [
    "CODEC_FIELDS",
    "CODEC_NUMEL_CAP",
    "FIXED_COST_BATCH",
    "PROBE_SIZES",
    "can_overlap",
    "in_turns",
    "measure_codec",
    "measure_codecs",
    "measure_copy",
    "measure_core_copy",
    "measure_fixed_costs",
    "measure_network",
    "median_time",
    "register_distribute",
    "synchronize",
]

# bunsan.distribute, registered by bunsan.optim when it is imported: the probe of fixed costs builds
# its tiny models with it (this module is imported by the algorithms that bunsan.optim imports).
_distribute: Callable[..., Any] | None = None


def register_distribute(fn: Callable[..., Any]) -> None:
    """Give :func:`measure_fixed_costs` the function that makes a model data-parallel (``bunsan.distribute``)."""
    global _distribute
    _distribute = fn


# all-reduce message sizes in bytes: a latency-bound one, then bandwidth-bound ones
PROBE_SIZES = (4, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)
# a size whose first all-reduce took enough_s or longer is timed this many times (measure_network)
LONG_REPEATS = 2
# measure_network(enough_bytes=...): the job's own size is conclusive once its all-reduce takes this many
# times the smallest size's (the bandwidth term at least the latency's)
GROWTH = 2.0
# segments per timed call of the one-call codec (a bucket of a few dozen parameters; measure_codec)
SEGMENTS_PER_CALL = 64


def synchronize(device: torch.device | str | None) -> None:
    """Wait for ``device``'s queued work (a CUDA device's kernels and NCCL collectives; nothing on the CPU).

    A clock read on the host times a CUDA step's launches, not its work: the kernels run after
    the host returns, and an NCCL collective's ``wait()`` only orders the compute stream after it.
    """
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Any, repeats: int, device: torch.device | str | None = None) -> float:
    """Median seconds of ``repeats`` calls of ``fn()`` (on a CUDA ``device``: until its work is done)."""
    times = []
    synchronize(device)
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# the most elements measure_codec encodes and decodes whole (the per-element cost is flat past a few MB)
CODEC_NUMEL_CAP = 4_000_000

CODEC_FIELDS = (
    "encode_s_per_element",
    "decode_s_per_element",
    "codec_call_s",
    "encode_call_s",
    "decode_call_s",
    "cast_s_per_element",
    "copy_s_per_element",
)


def _codec_calls(quantizer: Any, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> tuple[Any, ...]:
    """``(encode, decode, one-call encode, one-call decode)`` of :func:`measure_codec`, each a callable
    over ``x``'s elements (the one-call pair over one chunk): as the exchange codes there, one call per
    bucket where it codes so (a GPU, replayed as CUDA graphs where it replays its calls), else the
    quantizer's own calls."""
    from bunsan.compression.segments import SegmentCodec

    numel, device = x.numel(), x.device
    payload = torch.empty(quantizer.payload_bytes(numel), dtype=torch.uint8, device=device)
    small = min(quantizer.chunk_size, numel)
    if coded_per_bucket(quantizer, device):
        # the exchange's own codec there (a GPU): one call for all of a bucket's segments, cut here
        # into SEGMENTS_PER_CALL as parameters cut a bucket (their count costs no extra call)
        length = -(-numel // SEGMENTS_PER_CALL)
        cuts, at = [], 0
        for lo in range(0, numel, length):
            cuts.append((lo, min(length, numel - lo), at))
            at += quantizer.payload_bytes(min(length, numel - lo))
        payload = torch.empty(at, dtype=torch.uint8, device=device)
        whole, one = SegmentCodec(quantizer, cuts, device), SegmentCodec(quantizer, [(0, small, 0)], device)
        # as the exchange runs them: replayed as CUDA graphs where it replays its calls
        graphs = CapturedCalls(device) if graphs_enabled(device) else None
        run = functools.partial(run_call, graphs)

        def encode_fn() -> None:
            run("encode", functools.partial(whole.encode, x, payload, residual), x, payload, residual)

        def decode_fn() -> None:
            run("decode", functools.partial(whole.decode, payload, out), payload, out)

        def encode_call_fn() -> None:
            run("encode_call", functools.partial(one.encode, x, payload, residual), x, payload, residual)

        def decode_call_fn() -> None:
            run("decode_call", functools.partial(one.decode, payload, out), payload, out)

    else:
        small_payload = payload[: quantizer.payload_bytes(small)]

        def encode_fn() -> None:
            quantizer.encode_with_feedback(x, residual, out=payload)

        def decode_fn() -> None:
            quantizer.decode(payload, numel, out=out)

        def encode_call_fn() -> None:
            quantizer.encode_with_feedback(x[:small], residual[:small], out=small_payload)

        def decode_call_fn() -> None:
            quantizer.decode(small_payload, small, out=out[:small])

    return encode_fn, decode_fn, encode_call_fn, decode_call_fn


def measure_codec(
    numel: int,
    bits: int = 1,
    *,
    repeats: int = 3,
    collective: bool = False,
    group: Any = None,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Seconds per element of encoding (with error feedback) and decoding ``numel`` float32 values, the
    fixed seconds of one encode call and of one decode call (``encode_call_s``, ``decode_call_s``: a
    one-chunk encode and decode, timed apart; ``codec_call_s`` their mean), and the seconds per element
    of a cast to float16 and
    back (``cast_s_per_element``), and of one float32 copy (``copy_s_per_element``: a pass over the
    parameters in memory, as async SGD's in-process exchange makes).

    ``collective``: every rank of ``group`` calls this at the same step and times the codec at
    the same moment (a barrier before each timing), and every rank returns the slowest rank's
    figures. A synchronous exchange encodes on every worker at once, so where workers share
    cores (4 on 2 in bunsan's benchmarks) each encoder runs at about half the speed it has
    alone. Timed by each rank on its own, the 8-bit codec of the 10.5M-parameter MLP at 4
    workers came out at 64 ms a step in one ``tools/predict.py`` run and 132 ms in
    another the same day (whether the ranks happened to time it together), and its 8- and
    1-bit steps were predicted up to 30% short (docs/experiments/plan.md); timed together, the codec
    runs as the job's exchange meets it. On separate cores or devices the two agree.

    ``device``: where the job's gradients are, so where its codec runs (default the CPU); on a
    GPU each timing waits for the device's kernels.
    """
    from bunsan.compression import Quantizer

    def timed(fn: Any, count: int) -> float:
        if collective:
            comm.barrier(group)
        return median_time(fn, count, device)

    device = torch.device(device if device is not None else "cpu")
    numel = max(1, min(numel, CODEC_NUMEL_CAP))  # per-element cost is flat past a few MB; spare the memory
    quantizer = Quantizer(bits)
    # not the global RNG: training's draws stay
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    residual = torch.zeros(numel, device=device)
    out = torch.empty(numel, device=device)
    encode_fn, decode_fn, encode_call_fn, decode_call_fn = _codec_calls(quantizer, x, residual, out)
    captured = coded_per_bucket(quantizer, device) and graphs_enabled(device)
    # warm up; each call that becomes a graph runs eagerly once and is captured the second time
    for fn in (encode_fn, decode_fn, encode_call_fn, decode_call_fn) if captured else (encode_fn,):
        fn()
        if captured:
            fn()
    encode = timed(encode_fn, repeats)
    decode = timed(decode_fn, repeats)
    # the fixed cost of one call of each kind: one small chunk's (an encode and its error feedback cost
    # several decodes: 2-3 on an H100, 4-5 for 2 bits on CPU)
    if not captured:
        encode_call_fn()
        decode_call_fn()
    encode_call = timed(encode_call_fn, max(repeats, 9))
    decode_call = timed(decode_call_fn, max(repeats, 9))
    half = torch.empty(numel, dtype=torch.float16, device=device)
    cast = timed(lambda: (half.copy_(x), out.copy_(half)), repeats)
    copy = timed(lambda: out.copy_(x), repeats)
    found = {
        "encode_s_per_element": max(0.0, encode - encode_call) / numel,
        "decode_s_per_element": max(0.0, decode - decode_call) / numel,
        "codec_call_s": (encode_call + decode_call) / 2,
        "encode_call_s": encode_call,
        "decode_call_s": decode_call,
        "cast_s_per_element": cast / numel,
        "copy_s_per_element": copy / numel,
    }
    if collective:  # every rank the slowest rank's figures
        slowest = torch.tensor([found[k] for k in CODEC_FIELDS], dtype=torch.float64, device=comm.tensor_device(group))
        comm.all_reduce(slowest, op="max", group=group)
        found = dict(zip(CODEC_FIELDS, slowest.tolist()))
        found["codec_call_s"] = (found["encode_call_s"] + found["decode_call_s"]) / 2  # of the slowest calls
    return found


def measure_copy(
    numel: int,
    *,
    repeats: int = 3,
    collective: bool = False,
    group: Any = None,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """``{"copy_s_per_element": s}``: one float32 copy of ``numel`` values (capped as
    :func:`measure_codec` caps them), per element, the slowest rank's where ``collective``: the one
    figure of :func:`measure_codec` that prices exact SGD and the block algorithms too (a block
    round's passes over the parameters), for a prediction that leaves the codec out."""
    device = torch.device(device if device is not None else "cpu")
    numel = max(1, min(numel, CODEC_NUMEL_CAP))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    out = torch.empty_like(x)
    out.copy_(x)  # warm: the first touch of fresh pages is not a copy's cost
    if collective:
        comm.barrier(group)
    found = torch.tensor(
        [median_time(lambda: out.copy_(x), repeats, device) / numel],
        dtype=torch.float64,
        device=comm.tensor_device(group) if collective else "cpu",
    )
    if collective:
        comm.all_reduce(found, op="max", group=group)
    return {"copy_s_per_element": float(found[0])}


def in_turns(fn: Callable[[], T], ranks_per_core: float, *, group: Any = None) -> T:
    """Collective: ``fn()`` on this rank with one rank per core running at once: the ranks of ``group``
    take ``ceil(ranks_per_core)`` turns by their rank modulo the turns (ranks numbered along one host,
    as ``tools/predict.py``'s are), the others waiting at a barrier; this rank's result.

    Where ranks share cores, what a rank does while the others wait on the network runs as fast as on
    a core of its own: async SGD's rank 0 worker beside remote workers in their round trips
    (:func:`measure_core_copy`, and ``tools/predict.py``'s compute per core,
    :attr:`bunsan.algorithms.cost_model.Profile.core_compute_s`)."""
    if not ranks_per_core >= 1:
        raise ValueError(f"ranks_per_core must be at least 1, got {ranks_per_core!r}")
    turns = math.ceil(ranks_per_core)
    mine = comm.get_rank(group)
    found: Any = None
    for turn in range(turns):  # every rank has one turn: mine % turns is one of them
        comm.barrier(group)
        if mine % turns == turn:
            found = fn()
    return found


def measure_core_copy(numel: int, ranks_per_core: float, *, repeats: int = 3, group: Any = None) -> dict[str, float]:
    """``{"core_copy_s_per_element": s}`` (collective): :func:`measure_copy` timed with one rank per
    core copying at once: the ranks of ``group`` take ``ceil(ranks_per_core)`` turns by their rank
    modulo the turns (ranks numbered along one host, as ``tools/predict.py``'s are), the others
    waiting at a barrier; every rank returns the slowest copy.

    :func:`measure_codec` times the copy with every rank at once, as a synchronous exchange meets
    it; where ranks share cores, a rank that copies while others wait on the network (async SGD's
    rank 0 worker beside remote workers in their round trips) copies as fast as a rank with a core
    of its own (:attr:`bunsan.algorithms.cost_model.Profile.core_copy_s_per_element`)."""
    check_int("numel", numel, minimum=1)
    found = in_turns(lambda: measure_copy(numel, repeats=repeats)["copy_s_per_element"], ranks_per_core, group=group)
    slowest = torch.tensor([found], dtype=torch.float64)
    comm.all_reduce(slowest, op="max", group=group)
    return {"core_copy_s_per_element": float(slowest[0])}


def measure_network(
    group: Any = None,
    *,
    sizes: Sequence[int] = PROBE_SIZES,
    repeats: int = 7,
    enough_s: float | None = None,
    enough_bytes: int | None = None,
) -> Network:
    """Collective: time all-reduces and all-gathers of ``sizes`` bytes and fit alpha and beta.

    Every rank times the same collectives; the median over ``repeats`` of the
    slowest rank (a collective ends when its last rank is done) is fitted.
    ``enough_s``: stop at the first size (the second or later of ``sizes``, taken
    smallest first) whose all-reduce took at least this long. Such a message is
    already far past the latency (0.06-0.4 ms here), so larger ones add no
    information on beta, only time: on a 100 Mbit/s link one 1 MiB all-reduce at
    4 workers takes 0.13 s and this measurement timed 11 of them. Every rank stops
    at the same size (the slowest rank's time decides). With ``enough_s``, a size
    past the first whose untimed first all-reduce already took that long on the
    slowest rank is timed ``min(repeats, LONG_REPEATS)`` times, its float16
    all-reduce too: a collective of tens of ms moves little from call to call (the
    fitted bandwidth at 100 Mbit/s moved as much with 2 repeats as with 3), and on a
    slow link each repeat costs that long: 0.19 s instead of 0.25 for the probe at 2
    workers, 0.28 instead of 0.38 at 4 (docs/experiments/plan.md).

    ``enough_bytes`` (with ``enough_s``): the job's own message (its gradient's bytes): also stop
    before a size that would take ``enough_s`` or longer, by the time of the last size grown in
    proportion, once that last size has at least ``enough_bytes`` and its all-reduce took
    :data:`GROWTH` times the smallest size's or longer. The fit then runs through the latency
    and the job's own size, which is what the job sends (every exchange of bunsan's sends at
    most its gradient's bytes), and the bandwidth term is already as large as the latency's;
    the larger size would only cost its time. On a 100 Mbit/s link MNIST-1D's CNN (32 KB of
    gradient) probed 256 KB as well, 0.18-0.30 s of a first epoch of 0.4-0.7 s. Where the next
    size is cheap (loopback, fast links) it is still probed: a small message's time there is
    mostly the scheduling of the ranks (4 processes on 2 cores fitted 0.1 Gbit/s from 4 bytes
    and 32 KB on loopback), and a larger one fits the bandwidth.
    """
    check_int("enough_bytes", enough_bytes, minimum=1, allow_none=True, hint="the job's gradient bytes")
    n = comm.get_world_size(group)
    device = comm.tensor_device(group)  # NCCL's probe moves GPU memory, as the job's exchange does
    reduce_points: list[tuple[int, float]] = []
    gather_points: list[tuple[int, float]] = []
    sizes = sorted(sizes)
    timed_repeats = repeats
    for nbytes in sizes:
        if enough_s is not None and len(reduce_points) >= 2 and reduce_points[-1][1] >= enough_s:
            break
        if (
            enough_bytes is not None
            and enough_s is not None
            and len(reduce_points) >= 2
            and reduce_points[-1][0] >= enough_bytes
            and reduce_points[-1][1] >= GROWTH * reduce_points[0][1]
            and reduce_points[-1][1] * nbytes / reduce_points[-1][0] >= enough_s
        ):
            break
        numel = max(1, nbytes // 4)
        tensor = torch.ones(numel, device=device)
        piece = torch.ones(max(1, numel // n), device=device)
        gathered = torch.empty(piece.numel() * n, device=device)
        synchronize(device)
        first_s = time.perf_counter()
        comm.all_reduce(tensor, group=group)  # warm up this size's buffers
        synchronize(device)
        first_s = time.perf_counter() - first_s
        comm.all_gather_into(gathered, piece, group=group)
        timed_repeats = repeats
        if enough_s is not None and reduce_points:  # not the latency point; the slowest rank's first call decides
            first = torch.tensor([first_s], dtype=torch.float64, device=device)
            comm.all_reduce(first, op="max", group=group)
            if float(first[0]) >= enough_s:
                timed_repeats = min(repeats, LONG_REPEATS)
        comm.barrier(group)
        reduce_s = median_time(functools.partial(comm.all_reduce, tensor, group=group), timed_repeats, device)
        comm.barrier(group)
        gather = functools.partial(comm.all_gather_into, gathered, piece, group=group)
        gather_s = median_time(gather, timed_repeats, device)
        slowest = torch.tensor([reduce_s, gather_s], dtype=torch.float64, device=device)
        comm.all_reduce(slowest, op="max", group=group)
        reduce_points.append((numel * 4, float(slowest[0])))
        gather_points.append((piece.numel() * 4, float(slowest[1])))
    network = network_from_timings(reduce_points, n, gather_points)
    # float16 at the largest size: Gloo reduces half precision in software on CPU
    halves = torch.ones(max(1, reduce_points[-1][0] // 2), dtype=torch.float16, device=device)
    comm.all_reduce(halves, group=group)
    comm.barrier(group)
    half_s = torch.tensor(
        [median_time(lambda: comm.all_reduce(halves, group=group), timed_repeats, device)],
        dtype=torch.float64,
        device=device,
    )
    comm.all_reduce(half_s, op="max", group=group)
    wire_s = float(half_s[0]) - 2 * (n - 1) * network.latency_s
    if wire_s > 0:
        network = replace(network, half_bandwidth=ring_allreduce_bytes(halves.numel() * 2, n) / wire_s)
    return network


def measure_codecs(
    numel: int,
    bits: Sequence[int],
    *,
    repeats: int = 3,
    collective: bool = False,
    group: Any = None,
    device: torch.device | str | None = None,
) -> tuple[tuple[int, float, float, float, float, float], ...]:
    """:func:`measure_codec` at each width of ``bits``, as :attr:`bunsan.algorithms.cost_model.Profile.codecs`
    (``collective``: as there, every rank at once, the slowest rank's figures)."""
    found = []
    for b in sorted(set(bits)):
        codec = measure_codec(numel, b, repeats=repeats, collective=collective, group=group, device=device)
        found.append(
            (
                b,
                codec["encode_s_per_element"],
                codec["decode_s_per_element"],
                codec["codec_call_s"],
                codec["encode_call_s"],
                codec["decode_call_s"],
            )
        )
    return tuple(found)


def can_overlap(
    device: torch.device | str = "cpu", local_workers: int | None = None, *, over_memory: bool = True
) -> bool:
    """Whether a worker's exchange can run beside its compute without slowing it.

    Yes on a GPU, and on CPU where the exchange waits on a network (``over_memory=False``:
    the backend's thread mostly waits for the wire) or where every local worker has a
    second core. Not when the exchange travels through memory (all workers on one host:
    loopback, shared memory) with one core per worker: the backend's thread does the
    copies and sums on the core of the compute, so an overlapped exchange still adds its
    time to the step (measured: ``tools/predict.py``, docs/experiments/plan.md).
    """
    if torch.device(device).type != "cpu" or not over_memory:
        return True
    if local_workers is None:
        from bunsan import runtime

        local_workers = runtime.local_size()
    from bunsan.launch.hosts import usable_cores

    return usable_cores() >= 2 * local_workers


FIXED_COST_BATCH = 32  # samples a step of measure_fixed_costs's tiny model (its blocks' steps follow)


def measure_fixed_costs(
    candidates: Sequence[Any],
    network: Network,
    *,
    group: Any = None,
    overlap: bool | None = None,
    steps: int = 10,
    repeats: int = 3,
    warmup: int | None = None,
    distribute: Callable[..., Any] | None = None,
    spare_core: bool | None = None,
    filler: Callable[[], Any] | None = None,
) -> tuple[tuple[str, float], ...]:
    """Collective: each candidate's step on a tiny model, less the local step and what the model predicts.

    The cost model (:mod:`bunsan.algorithms.cost_model`) counts bytes, latency, codec
    and overlap. What a real framework's step also costs (gradient hooks, per-step
    bookkeeping, waking the backend's threads: 1.5 ms per exact step at 2 workers on
    the 2-core machine of the docs, against a fitted latency of 0.06-0.1 ms) shows on a
    model whose compute and bytes are almost nil: a linear layer of 4 to 2. Every rank
    of ``group`` runs every candidate (the same list on every rank) with the overlap
    rule of :func:`can_overlap` (or ``overlap``); the slowest rank's median is kept, so every rank gets
    the same answer; a block algorithm's is per block (the excess per step times the
    block's steps). Each candidate takes ``warmup`` steps untimed (``None``: ``steps``),
    then ``repeats`` timed runs of ``steps`` steps; keep both multiples of a block
    algorithm's steps per block so that every run holds whole blocks. The global random
    state is left as it was. ``distribute``:
    ``bunsan.distribute`` (by default the one :mod:`bunsan.optim` registered). Returns
    :attr:`bunsan.algorithms.cost_model.Profile.fixed_s`.

    Async SGD's workers step at different rates (rank 0's reaches the server in-process), so it gets
    two entries (:func:`bunsan.algorithms.async_model.async_fixed_labels`): rank 0's worker's step and
    the remote workers' mean step, each less the model's prediction for that side
    (:func:`bunsan.algorithms.async_model.async_rank_steps`, with ``spare_core`` as the job's).

    ``filler``: a compute run on every rank before each step, the local one's as every
    candidate's (a step of the job's own model, with no communication): the tiny model's
    exchange then starts as a job's does, after a compute. Without it, the exchange of back-to-back
    tiny steps cost 1.2-1.3 ms at 2 workers on loopback, 2.0-2.1 ms after each a backward of the
    MNIST-1D CNN (``docs/experiments/step_overhead.py``), which the MNIST-1D rows at 2 workers
    missed by 13-17% on ten runs' means. The filler's own wait for the slowest rank is priced as the
    job's is: the local steps (filler and tiny step) timed one by one on every rank give the tiny
    profile's compute and straggler (:func:`bunsan.algorithms.cost_model.compute_with_stragglers`),
    so that the excess holds only what the model does not price. Timed so in every round of
    ``tools/predict.py`` (its ``predicted_filled_s``), it priced the two small CNNs' rows no
    better than the tiny model alone (docs/experiments/plan.md, "A faster machine"): Auto does not use it.
    """
    import torch.nn.functional as F

    from bunsan import runtime

    distribute = distribute or _distribute
    if distribute is None:
        raise RuntimeError("measure_fixed_costs needs bunsan.distribute: pass it, or import bunsan.optim first")
    n = comm.get_world_size(group)
    device = comm.tensor_device(group)  # the tiny models live where the job's gradients do
    if overlap is None:
        local_workers = runtime.local_size()
        overlap = can_overlap(device, local_workers, over_memory=local_workers == runtime.size())
    x = torch.randn(FIXED_COST_BATCH, 4, generator=torch.Generator().manual_seed(0)).to(device)
    y = torch.randint(0, 2, (FIXED_COST_BATCH,), generator=torch.Generator().manual_seed(1)).to(device)

    def run(model: Any, optimizer: Any, count: int = steps) -> None:
        for _ in range(count):
            if filler is not None:
                filler()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    def timed(model: Any, optimizer: Any) -> float:
        run(model, optimizer, steps if warmup is None else warmup)  # warm up
        comm.barrier(group)
        return median_time(functools.partial(run, model, optimizer), repeats, device) / steps

    fixed: list[tuple[str, float]] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        local_model = torch.nn.Linear(4, 2).to(device)
        local_sgd = torch.optim.SGD(local_model.parameters(), lr=1e-3)
        if filler is None:
            local = torch.tensor([timed(local_model, local_sgd)], dtype=torch.float64, device=device)
            comm.all_reduce(local, op="max", group=group)  # the same on every rank, as the steps below
            profile = _tiny_profile(compute_s=float(local[0]))
        else:  # every local step timed on its own: the compute and its straggler, as the job's are priced
            run(local_model, local_sgd, steps if warmup is None else warmup)
            comm.barrier(group)
            compute_s, straggler_s = _local_steps(
                functools.partial(run, local_model, local_sgd, 1), repeats * steps, n, device, group
            )
            profile = _tiny_profile(compute_s=compute_s, straggler_s=straggler_s)
        for candidate in candidates:
            torch.manual_seed(0)
            tiny = torch.nn.Linear(4, 2).to(device)
            sgd = torch.optim.SGD(tiny.parameters(), lr=1e-3 / (n if candidate.algorithm == "async" else 1))
            model, optimizer = distribute(tiny, sgd, candidate.algorithm, group=group, **dict(candidate.options))
            step_s = timed(model, optimizer)
            optimizer.join()
            fixed += _excess(candidate, step_s, profile, network, n, overlap, spare_core, device, group)
    return tuple(fixed)


def _tiny_profile(compute_s: float, straggler_s: float = 0.0) -> Any:
    """The cost model's profile of :func:`measure_fixed_costs`'s tiny model (a linear layer of 4 to 2)."""
    from bunsan.algorithms import cost_model as cm

    return cm.Profile(
        compute_s=compute_s, params=10, batch=FIXED_COST_BATCH, tensors=2, chunks=2, straggler_s=straggler_s
    )


def _local_steps(step: Callable[[], None], count: int, n: int, device: Any, group: Any) -> tuple[float, float]:
    """Collective: ``count`` local steps timed one by one on every rank, gathered; ``(mean compute, straggler)``
    (:func:`bunsan.algorithms.cost_model.compute_with_stragglers`)."""
    from bunsan.algorithms import cost_model as cm

    local_steps = []
    for _ in range(count):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        local_steps.append(time.perf_counter() - start)
    mine = torch.tensor(local_steps, dtype=torch.float64, device=device)
    every = torch.empty(n * mine.numel(), dtype=torch.float64, device=device)
    comm.all_gather_into(every, mine, group=group)
    return cm.compute_with_stragglers(every.view(n, -1).tolist())


def _excess(
    candidate: Any,
    step_s: float,
    profile: Any,
    network: Network,
    n: int,
    overlap: bool,
    spare_core: bool | None,
    device: Any,
    group: Any,
) -> list[tuple[str, float]]:
    """Collective: ``candidate``'s :attr:`~bunsan.algorithms.cost_model.Profile.fixed_s` entries from this
    rank's timed step: the slowest rank's step less the model's prediction (per block for a block
    algorithm); async SGD's two sides apart."""
    from bunsan.algorithms import cost_model as cm

    if candidate.algorithm == "async" and n > 1:  # rank 0's worker's excess and the remote workers'
        from bunsan.algorithms import async_model  # only plan's campaign probes async; Auto never does

        every = torch.zeros(n, dtype=torch.float64, device=device)
        every[comm.get_rank(group)] = step_s
        comm.all_reduce(every, group=group)
        _, own, remote = async_model.async_rank_steps(
            profile, network, candidate, n, overlap=overlap, spare_core=spare_core
        )
        own_label, remote_label = async_model.async_fixed_labels(candidate.label)
        return [(own_label, float(every[0]) - own), (remote_label, float(every[1:].mean()) - remote)]
    slowest = torch.tensor([step_s], dtype=torch.float64, device=device)
    comm.all_reduce(slowest, op="max", group=group)
    predicted = cm.predict(profile, network, candidate, n, overlap=overlap)
    excess = float(slowest[0]) - predicted.step_s
    if candidate.algorithm in ("block_momentum", "model_averaging"):  # per block: its steps
        excess *= cm.block_steps(int(candidate.options.get("block_size", 1024)), profile.batch)
    return [(candidate.label, excess)]
