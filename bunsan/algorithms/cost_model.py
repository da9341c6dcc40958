"""Predicted step time of every bunsan algorithm: pure functions of a profile and a network.

No torch and no process group here: :mod:`bunsan.bench.plan` (``bunsan plan``) and
an algorithm that decides at run time use the same arithmetic, and tests check it
against values worked out by hand.

The network is Hockney's alpha-beta model (Hockney 1994, "The communication
challenge for MPP: Intel Paragon and Meiko CS-2"): sending ``m`` bytes over one
link takes ``alpha + m / beta``. On top of it:

* **ring all-reduce** of ``M`` bytes over ``N`` ranks (Patarasuk and Yuan 2009,
  "Bandwidth optimal all-reduce algorithms for clusters of workstations"): a
  reduce-scatter and an all-gather of ``N - 1`` steps each, every step moving
  ``M / N`` bytes, so ``2 (N - 1) / N * M / beta + 2 (N - 1) alpha``. Each rank
  sends ``2 (N - 1) / N * M`` bytes, the figure ``algorithm.stats()`` counts.
* **striped quantized exchange** (``DataParallelSGD(bits=1..16)``): rank ``j``
  owns stripe ``j`` of the gradient. An all-to-all sends every other owner its
  quantized stripe (``N - 1`` messages of ``P`` bytes, ``P`` the quantized size of
  ``M / N`` elements), the owners sum and re-quantize, and an all-gather of the
  owners' stripes (``N - 1`` more) completes it: ``2 (N - 1) (alpha + P / beta)``
  plus the codec time, which runs on the compute thread and is not overlapped:
  each rank encodes its whole gradient and its own stripe, and decodes ``N``
  received stripes and the ``N`` gathered ones.
* **overlap with backward** (exact and quantized buckets): gradients become ready
  during backward, last layers first; a bucket's exchange starts when its last
  gradient is ready and the previous bucket's exchange has finished (buckets go in
  the same order on every rank). Only what runs past the end of backward adds to
  the step: :func:`exposed_communication`. Gradients are taken to become ready at
  an even rate in bytes over the backward pass.
* **block algorithms** (``BlockMomentumSGD``, ``ModelAveragingSGD``; Chen and Huo
  2016): one all-reduce of the parameters (float32) per block of ``k`` local
  steps, not overlapped, so ``(all-reduce + block update) / k`` per step.
* **asynchronous SGD** with the server on rank 0 (``AsyncSGD``): each remote
  worker pushes its update and pulls the model (``M`` bytes each way) every
  ``sync_period`` samples. A worker waits for its own round trip; rank 0's link
  carries every remote worker's push and pull, so a remote step is at least
  ``(N - 1)`` round trips' worth of bytes on one link per sync. Rank 0's own
  worker talks to the server in-process and never waits, so workers run at
  different rates; the step reported is the job's, ``N / sum(1 / step_r)``
  (the harmonic mean: the time per step at the job's throughput).

Scaling efficiency is ``compute / step``: the step time of one worker alone over
the step time at ``N`` with the same per-worker work (with a fixed global batch the
caller divides the compute by ``N`` first, :meth:`Profile.at_workers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "ALGORITHMS",
    "Candidate",
    "Network",
    "Prediction",
    "Profile",
    "allgather_time",
    "alltoall_time",
    "async_step",
    "block_steps",
    "bucket_sizes",
    "codec_calls",
    "compute_with_stragglers",
    "default_candidates",
    "exposed_communication",
    "fit_line",
    "network_from_timings",
    "predict",
    "predict_all",
    "quantized_payload_bytes",
    "ring_allreduce_bytes",
    "ring_allreduce_time",
    "stripe_bytes",
    "striped_exchange_bytes",
    "striped_exchange_time",
]

ALGORITHMS = ("data_parallel", "block_momentum", "model_averaging", "async")
DEFAULT_CHUNK_SIZE = 512  # bunsan.compression.DEFAULT_CHUNK_SIZE, repeated to stay free of torch (a test checks)
FIRST_BUCKET_BYTES = 2**20  # DataParallelSGD's small first bucket
DEFAULT_BUCKET_BYTES = 25 * 2**20  # DataParallelSGD(bucket_size_mb=25)


def _check_positive(name: str, value: float, *, zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not zero) or math.isinf(value):
        raise ValueError(f"{name} must be {'>= 0' if zero else '> 0'} and finite, got {value!r}")


@dataclass(frozen=True)
class Network:
    """Hockney's alpha-beta model of one link.

    Args:
        latency_s: alpha, seconds per message (the start-up cost of one send).
        bandwidth: beta, bytes per second of one link in one direction.
        gather_bandwidth: effective beta of all-gather and all-to-all messages when
            they differ from all-reduce's (Gloo's all-gather moved fewer bytes per
            second than its all-reduce on loopback); ``None`` means ``bandwidth``.
        half_bandwidth: effective beta of a float16 all-reduce, in bytes of float16,
            where it differs (Gloo sums half precision in software on CPU); ``None``
            means ``bandwidth``.
    """

    latency_s: float
    bandwidth: float
    gather_bandwidth: float | None = None
    half_bandwidth: float | None = None

    def __post_init__(self) -> None:
        _check_positive("latency_s", self.latency_s, zero=True)
        _check_positive("bandwidth", self.bandwidth)
        for name in ("gather_bandwidth", "half_bandwidth"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))

    @property
    def gather_beta(self) -> float:
        return self.gather_bandwidth if self.gather_bandwidth is not None else self.bandwidth


@dataclass(frozen=True)
class Profile:
    """What one worker's training step costs without communication.

    Args:
        compute_s: forward + backward + optimizer update of one step, one worker.
        params: gradient elements (trainable parameters).
        batch: samples per worker per step (turns block sizes in samples into steps).
        bytes_per_element: of the gradient as it is (4 for float32).
        backward_fraction: share of ``compute_s`` spent in backward, the window in
            which bucketed exchanges overlap (about 2/3: backward costs about twice
            the forward).
        encode_s_per_element, decode_s_per_element: quantization codec time per
            element, for the quantized exchange (0 where not measured).
        cast_s_per_element: casting one element to half precision and back (fp16/bf16
            traffic; 0 where not measured).
        update_s_per_element: time per element of a block update (model averaging,
            block momentum) beyond the all-reduce.
        straggler_s: how much longer the slowest of the workers takes, on average, than
            their mean compute in a step (:func:`compute_with_stragglers`); a
            synchronous step waits for the slowest worker (Dean et al. 2012; Chen et al.
            2016, "Revisiting Distributed Synchronous SGD"). A block algorithm waits
            once per block of ``k`` steps, for a skew that grows as ``sqrt(k)`` with
            independent step times: ``straggler_s / sqrt(k)`` per step. Async waits for nobody.
        tensors: parameter tensors (each is encoded as segments of its own).
        chunks: quantization chunks of 512 when every tensor is cut on its own (its
            last chunk short); ``None``: ``ceil(params / 512)``, as if one tensor.
        codec_call_s: fixed time of one encode or decode call, whatever its size
            (dominant for small models on CPU).
    """

    compute_s: float
    params: int
    batch: int = 32
    bytes_per_element: int = 4
    backward_fraction: float = 2 / 3
    encode_s_per_element: float = 0.0
    decode_s_per_element: float = 0.0
    update_s_per_element: float = 0.0
    cast_s_per_element: float = 0.0
    straggler_s: float = 0.0
    tensors: int = 1
    codec_call_s: float = 0.0
    chunks: int | None = None

    def __post_init__(self) -> None:
        _check_positive("compute_s", self.compute_s)
        for name in ("params", "batch", "bytes_per_element", "tensors"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= self.backward_fraction <= 1:
            raise ValueError(f"backward_fraction must be in [0, 1], got {self.backward_fraction}")
        for name in (
            "encode_s_per_element",
            "decode_s_per_element",
            "update_s_per_element",
            "codec_call_s",
            "straggler_s",
            "cast_s_per_element",
        ):
            _check_positive(name, getattr(self, name), zero=True)

    @property
    def gradient_bytes(self) -> int:
        return self.params * self.bytes_per_element

    def at_workers(self, workers: int, *, global_batch: bool = False) -> Profile:
        """This profile at ``workers`` workers: unchanged (per-worker batch fixed, weak scaling), or with a
        fixed global batch the compute and the batch divided by ``workers`` (strong scaling, assuming the
        compute scales linearly with the batch)."""
        if not global_batch or workers == 1:
            return self
        return replace(self, compute_s=self.compute_s / workers, batch=max(1, self.batch // workers))


@dataclass(frozen=True)
class Candidate:
    """One algorithm setting to predict: a registered algorithm name and its options."""

    algorithm: str
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"the cost model knows algorithms {', '.join(ALGORITHMS)}, not {self.algorithm!r}")
        if not self.label:
            text = self.algorithm + (
                ":" + ",".join(f"{k}={v}" for k, v in self.options.items()) if self.options else ""
            )
            object.__setattr__(self, "label", text)

    def __hash__(self) -> int:
        return hash(self.label)


@dataclass(frozen=True)
class Prediction:
    """The predicted cost of one candidate at one worker count (all per worker, per step)."""

    label: str
    workers: int
    compute_s: float
    step_s: float
    communication_s: float  # the exchange's own time, overlapped or not
    exposed_s: float  # what the exchange adds to the step (after overlap, amortized over a block)
    codec_s: float
    bytes_per_step: float  # bytes one worker sends per step

    @property
    def efficiency(self) -> float:
        """Scaling efficiency: the step of one worker alone over this step, same per-worker work."""
        return self.compute_s / self.step_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "workers": self.workers,
            "compute_s": self.compute_s,
            "step_s": self.step_s,
            "communication_s": self.communication_s,
            "exposed_s": self.exposed_s,
            "codec_s": self.codec_s,
            "bytes_per_step": self.bytes_per_step,
            "efficiency": self.efficiency,
        }


# -- collectives -------------------------------------------------------------------------------
def ring_allreduce_bytes(nbytes: float, workers: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (N - 1) / N * nbytes``."""
    return 2 * (workers - 1) / workers * nbytes


def ring_allreduce_time(nbytes: float, workers: int, network: Network) -> float:
    """Seconds of a ring all-reduce of ``nbytes``: ``2 (N - 1) / N * nbytes / beta + 2 (N - 1) alpha``."""
    if workers <= 1 or nbytes <= 0:
        return 0.0
    return ring_allreduce_bytes(nbytes, workers) / network.bandwidth + 2 * (workers - 1) * network.latency_s


def alltoall_time(message_bytes: float, workers: int, network: Network) -> float:
    """Seconds of an all-to-all where each rank sends ``message_bytes`` to each of the ``N - 1`` others."""
    if workers <= 1:
        return 0.0
    return (workers - 1) * (network.latency_s + message_bytes / network.gather_beta)


def allgather_time(message_bytes: float, workers: int, network: Network) -> float:
    """Seconds of a ring all-gather of one ``message_bytes`` piece per rank: ``(N - 1)`` steps of one piece."""
    return alltoall_time(message_bytes, workers, network)


def quantized_payload_bytes(numel: int, bits: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """Bytes of ``numel`` elements quantized to ``bits`` bits: two float32 per chunk plus the packed codes
    (the size of :meth:`bunsan.compression.Quantizer.payload_bytes`)."""
    if numel <= 0:
        return 0
    return 8 * -(-numel // chunk_size) + -(-numel * bits // 8)


def stripe_bytes(
    numel: int, bits: int, workers: int, chunk_size: int = DEFAULT_CHUNK_SIZE, chunks: int | None = None
) -> int:
    """Bytes of one quantized stripe: ``1 / N`` of the ``chunks`` (two float32 each) and of the codes.

    ``chunks`` defaults to ``ceil(numel / chunk_size)``; a model of many small tensors
    has more (each tensor's last chunk is short). Stripes are padded to the largest,
    so the chunk share is rounded up.
    """
    if chunks is None:
        chunks = -(-numel // chunk_size)
    share = -(-numel // workers)
    return 8 * -(-chunks // workers) + -(-share * bits // 8)


def striped_exchange_bytes(
    numel: int, bits: int, workers: int, chunk_size: int = DEFAULT_CHUNK_SIZE, chunks: int | None = None
) -> float:
    """Bytes each rank sends in the striped quantized exchange: ``2 (N - 1)`` stripes of ``numel / N`` elements."""
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) * stripe_bytes(numel, bits, workers, chunk_size, chunks)


def striped_exchange_time(
    numel: int,
    bits: int,
    workers: int,
    network: Network,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    chunks: int | None = None,
) -> float:
    """Seconds on the wire of the striped quantized exchange of ``numel`` elements (all-to-all + all-gather)."""
    if workers <= 1:
        return 0.0
    stripe = stripe_bytes(numel, bits, workers, chunk_size, chunks)
    return alltoall_time(stripe, workers, network) + allgather_time(stripe, workers, network)


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


def codec_calls(tensors: int, buckets: int, workers: int) -> float:
    """Encode and decode calls per step of the striped exchange (each segment is coded on its own).

    A stripe cut meets about ``tensors + workers`` segments per bucket
    (:func:`bunsan.algorithms.data_parallel.plan_stripes` cuts at parameter and
    stripe ends): encode all of them, decode the received ones, encode the own
    stripe (``tensors / N + 1``), decode the gathered ones: ``3 (T + B N) + T / N + B``.
    """
    if workers <= 1:
        return 0.0
    segments = tensors + buckets * workers
    return 3 * segments + tensors / workers + buckets


# -- the algorithms -----------------------------------------------------------------------------
def block_steps(block_size: int, batch: int) -> int:
    """Local steps per block: ``block_size`` samples per worker over ``batch`` samples per step (at least 1)."""
    return max(1, math.ceil(block_size / batch))


def async_step(
    compute_s: float, model_bytes: float, workers: int, network: Network, sync_steps: int, apply_s: float = 0.0
) -> tuple[float, float]:
    """``(step seconds, exposed seconds)`` of a remote worker of the rank-0 parameter server.

    A worker pays its own push and pull (``2 (alpha + M / beta)``) every
    ``sync_steps`` steps; rank 0's link, full duplex, receives ``N - 1`` pushes and
    sends ``N - 1`` models per sync round, and rank 0 applies ``N - 1`` updates, so
    a round cannot be shorter than ``(N - 1) (alpha + M / beta + apply)``.
    """
    if workers <= 1:
        return compute_s, 0.0
    round_trip = 2 * (network.latency_s + model_bytes / network.bandwidth) + apply_s
    own = compute_s + round_trip / sync_steps
    server = (workers - 1) * (network.latency_s + model_bytes / network.bandwidth + apply_s) / sync_steps
    step = max(own, server)
    return step, step - compute_s


def _option(options: dict[str, Any], name: str, default: Any) -> Any:
    value = options.get(name, default)
    return default if value is None else value


def predict(
    profile: Profile, network: Network, candidate: Candidate, workers: int, *, overlap: bool = True
) -> Prediction:
    """The predicted step of ``candidate`` at ``workers`` workers (the profile is per worker at that count).

    Options read from ``candidate.options``: ``bits``, ``compression`` (``"fp16"``/``"bf16"``),
    ``chunk_size``, ``bucket_size_mb`` (data_parallel); ``block_size`` (samples per worker, block
    algorithms); ``sync_period`` (samples per worker, async). ``overlap=False`` puts every bucketed
    exchange after backward (as in a framework that reduces after the whole backward pass).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    options = candidate.options
    compute = profile.compute_s
    n = workers
    if candidate.algorithm == "data_parallel":
        bits = int(_option(options, "bits", 32))
        forward = compute * (1 - profile.backward_fraction)
        backward = compute * profile.backward_fraction
        cap = int(float(_option(options, "bucket_size_mb", DEFAULT_BUCKET_BYTES / 2**20)) * 2**20)
        # Buckets are cut in gradient bytes, whatever travels (DataParallelSGD fills them before compressing).
        buckets = bucket_sizes(profile.gradient_bytes, cap, min(FIRST_BUCKET_BYTES, cap))
        if bits == 32:
            half = options.get("compression") in ("fp16", "bf16")
            element = 2 if half else profile.bytes_per_element
            ratio = element / profile.bytes_per_element
            wire = network
            if half and network.half_bandwidth is not None:
                wire = replace(network, bandwidth=network.half_bandwidth)

            def exchange(size: float) -> float:
                return ring_allreduce_time(size * ratio, n, wire)

            sent = ring_allreduce_bytes(profile.params * element, n) if n > 1 else 0.0
            codec = profile.cast_s_per_element * profile.params if half and n > 1 else 0.0
        else:
            chunk = int(_option(options, "chunk_size", DEFAULT_CHUNK_SIZE))
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
                striped_exchange_bytes(int(b // profile.bytes_per_element), bits, n, chunk, bucket_chunks(b))
                for b in buckets
            )
            codec = (
                0.0
                if n == 1
                else (
                    profile.encode_s_per_element * profile.params * (1 + 1 / n)
                    + profile.decode_s_per_element * profile.params * 2
                    + profile.codec_call_s * codec_calls(profile.tensors, len(buckets), n)
                )
            )
            # the step's (samples, active ranks) count travels in a small all-reduce of its own
            codec += ring_allreduce_time(16, n, network)
        communication = sum(exchange(b) for b in buckets) if n > 1 else 0.0
        if n == 1:
            exposed = 0.0
        elif overlap:
            exposed = exposed_communication(forward, backward, buckets, exchange)
        else:
            exposed = communication
        wait = profile.straggler_s if n > 1 else 0.0
        return Prediction(
            candidate.label, n, compute, compute + wait + exposed + codec, communication, wait + exposed, codec, sent
        )
    if candidate.algorithm in ("block_momentum", "model_averaging"):
        k = block_steps(int(_option(options, "block_size", 1024)), profile.batch)
        nbytes = profile.params * 4  # parameters are averaged in float32
        communication = ring_allreduce_time(nbytes, n, network)
        update = profile.update_s_per_element * profile.params if n > 1 else 0.0
        wait = profile.straggler_s * math.sqrt(k) if n > 1 else 0.0
        exposed = (communication + update + wait) / k
        sent = ring_allreduce_bytes(nbytes, n) / k
        return Prediction(candidate.label, n, compute, compute + exposed, communication / k, exposed, 0.0, sent)
    # async: rank 0's own worker reaches the server in-process and never waits; the others pay the
    # round trip. The step is the job's: workers / sum of each worker's steps per second.
    k = block_steps(int(_option(options, "sync_period", 1)), profile.batch)
    nbytes = profile.params * 4
    remote, _ = async_step(compute, nbytes, n, network, k, profile.update_s_per_element * profile.params)
    step = n / (1 / compute + (n - 1) / remote)
    sent = 0.0 if n == 1 else nbytes / k  # a remote worker's push
    return Prediction(candidate.label, n, compute, step, remote - compute, step - compute, 0.0, sent)


def default_candidates(block_size: int = 1024) -> list[Candidate]:
    """Every algorithm at its documented default setting (and 8- and 1-bit quantization, fp16 traffic)."""
    return [
        Candidate("data_parallel", {}, "exact"),
        Candidate("data_parallel", {"compression": "fp16"}, "fp16"),
        Candidate("data_parallel", {"bits": 8}, "8-bit"),
        Candidate("data_parallel", {"bits": 1}, "1-bit"),
        Candidate("block_momentum", {"block_size": block_size}, f"block_momentum:{block_size}"),
        Candidate("model_averaging", {"block_size": block_size}, f"model_averaging:{block_size}"),
        Candidate("async", {}, "async"),
    ]


def predict_all(
    profile: Profile,
    network: Network,
    candidates: Sequence[Candidate],
    workers: Sequence[int],
    *,
    global_batch: bool = False,
    overlap: bool = True,
) -> list[Prediction]:
    """:func:`predict` for every candidate at every worker count (worker counts outer)."""
    return [
        predict(profile.at_workers(n, global_batch=global_batch), network, c, n, overlap=overlap)
        for n in workers
        for c in candidates
    ]


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``t = a + b x`` through ``(x, t)`` points.

    The intercept is clipped at 0 (a latency is never negative); with it clipped the
    slope is refitted through the origin. Used to read ``alpha`` and ``beta`` off
    timed collectives of several sizes.

    Raises:
        ValueError: fewer than two distinct ``x``, or a slope that is not positive.
    """
    if len({x for x, _ in points}) < 2:
        raise ValueError("fitting a line needs points at two or more distinct sizes")
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in points) / sxx
    intercept = mean_t - slope * mean_x
    if intercept < 0:
        intercept = 0.0
        slope = sum(x * t for x, t in points) / sum(x * x for x, _ in points)
    if not slope > 0:
        raise ValueError(
            f"the timed sizes give a slope of {slope:.3g} s/byte: time did not grow with size; "
            "time larger messages or more repeats"
        )
    return intercept, slope


def network_from_timings(
    allreduce: Sequence[tuple[float, float]], workers: int, allgather: Sequence[tuple[float, float]] = ()
) -> Network:
    """The :class:`Network` whose alpha and beta best explain timed collectives at ``workers`` ranks.

    ``allreduce``: ``(bytes, seconds)`` of ring all-reduces, modelled as
    ``2 (N - 1) alpha + 2 (N - 1) / N * bytes / beta``. ``1 / beta`` is the
    least-squares slope over all sizes; alpha is read off the smallest message
    (the small-message latency, less its tiny bandwidth share), which a fitted
    intercept would leave to the noise of the large ones. ``allgather``:
    ``(bytes of one rank's piece, seconds)``, slope of ``(N - 1) (alpha + bytes /
    beta_gather)``; left out (``None``) when its times do not grow with size.
    """
    if workers < 2:
        raise ValueError(f"measuring a network needs 2 or more workers, got {workers}")
    points = [(ring_allreduce_bytes(m, workers), t) for m, t in allreduce]
    slope = fit_line(points)[1]
    x_small, t_small = min(points)
    latency = max(0.0, t_small - x_small * slope) / (2 * (workers - 1))
    gather = None
    if allgather:
        try:
            gather = 1 / fit_line([((workers - 1) * m, t) for m, t in allgather])[1]
        except ValueError:
            gather = None
    return Network(latency_s=latency, bandwidth=1 / slope, gather_bandwidth=gather)
