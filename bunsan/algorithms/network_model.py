"""The network model under bunsan's cost model: alpha-beta links and the collectives bunsan uses.

Pure arithmetic, no torch (:mod:`bunsan.algorithms.cost_model` builds on it, and
:mod:`bunsan.algorithms.measure` fits it to timed collectives).

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
* **a token-bucket link** (Linux ``tc tbf``, as ``bunsan bench --network`` shapes
  its links; a cloud instance's burst allowance): tokens accrue at the link's rate
  while it idles, up to ``burst_bytes``, and that many bytes then pass at once
  (Turner 1986, "New directions in communications (or which way to the information
  age?)", the leaky-bucket regulator). A training step's link idles during the
  compute, so the step's first ``min(burst, rate * compute)`` bytes cost no time
  (:func:`burst_credit`); a 32 KB gradient at 100 Mbit/s with tbf's 16 KiB burst
  moves in half the time alpha-beta gives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bunsan._validate import check_int, check_number

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "Network",
    "allgather_time",
    "alltoall_time",
    "burst_credit",
    "check_seconds",
    "fit_line",
    "network_from_timings",
    "quantized_payload_bytes",
    "ring_allreduce_bytes",
    "ring_allreduce_time",
    "stripe_bytes",
    "striped_exchange_bytes",
    "striped_exchange_time",
]

DEFAULT_CHUNK_SIZE = 512  # bunsan.compression.DEFAULT_CHUNK_SIZE, repeated to stay free of torch (a test checks)


def check_seconds(name: str, value: float, *, zero: bool = False) -> None:
    """A finite number ``> 0`` (``>= 0`` with ``zero``): TypeError for another type, ValueError for another value."""
    check_number(name, value, minimum=0.0, min_inclusive=zero)


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
        burst_bytes: a token-bucket link's burst: bytes that pass at once after the link
            idled long enough to refill (:func:`burst_credit`); 0 for a link without one.
            Not measured by the job's probe (its back-to-back messages keep the bucket
            empty): given, as ``tools/predict.py`` gives its shaped links' burst.
    """

    latency_s: float
    bandwidth: float
    gather_bandwidth: float | None = None
    half_bandwidth: float | None = None
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        check_seconds("latency_s", self.latency_s, zero=True)
        check_seconds("bandwidth", self.bandwidth)
        for name in ("gather_bandwidth", "half_bandwidth"):
            if getattr(self, name) is not None:
                check_seconds(name, getattr(self, name))
        check_number("burst_bytes", self.burst_bytes, minimum=0.0, hint="bytes, 0 for no token bucket")

    @property
    def gather_beta(self) -> float:
        return self.gather_bandwidth if self.gather_bandwidth is not None else self.bandwidth


# -- collectives -------------------------------------------------------------------------------
def ring_allreduce_bytes(nbytes: float, workers: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (N - 1) / N * nbytes``."""
    return 2 * (workers - 1) / workers * nbytes


def ring_allreduce_time(nbytes: float, workers: int, network: Network) -> float:
    """Seconds of a ring all-reduce of ``nbytes``: ``2 (N - 1) / N * nbytes / beta + 2 (N - 1) alpha``."""
    if workers <= 1 or nbytes <= 0:
        return 0.0
    return ring_allreduce_bytes(nbytes, workers) / network.bandwidth + 2 * (workers - 1) * network.latency_s


def burst_credit(network: Network, sent_bytes: float, idle_s: float, bandwidth: float | None = None) -> float:
    """Seconds a token-bucket link saves on ``sent_bytes`` sent after ``idle_s`` of idling.

    ``min(burst_bytes, bandwidth * idle_s, sent_bytes) / bandwidth``: the bucket refills at
    the link's rate while it idles (the previous exchange drained it), up to the burst, and
    the bytes it holds pass at once. ``bandwidth``: the rate the bytes travel at (the
    network's own by default; a float16 all-reduce's where that differs).
    """
    rate = network.bandwidth if bandwidth is None else bandwidth
    if network.burst_bytes <= 0 or sent_bytes <= 0 or idle_s <= 0:
        return 0.0
    return min(network.burst_bytes, rate * idle_s, sent_bytes) / rate


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


# -- fitting to timings ---------------------------------------------------------------------------
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
    check_int("workers", workers, minimum=2, hint="measuring a network needs 2 or more")
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
