"""Predicted step time of the synchronous algorithms: pure functions of a profile and a network.

No torch and no process group here: :mod:`bunsan.bench.plan` (``bunsan plan``) and
``algorithm="auto"``, which decides at run time, use the same arithmetic, and tests check it
against values worked out by hand. Asynchronous SGD and ranks that share cores, which only
``bunsan plan`` and the model's validation price, are :mod:`bunsan.algorithms.async_model`'s,
built on this one (nothing here imports it). The records priced and returned are
:mod:`bunsan.algorithms.cost_inputs`'.

The network and the collectives' costs are in :mod:`bunsan.algorithms.network_model`
(Hockney's alpha-beta model, ring all-reduce, the striped quantized exchange). On top:

* **overlap with backward** (exact and quantized buckets): gradients become ready
  during backward, last layers first; a bucket's exchange starts when its last
  gradient is ready and the previous bucket's exchange has finished (buckets go in
  the same order on every rank). Only what runs past the end of backward adds to
  the step: :func:`exposed_communication`. Gradients are taken to become ready at
  an even rate in bytes over the backward pass.
* **block algorithms** (``BlockMomentumSGD``, ``ModelAveragingSGD``; Chen and Huo
  2016): one all-reduce of the parameters (float32) per block of ``k`` local
  steps, not overlapped, so ``(all-reduce + block update) / k`` per step.
Scaling efficiency is ``compute / step``: the step time of one worker alone over
the step time at ``N`` with the same per-worker work (with a fixed global batch the
caller divides the compute by ``N`` first, :meth:`Profile.at_workers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from bunsan._validate import check_int
from bunsan.algorithms.cost_inputs import ALGORITHMS, Candidate, Prediction, Profile
from bunsan.algorithms.network_model import (
    DEFAULT_CHUNK_SIZE,
    Network,
    allgather_time,
    alltoall_time,
    burst_credit,
    fit_line,
    network_from_timings,
    quantized_payload_bytes,
    ring_allreduce_bytes,
    ring_allreduce_time,
    stripe_bytes,
    striped_exchange_bytes,
    striped_exchange_time,
)

__all__ = [
    "ALGORITHMS",
    "BLOCK_ROUND_PASSES",
    "NESTEROV_START_PASSES",
    "Candidate",
    "Network",
    "Prediction",
    "Profile",
    "allgather_time",
    "alltoall_time",
    "block_round_passes",
    "block_steps",
    "bucket_sizes",
    "burst_credit",
    "codec_call_counts",
    "codec_calls",
    "codec_elements",
    "compute_with_stragglers",
    "exact_released_together",
    "exposed_communication",
    "fit_line",
    "mean_call_profile",
    "network_from_timings",
    "predict",
    "quantized_payload_bytes",
    "ring_allreduce_bytes",
    "ring_allreduce_time",
    "stripe_bytes",
    "striped_exchange_bytes",
    "striped_exchange_time",
]

FIRST_BUCKET_BYTES = 2**20  # DataParallelSGD's small first bucket
DEFAULT_BUCKET_BYTES = 25 * 2**20  # DataParallelSGD(bucket_size_mb=25)
# Passes over the parameters in memory per round of a block algorithm
# (bunsan.algorithms.blockwise.BlockwiseSGD._block_round), in float32 copies, counted in its code by
# the elements each operation moves through memory: what it reads, and what it writes twice (the
# processor reads a line before writing it, unless the operation read it already), so a copy moves
# 3 elements per element and is the unit. Pack the parameters into the flat buffer (a copy, 3),
# subtract the block's start (in place: reads two, writes one, 3), divide by N (2), the filter
# D = bm D + zeta G (2 + 3) and W += D (3), the next start as a copy of W (3), unpack it into the
# parameters (3): 22 / 3 = 7.33. A Nesterov start (W + bm D into the start, block momentum's
# default) reads two tensors and writes a third: 4, one more. A test counts them in the operations
# a round dispatches. Timed in the job, the passes of a round on the 10.5M MLP at 2 workers on 2
# cores took 20-39 ms of a 63-96 ms round, as long as its all-reduce: 5.9-14.2 copies, each copy
# timed at another moment (this machine's memory bandwidth moves 2x within the hour; docs/experiments/plan.md,
# "What a block costs beside its all-reduce").
BLOCK_ROUND_PASSES = 22 / 3
NESTEROV_START_PASSES = 1 / 3


# -- overlap with backward ----------------------------------------------------------------------
def bucket_sizes(
    total_bytes: int, cap_bytes: int = DEFAULT_BUCKET_BYTES, first_bytes: int = FIRST_BUCKET_BYTES
) -> list[int]:
    """Bytes of each bucket in launch order: a small first bucket, then buckets of ``cap_bytes``, the rest last.

    (DataParallelSGD closes a bucket at a parameter boundary once it reaches the cap; parameter sizes
    are not known here, so the cut is at the byte.)
    """
    sizes: list[int] = []
    left = total_bytes
    limit = min(first_bytes, cap_bytes)
    while left > 0:
        size = min(limit, left)
        sizes.append(size)
        left -= size
        limit = cap_bytes
    return sizes


def exposed_communication(
    forward_s: float, backward_s: float, buckets: Sequence[float], exchange_s: Callable[[float], float]
) -> float:
    """Seconds the bucketed exchange runs past the end of backward.

    Bucket ``i`` (``buckets[i]`` bytes, launch order) is ready once backward has
    produced the bytes of buckets ``0..i`` (an even rate over ``backward_s``); its
    exchange, ``exchange_s(bytes)`` seconds, starts when it is ready and the previous
    one is done.
    """
    total = sum(buckets)
    if total <= 0:
        return 0.0
    end_backward = forward_s + backward_s
    done = ready = 0.0
    produced = 0.0
    for size in buckets:
        produced += size
        ready = forward_s + backward_s * produced / total
        done = max(done, ready) + exchange_s(size)
    return max(0.0, done - end_backward)


def compute_with_stragglers(times: Sequence[Sequence[float]]) -> tuple[float, float]:
    """``(mean compute, straggler)`` from ``times[rank][step]``, the step times of every worker.

    The mean is over all workers and steps; the straggler is the mean over steps
    of the slowest worker's time, less that mean: what a synchronous step waits.
    """
    if not times or not times[0] or any(len(t) != len(times[0]) for t in times):
        raise ValueError("need the same number of step times (at least one) from every worker")
    steps = len(times[0])
    mean = sum(sum(t) for t in times) / (len(times) * steps)
    slowest = sum(max(t[i] for t in times) for i in range(steps)) / steps
    return mean, slowest - mean


def codec_call_counts(tensors: int, buckets: int, workers: int, per_bucket: bool = False) -> tuple[float, float]:
    """``(encode calls, decode calls)`` per step of the striped exchange.

    Each segment coded on its own (CPU): a stripe cut meets about ``S = tensors + workers``
    segments per bucket (:func:`bunsan.algorithms.data_parallel.plan_stripes` cuts at
    parameter and stripe ends): encode all of them (``T + B N``), decode the received ones
    (``T + B N``), encode the own stripe (``T / N + B``), decode the gathered ones (``T + B N``):
    ``T + B N + T / N + B`` encodes and ``2 (T + B N)`` decodes; at 2 workers no owner
    re-encodes its sum (:meth:`~bunsan.algorithms.data_parallel.quantized.QuantizedExchange._finish_two_ranks`
    sends each rank's first payload of the owned stripe instead, at the same bytes): ``T + B N``
    encodes, and each segment's two payloads decoded into their sum, ``2 (T + B N)``. ``per_bucket``
    (:class:`bunsan.compression.segments.SegmentCodec`, a GPU): per bucket one encode, one
    decode of every rank's payload of the own stripe, one encode of their sum and one decode
    of the gathered stripes, ``2 B`` each; at 2 workers one encode and four decodes (each
    rank's payload of each stripe).
    """
    if workers <= 1:
        return 0.0, 0.0
    if per_bucket:
        return (1.0 * buckets, 4.0 * buckets) if workers == 2 else (2.0 * buckets, 2.0 * buckets)
    segments = tensors + buckets * workers
    if workers == 2:  # no owner's second quantization
        return float(segments), 2.0 * segments
    return segments + tensors / workers + buckets, 2.0 * segments


def codec_elements(params: int, workers: int) -> tuple[float, float]:
    """``(elements encoded, elements decoded)`` per step of the striped exchange of ``params`` gradients.

    Every element is encoded once for its stripe's owner, and the owner encodes its summed stripe
    again (``params / workers``), but at 2 workers, where each rank sends its first payload of the
    stripe it owns instead (no second quantization, at the same bytes:
    ``QuantizedExchange._finish_two_ranks`` and ``_pair_batched``); every rank decodes the
    ``workers`` payloads of its stripe and then the gathered stripes (2 workers: each stripe's two
    payloads into their sum), ``2 params`` either way. Priced at 1.5 ``params`` encodes at 2
    workers before, the CPU's 8-bit rows at 2 workers came out 10-34% over the measured step
    (the 10.5M MLP's and MNIST-1D's, docs/experiments/plan.md "Checking the predictions")."""
    if workers <= 1:
        return 0.0, 0.0
    return params * (1 + (1 / workers if workers > 2 else 0.0)), 2.0 * params


def mean_call_profile(profile: Profile, timed_numel: int) -> Profile:
    """``profile`` as the model priced it before encode and decode calls were timed apart: every call
    at their mean (``codec_call_s``), and each per-element cost net of that mean instead of its own
    call. ``timed_numel``: the elements of the whole encode and decode that measured the per-element
    costs (:func:`bunsan.algorithms.measure.measure_codec` caps it at ``CODEC_NUMEL_CAP``). For checks
    that compare both models on one measured profile (``tools/predict.py``,
    ``docs/experiments/gpu_codec_calibration.py``); a profile without the split comes back unchanged."""

    def renet(per_element: float, own_call: float, mean: float) -> float:
        return max(0.0, per_element * timed_numel + own_call - mean) / timed_numel

    codecs = []
    for entry in profile.codecs:
        if len(entry) == 6:  # the mean from the two calls (the entry's own mean field may be stale or 0)
            bits, encode, decode, _, encode_call, decode_call = entry
            mean = (float(encode_call) + float(decode_call)) / 2
            entry = (bits, renet(encode, encode_call, mean), renet(decode, decode_call, mean), mean)
        codecs.append(entry)
    fields: dict[str, Any] = {"codecs": tuple(codecs), "encode_call_s": None, "decode_call_s": None}
    if profile.encode_call_s is not None and profile.decode_call_s is not None:
        mean = (profile.encode_call_s + profile.decode_call_s) / 2
        fields["codec_call_s"] = mean
        fields["encode_s_per_element"] = renet(profile.encode_s_per_element, profile.encode_call_s, mean)
        fields["decode_s_per_element"] = renet(profile.decode_s_per_element, profile.decode_call_s, mean)
    return replace(profile, **fields)


def codec_calls(tensors: int, buckets: int, workers: int, per_bucket: bool = False) -> float:
    """Encode and decode calls per step of the striped exchange, together (:func:`codec_call_counts`):
    ``3 (T + B N) + T / N + B`` coded per segment, ``4 B`` per bucket (``5 B`` at 2 workers)."""
    return sum(codec_call_counts(tensors, buckets, workers, per_bucket))


# -- the algorithms -----------------------------------------------------------------------------
def block_round_passes(candidate: Candidate) -> float:
    """Passes over the parameters (float32 copies' worth of memory traffic) one round of the block
    algorithm ``candidate`` makes beside its all-reduce: :data:`BLOCK_ROUND_PASSES`, and
    :data:`NESTEROV_START_PASSES` more for block momentum with a Nesterov start (its default,
    ``options["nesterov"]``)."""
    if candidate.algorithm not in ("block_momentum", "model_averaging"):
        raise ValueError(f"block_round_passes is for block_momentum and model_averaging, got {candidate.algorithm!r}")
    nesterov = candidate.algorithm == "block_momentum" and bool(candidate.option("nesterov", True))
    return BLOCK_ROUND_PASSES + (NESTEROV_START_PASSES if nesterov else 0.0)


def block_steps(block_size: int, batch: int) -> int:
    """Local steps per block: ``block_size`` samples per worker over ``batch`` samples per step (at least 1)."""
    return max(1, math.ceil(block_size / batch))


def predict(
    profile: Profile,
    network: Network,
    candidate: Candidate,
    workers: int,
    *,
    overlap: bool = True,
) -> Prediction:
    """The predicted step of the synchronous ``candidate`` at ``workers`` workers (the profile is per
    worker at that count).

    Options read from ``candidate.options``: ``bits``, ``compression`` (``"fp16"``/``"bf16"``),
    ``chunk_size``, ``bucket_size_mb`` (data_parallel); ``block_size`` (samples per worker, block
    algorithms). ``overlap=False`` puts every bucketed exchange after backward (as in a framework
    that reduces after the whole backward pass, or where the exchange needs the compute's own core:
    :func:`bunsan.algorithms.measure.can_overlap`).

    Raises:
        ValueError: ``candidate`` is async SGD, which :func:`bunsan.algorithms.async_model.predict` prices.
    """
    check_int("workers", workers, minimum=1)
    if candidate.algorithm == "data_parallel":
        return _predict_data_parallel(profile, network, candidate, workers, overlap)
    if candidate.algorithm in ("block_momentum", "model_averaging"):
        return _predict_block(profile, network, candidate, workers)
    raise ValueError(
        f"the synchronous cost model prices {', '.join(a for a in ALGORITHMS if a != 'async')}, not "
        f"{candidate.algorithm!r}: use bunsan.algorithms.async_model.predict"
    )


def _predict_data_parallel(
    profile: Profile, network: Network, candidate: Candidate, n: int, overlap: bool
) -> Prediction:
    """:func:`predict` of ``DataParallelSGD``: bucketed exchanges overlapped with backward, exact, half
    precision or quantized."""
    options = candidate.options
    compute = profile.compute_s
    bits = int(candidate.option("bits", 32))
    forward = compute * (1 - profile.backward_fraction)
    backward = compute * profile.backward_fraction
    cap = int(float(candidate.option("bucket_size_mb", DEFAULT_BUCKET_BYTES / 2**20)) * 2**20)
    # Buckets are cut in gradient bytes, whatever travels (DataParallelSGD fills them before compressing).
    buckets = bucket_sizes(profile.gradient_bytes, cap, min(FIRST_BUCKET_BYTES, cap))
    exchange: Callable[[float], float]
    if bits == 32:
        half = options.get("compression") in ("fp16", "bf16")
        element = 2 if half else profile.bytes_per_element
        ratio = element / profile.bytes_per_element
        wire = network
        if half and network.half_bandwidth is not None:
            wire = replace(network, bandwidth=network.half_bandwidth)

        def allreduce(size: float) -> float:
            return ring_allreduce_time(size * ratio, n, wire)

        exchange = allreduce
        sent = ring_allreduce_bytes(profile.params * element, n) if n > 1 else 0.0
        codec = profile.cast_s_per_element * profile.params if half and n > 1 else 0.0
        rate = wire.bandwidth
    else:
        exchange, sent, codec = _quantized_exchange(profile, network, candidate, n, buckets)
        rate = network.gather_beta
    communication = sum(exchange(b) for b in buckets) if n > 1 else 0.0
    if n == 1:
        exposed = 0.0
    elif overlap:
        exposed = exposed_communication(forward, backward, buckets, exchange)
    else:
        exposed = communication
    # a token-bucket link refilled while it idled passes its burst at once (network_model): during the
    # compute and the step's own costs off the wire (the wait for the slowest rank, the fixed costs:
    # where the compute is short, as MNIST-1D's 0.7 ms, they refill more than the compute alone)
    straggler = profile.straggler_s
    if exact_released_together(profile, candidate, n, overlap):
        straggler = float(profile.synced_straggler_s or 0.0)
    wait = (straggler + profile.fixed(candidate.label)) if n > 1 else 0.0
    exposed = max(0.0, exposed - burst_credit(network, sent, compute + max(0.0, wait), rate)) if n > 1 else 0.0
    return Prediction(
        candidate.label, n, compute, compute + wait + exposed + codec, communication, wait + exposed, codec, sent
    )


def _quantized_exchange(
    profile: Profile, network: Network, candidate: Candidate, n: int, buckets: Sequence[int]
) -> tuple[Callable[[float], float], float, float]:
    """``(seconds of a bucket's exchange, bytes sent a step, codec seconds a step)`` of the striped
    quantized exchange at ``candidate``'s bits."""
    bits = int(candidate.option("bits", 32))
    chunk = int(candidate.option("chunk_size", DEFAULT_CHUNK_SIZE))
    total = profile.gradient_bytes

    def bucket_chunks(size: float) -> int | None:
        # the model's chunk count, shared among buckets by size (only known for chunks of 512)
        if profile.chunks is None or chunk != DEFAULT_CHUNK_SIZE:
            return None
        return max(1, round(profile.chunks * size / total))

    def exchange(size: float) -> float:
        return striped_exchange_time(
            int(size // profile.bytes_per_element), bits, n, network, chunk, bucket_chunks(size)
        )

    sent = sum(
        striped_exchange_bytes(int(b // profile.bytes_per_element), bits, n, chunk, bucket_chunks(b)) for b in buckets
    )
    encode_s, decode_s, encode_call_s, decode_call_s = profile.codec(bits)
    encodes, decodes = codec_call_counts(profile.tensors, len(buckets), n, profile.codec_per_bucket)
    encoded, decoded = codec_elements(profile.params, n)
    codec = (
        0.0 if n == 1 else (encode_s * encoded + decode_s * decoded + encode_call_s * encodes + decode_call_s * decodes)
    )
    # the step's (samples, active ranks) count travels in a small all-reduce of its own
    codec += ring_allreduce_time(16, n, network)
    return exchange, sent, codec


def _predict_block(profile: Profile, network: Network, candidate: Candidate, n: int) -> Prediction:
    """:func:`predict` of the block algorithms: one all-reduce of the parameters and the round's own work
    per block of ``k`` local steps, not overlapped."""
    compute = profile.compute_s
    k = block_steps(int(candidate.option("block_size", 1024)), profile.batch)
    nbytes = profile.gradient_bytes  # parameters are averaged in their own dtypes
    communication = ring_allreduce_time(nbytes, n, network)
    # the round's own passes over the parameters: timed where given, else counted at a copy's cost
    per_element = profile.update_s_per_element or block_round_passes(candidate) * profile.copy_s_per_element
    update = per_element * profile.params if n > 1 else 0.0
    wait = profile.straggler_s * math.sqrt(k) if n > 1 else 0.0
    fixed = profile.fixed(candidate.label) if n > 1 else 0.0  # per block
    # a token-bucket link refills while it idles: over the block's k steps of compute and the round's
    # own costs before its bytes leave
    idle = k * compute + max(0.0, update + wait + fixed)
    credit = burst_credit(network, ring_allreduce_bytes(nbytes, n), idle) if n > 1 else 0.0
    exposed = (communication - credit + update + wait + fixed) / k
    sent = ring_allreduce_bytes(nbytes, n) / k
    return Prediction(candidate.label, n, compute, compute + exposed, communication / k, exposed, 0.0, sent)


def exact_released_together(profile: Profile, candidate: Candidate, workers: int, overlap: bool) -> bool:
    """Whether ``candidate`` is exact (data parallel, full precision: one collective a step) at ``workers``
    ranks sharing cores (``ranks_per_core`` above 1) over a link (``overlap``: not through memory) with
    :attr:`Profile.synced_straggler_s` timed: its step then waits that straggler, not ``straggler_s``.

    At 4 ranks on 2 cores over loopback, exact's ranks leave their exchange a time slice apart (about 7
    ms for the digits CNN) and two compute while two wait (``docs/experiments/exact_stagger.py``): the
    step pays the wait of steps run free. Over a shaped link the same step's exchange is bound by the
    wire, which releases every rank at once, and their computes start together: the digits CNN's exact
    at 1 Gbit/s stepped in 32.0 ms, as on loopback (31.2 ms), where a 15.5 ms exchange on top of
    loopback's step had priced it +36% in bunsan's validation runs (docs/experiments/predict/)."""
    if workers <= 1 or not overlap or profile.ranks_per_core <= 1 or profile.synced_straggler_s is None:
        return False
    options = candidate.options
    return (
        candidate.algorithm == "data_parallel"
        and int(candidate.option("bits", 32)) == 32
        and options.get("compression") not in ("fp16", "bf16")
    )
