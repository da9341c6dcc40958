"""Predicted step time of every bunsan algorithm: pure functions of a profile and a network.

No torch and no process group here: :mod:`bunsan.bench.plan` (``bunsan plan``) and
an algorithm that decides at run time use the same arithmetic, and tests check it
against values worked out by hand.

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

from bunsan._validate import check_int, check_number, check_type
from bunsan.algorithms.network_model import (
    DEFAULT_CHUNK_SIZE,
    Network,
    allgather_time,
    alltoall_time,
    burst_credit,
    check_seconds,
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
    "ASYNC_OWN_PASSES",
    "ASYNC_REMOTE_PASSES",
    "ASYNC_SERVER_PASSES",
    "BLOCK_ROUND_PASSES",
    "NESTEROV_START_PASSES",
    "Candidate",
    "Network",
    "Prediction",
    "Profile",
    "allgather_time",
    "alltoall_time",
    "async_fixed_labels",
    "async_rank_steps",
    "async_step",
    "block_round_passes",
    "block_steps",
    "bucket_sizes",
    "burst_credit",
    "codec_call_counts",
    "codec_calls",
    "codec_elements",
    "compute_with_stragglers",
    "default_candidates",
    "exact_released_together",
    "exposed_communication",
    "fit_line",
    "mean_call_profile",
    "network_from_timings",
    "predict",
    "predict_all",
    "quantized_payload_bytes",
    "ring_allreduce_bytes",
    "ring_allreduce_time",
    "shared_compute",
    "stripe_bytes",
    "striped_exchange_bytes",
    "striped_exchange_time",
]

ALGORITHMS = ("data_parallel", "block_momentum", "model_averaging", "async")
FIRST_BUCKET_BYTES = 2**20  # DataParallelSGD's small first bucket
DEFAULT_BUCKET_BYTES = 25 * 2**20  # DataParallelSGD(bucket_size_mb=25)
# Passes over the parameters in memory per push and pull of async SGD (bunsan.algorithms.async_sgd),
# counted in its code. Rank 0's worker, in-process: pack the parameters into the message, subtract
# the base (the update), the server adds it to its model, copies the model into the reply, the
# worker unpacks the reply into its parameters and copies it into its base: 6. A remote worker
# packs, subtracts, unpacks and copies the base (its push and pull are on the wire): 4.
ASYNC_OWN_PASSES = 6
ASYNC_REMOTE_PASSES = 4
# The server's own passes for a remote worker's push (rank 0's core; between its receive and its
# reply): it adds the update to its model and copies the model into the reply: 2.
ASYNC_SERVER_PASSES = 2
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


@dataclass(frozen=True)
class Profile:
    """What one worker's training step costs without communication.

    Args:
        compute_s: forward + backward + optimizer update of one step, one worker.
        params: gradient elements (trainable parameters).
        batch: samples per worker per step (turns block sizes in samples into steps).
        bytes_per_element: of the gradient as it is (4 for float32, 2 for bfloat16 or float16
            parameters; the mean over the parameters where their dtypes differ). Every exchange
            travels in the parameters' own dtypes: the gradients', the block algorithms' parameters
            and async SGD's messages alike.
        backward_fraction: share of ``compute_s`` spent in backward, the window in
            which bucketed exchanges overlap (about 2/3: backward costs about twice
            the forward).
        encode_s_per_element, decode_s_per_element: quantization codec time per
            element, for the quantized exchange (0 where not measured).
        cast_s_per_element: casting one element to half precision and back (fp16/bf16
            traffic; 0 where not measured).
        update_s_per_element: time per element of a block round's own work (model averaging,
            block momentum) beside its all-reduce, where it was timed (``plan --job`` of a
            record that holds it); 0: its passes over the parameters as counted
            (:func:`block_round_passes`), at ``copy_s_per_element`` each.
        copy_s_per_element: one pass over the parameters in memory (a float32 copy), per
            element: async SGD's in-process exchange is made of such passes
            (:data:`ASYNC_OWN_PASSES`, :data:`ASYNC_REMOTE_PASSES`), and so is a block round
            beside its all-reduce (:func:`block_round_passes`); 0 where not measured.
        straggler_s: how much longer the slowest of the workers takes, on average, than
            their mean compute in a step (:func:`compute_with_stragglers`); a
            synchronous step waits for the slowest worker (Dean et al. 2012; Chen et al.
            2016, "Revisiting Distributed Synchronous SGD"). A block algorithm waits
            once per block of ``k`` steps, for a skew that grows as ``sqrt(k)`` with
            independent step times: ``straggler_s / sqrt(k)`` per step. Async waits for nobody.
        synced_straggler_s: the wait for the slowest worker of compute steps that every rank started
            together (after a barrier), where timed (``None``: not timed). Exact's wait where ranks share
            cores (``ranks_per_core`` above 1) and its exchange runs on a link (``overlap``, not through
            memory): its one collective a step, bound by the wire, releases every rank at once, and their
            next computes start together; through memory the exchange's end follows the CPU's time slices
            and leaves the ranks staggered, and fp16's and the quantized exchanges' second collective (the
            step's counts) is priced with ``straggler_s`` as before. Priced so, exact's rows at 4 workers on
            2 cores over 1 Gbit/s and 100 Mbit/s links came within 20% (the digits CNN at 1 Gbit/s +12% to
            +36% in seven runs, MNIST-1D at 100 Mbit/s +11% to +31%), and fp16's did not (docs/experiments/plan.md,
            "Exact's ranks leave a wire-bound exchange together").
        tensors: parameter tensors (each is encoded as segments of its own).
        chunks: quantization chunks of 512 when every tensor is cut on its own (its
            last chunk short); ``None``: ``ceil(params / 512)``, as if one tensor.
        codec_call_s: fixed time of one encode or decode call, whatever its size
            (dominant for small models on CPU, and on a GPU, where a call is its kernel launches):
            the mean of the two, for a profile that does not time them apart.
        encode_call_s, decode_call_s: the fixed time of one encode call and of one decode call,
            timed apart (``None``: ``codec_call_s`` for each). They differ: on the H100 of the
            docs one encode (with its error feedback) cost 2-3 decodes, and on the 2-core CPU a
            one-chunk 2-bit encode 4-5 decodes; at 2 workers the one-call codec makes one encode
            and four decodes per bucket, which the mean priced 93% over the exchange's own codec
            work (docs/experiments/plan.md, "On a GPU").
        codec_per_bucket: the striped exchange codes a bucket in one call per phase
            (:func:`bunsan.algorithms.data_parallel.stripes.coded_per_bucket`: on a GPU) instead
            of one call per segment (:func:`codec_calls`).
        codecs: the codec at other bit widths, ``(bits, encode_s_per_element,
            decode_s_per_element, codec_call_s)`` each, or with ``encode_call_s`` and
            ``decode_call_s`` after them; a quantized candidate of those bits uses its own entry
            (8-bit encoding costs several times 1-bit's per element on CPU), any other the
            fields above.
        core_copy_s_per_element: that copy timed with one rank per core copying at once (the
            others waiting), where ``ranks_per_core`` is above 1; 0: not timed, the passes priced
            at ``copy_s_per_element``. Async SGD's passes then cost it times the slowdown
            :func:`shared_compute` gives the compute (:func:`async_rank_steps`): timed with every
            rank at once, 4 ranks on 2 cores, the 10.5M MLP's copy came out at 5.9-11.4 ms in
            predict-21 to 24 and 10.9-15.9 ms in a probe after (a copy is short beside a time
            slice: how often a rank is preempted decides it), with one rank per core at once
            5.4-7.7 ms, and rank 0's worker, on a core of its own while the remote workers wait
            on 100 Mbit/s links, made its six passes at 5-7 ms each (priced at the first, its
            job was predicted 22-31% slow in three runs).
        core_compute_s: ``compute_s`` timed with one rank per core computing at once (the others
            waiting, :func:`bunsan.algorithms.measure.in_turns`), where ``ranks_per_core`` is above 1;
            0: not timed, rank 0's worker priced at the shared compute (:func:`shared_compute`),
            as the remote workers are. Async SGD's rank 0 worker, which never
            waits, is priced at it whatever the remote workers do (:func:`async_rank_steps`): at 4
            workers on 2 cores, its fixed cost taken out, its step was 0.63-0.73 of ``compute_s``
            on every network for the digits CNN and ResNet-20 (0.44-0.84 for MNIST-1D's 4-6 ms
            steps; predict-23 to 28), where the model's sharing gave it the whole ``compute_s``
            while the remotes computed (loopback, 1 Gbit/s) and ``compute_s / 2`` while they
            waited (100 Mbit/s), and a rank on a core of its own is slower than half of two
            sharing it (the 2-worker jobs' compute was 1.63-1.94 times less, not 2): the job's
            step, which rank 0's worker sets most, came out +6% to +15% on loopback and -16% to
            -21% at 100 Mbit/s for those three models (docs/experiments/plan.md, "Rank 0's worker on a core
            of its own").
        ranks_per_core: the ranks of a host over its usable cores while ``compute_s`` was timed,
            every rank computing at once (1: a core or more each). Above 1 a rank computes
            faster while others wait: async SGD's remote workers spend their round trips off the
            cores (:func:`shared_compute`). Synchronous steps compute and wait together, so
            only async reads it.
        fixed_s: seconds a candidate costs beyond what the model counts (the framework's
            hooks and bookkeeping, the in-situ latency of waking the backend's threads),
            ``(label, seconds)`` per candidate label: per step, but per block for the block
            algorithms (their synchronization is once a block; :func:`predict` divides by
            the block's steps). Measured on a tiny model in the job
            (:func:`bunsan.algorithms.measure.measure_fixed_costs`); 0 for a label not listed.
    """

    compute_s: float
    params: int
    batch: int = 32
    bytes_per_element: float = 4
    backward_fraction: float = 2 / 3
    encode_s_per_element: float = 0.0
    decode_s_per_element: float = 0.0
    update_s_per_element: float = 0.0
    cast_s_per_element: float = 0.0
    copy_s_per_element: float = 0.0
    core_copy_s_per_element: float = 0.0
    straggler_s: float = 0.0
    tensors: int = 1
    codec_call_s: float = 0.0
    chunks: int | None = None
    codecs: tuple[tuple[int | float, ...], ...] = ()
    fixed_s: tuple[tuple[str, float], ...] = ()
    codec_per_bucket: bool = False
    encode_call_s: float | None = None
    decode_call_s: float | None = None
    ranks_per_core: float = 1.0
    core_compute_s: float = 0.0
    synced_straggler_s: float | None = None

    def __post_init__(self) -> None:
        check_seconds("compute_s", self.compute_s)
        for name in ("params", "batch", "tensors"):
            check_int(name, getattr(self, name), minimum=1)
        check_number("bytes_per_element", self.bytes_per_element, minimum=1.0, maximum=16.0)
        check_number("backward_fraction", self.backward_fraction, minimum=0.0, maximum=1.0)
        check_number("ranks_per_core", self.ranks_per_core, minimum=1.0)
        for name in (
            "encode_s_per_element",
            "decode_s_per_element",
            "update_s_per_element",
            "codec_call_s",
            "straggler_s",
            "cast_s_per_element",
            "copy_s_per_element",
            "core_copy_s_per_element",
            "core_compute_s",
        ):
            check_seconds(name, getattr(self, name), zero=True)
        for name in ("encode_call_s", "decode_call_s", "synced_straggler_s"):
            if getattr(self, name) is not None:
                check_seconds(name, getattr(self, name), zero=True)
        if (self.encode_call_s is None) != (self.decode_call_s is None):
            raise ValueError(
                "encode_call_s and decode_call_s go together (the two calls timed apart); "
                f"got {self.encode_call_s!r} and {self.decode_call_s!r}"
            )
        for entry in self.codecs:
            if len(entry) not in (4, 6):
                raise ValueError(
                    "each codecs entry is (bits, encode_s_per_element, decode_s_per_element, codec_call_s"
                    f"[, encode_call_s, decode_call_s]); got {entry!r}"
                )
            bits, *costs = entry
            check_int("codecs bits", bits, minimum=1, maximum=16)
            for cost in costs:
                check_seconds("codecs cost", cost, zero=True)
        for label, seconds in self.fixed_s:
            check_type("fixed_s label", label, str)
            check_number("fixed_s seconds", seconds)  # may be negative: the model may count more than the probe saw

    def codec(self, bits: int) -> tuple[float, float, float, float]:
        """``(encode_s_per_element, decode_s_per_element, encode_call_s, decode_call_s)`` of the codec at
        ``bits``; where the calls were not timed apart, ``codec_call_s`` for each."""
        for entry in self.codecs:
            if entry[0] == bits:
                encode, decode, call = (float(v) for v in entry[1:4])
                calls = (float(entry[4]), float(entry[5])) if len(entry) == 6 else (call, call)
                return encode, decode, *calls
        if self.encode_call_s is not None and self.decode_call_s is not None:
            calls = (self.encode_call_s, self.decode_call_s)
        else:
            calls = (self.codec_call_s, self.codec_call_s)
        return self.encode_s_per_element, self.decode_s_per_element, *calls

    def fixed(self, label: str) -> float:
        """The measured fixed seconds of the candidate ``label``; else of its algorithm (the label's
        part before ``:``, e.g. a block algorithm probed at another block size); else 0."""
        found = dict(self.fixed_s)
        return found.get(label, found.get(label.split(":")[0], 0.0))

    @property
    def gradient_bytes(self) -> int:
        return round(self.params * self.bytes_per_element)

    def at_workers(self, workers: int, *, global_batch: bool = False) -> Profile:
        """This profile at ``workers`` workers: unchanged (per-worker batch fixed, weak scaling), or with a
        fixed global batch the compute and the batch divided by ``workers`` (strong scaling, assuming the
        compute scales linearly with the batch)."""
        if not global_batch or workers == 1:
            return self
        return replace(
            self,
            compute_s=self.compute_s / workers,
            core_compute_s=self.core_compute_s / workers,
            batch=max(1, self.batch // workers),
        )


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
    that compare both models on one measured profile (``bunsan bench predict``,
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
    nesterov = candidate.algorithm == "block_momentum" and bool(_option(candidate.options, "nesterov", True))
    return BLOCK_ROUND_PASSES + (NESTEROV_START_PASSES if nesterov else 0.0)


def block_steps(block_size: int, batch: int) -> int:
    """Local steps per block: ``block_size`` samples per worker over ``batch`` samples per step (at least 1)."""
    return max(1, math.ceil(block_size / batch))


def async_step(
    compute_s: float,
    model_bytes: float,
    workers: int,
    network: Network,
    sync_steps: int,
    apply_s: float = 0.0,
    local_s: float = 0.0,
    *,
    convoy: bool = True,
) -> tuple[float, float]:
    """``(step seconds, exposed seconds)`` of a remote worker of the rank-0 parameter server.

    A worker pays its own push and its pull and its in-memory work around them (``local_s``)
    every ``sync_steps`` steps; rank 0 applies ``N - 1`` updates a round, and its link, full
    duplex, sends ``N - 1`` models, so a round cannot be shorter than
    ``(N - 1) (alpha + M / beta + apply)``.

    ``convoy`` (over a link): each remote pushes on its own link, but the pulls share rank 0's
    outgoing one. The remotes start together, and a link shared fairly keeps the offsets between
    equal transfers (two pulls that start together end together; one started later ends as much
    later), so remotes computing equal steps stay in step: a remote's round trip is its push
    and then the ``N - 1`` pulls sharing the link, ``2 alpha + N M / beta + apply``
    (``2 (alpha + M / beta) + apply`` at 2 workers either way). Measured on the 2-core machine
    of the docs at 4 workers on 1 Gbit/s and 100 Mbit/s links, the remotes' median step in
    predict-21 to predict-23 (20 rows: four models, both links): within 16% of this in all 20
    (median 5%); priced with each pull on a link of its own (``2 (alpha + M / beta)``, rank 0's
    link bounding only the round), 7 of 20, 21-35% under in the others (the 10.5M MLP at
    100 Mbit/s: 11.2 s against 14.8-16.3 s). Unmeasured beyond 4 workers: where noise staggers
    many remotes over a long compute, the step tends to rank 0's round, the floor below.
    ``convoy=False``: through memory, where rank 0's
    server threads send on cores of their own (no shared link): ``2 (alpha + M / beta) + apply``.
    (Rank 0's own worker: :func:`async_rank_steps`.)

    On token-bucket links (``network.burst_bytes``) each bucket refills over a sync's
    ``sync_steps`` steps of compute: the push's, on the worker's own link, and the pull's,
    on rank 0's, whose bucket the round's ``N - 1`` pulls share.
    """
    if workers <= 1:
        return compute_s, 0.0
    idle = sync_steps * compute_s
    pulls = burst_credit(network, (workers - 1) * model_bytes, idle)  # rank 0's link, shared by a round
    push = burst_credit(network, model_bytes, idle)
    message = network.latency_s + model_bytes / network.bandwidth
    if convoy:  # the push, then the round's N - 1 pulls at once on rank 0's link
        trip = 2 * network.latency_s + workers * model_bytes / network.bandwidth - push - pulls
    else:
        trip = 2 * message - push - pulls / (workers - 1)
    own = compute_s + (trip + apply_s + local_s) / sync_steps
    server = ((workers - 1) * (message + apply_s) - pulls) / sync_steps
    step = max(own, server)
    return step, step - compute_s


def shared_compute(
    compute_s: float,
    ranks_per_core: float,
    busy: Callable[[float], float],
) -> float:
    """A rank's compute where ranks share cores and some of them wait: ``compute_s`` was timed with
    every rank computing at once, ``ranks_per_core`` ranks to a core; alone on a core a rank computes
    in ``compute_s / ranks_per_core``, and with a mean share ``b`` of the ranks busy on the CPU (the
    rest waiting on the network) in ``compute_s / ranks_per_core * max(1, ranks_per_core * b)``.
    ``busy(c)`` gives that mean share for a compute of ``c``; the fixed point is found from below
    (the share grows with ``c``, so the rounds rise to it). The share counts every busy thread per
    rank and may pass 1: a thread beside the ranks (async SGD's server on a host without a spare
    core) slows them all, even at ``ranks_per_core`` 1. (The server's share ``S / (c + T)`` falls as
    ``c`` grows, but the remotes' ``(N - 1) c / (c + T)`` rises faster while each remote's round
    trip ``T`` holds at least its share of the server's work, ``S / (N - 1)``, as async's does: the
    sum still grows; on the 92 async rows of predict-21 to 24 the rounds settle within 21.) With ``ranks_per_core`` 1 (or less: a core
    or more each) and a share of at most 1 it is ``compute_s``.

    Async SGD on a shared host: on the 2-core machine of the docs, at 4 workers on 1 Gbit/s and
    100 Mbit/s links, the 10.5M MLP's compute timed with all 4 ranks busy was 88-93 ms, but its
    remote workers spend seconds a step on their round trips, and rank 0's worker stepped in about
    the 40-47 ms of a rank with a core to itself (its 2-worker compute); charging it 88 ms
    predicted its job 42-58% slow (docs/experiments/plan.md, "Async on a shared host").
    """
    ranks_per_core = max(1.0, ranks_per_core)
    alone = compute_s / ranks_per_core
    compute = alone
    for _ in range(100):
        share = max(0.0, busy(compute))
        following = alone * max(1.0, ranks_per_core * share)
        if abs(following - compute) <= 1e-12 * compute_s:
            return following
        compute = following
    return compute


def _option(options: dict[str, Any], name: str, default: Any) -> Any:
    value = options.get(name, default)
    return default if value is None else value


def predict(
    profile: Profile,
    network: Network,
    candidate: Candidate,
    workers: int,
    *,
    overlap: bool = True,
    spare_core: bool | None = None,
) -> Prediction:
    """The predicted step of ``candidate`` at ``workers`` workers (the profile is per worker at that count).

    Options read from ``candidate.options``: ``bits``, ``compression`` (``"fp16"``/``"bf16"``),
    ``chunk_size``, ``bucket_size_mb`` (data_parallel); ``block_size`` (samples per worker, block
    algorithms); ``sync_period`` (samples per worker, async). ``overlap=False`` puts every bucketed
    exchange after backward (as in a framework that reduces after the whole backward pass, or where
    the exchange needs the compute's own core: :func:`bunsan.algorithms.measure.can_overlap`).

    ``spare_core`` (async only): whether the server's transfers for the remote workers find a core
    that no worker computes on; where not, the server thread's transfers and applies are CPU work
    beside the ranks' (:func:`async_rank_steps`), which the OS spreads over every core. Where each
    worker has a core of its own, a remote worker's core idles during its own round trip and the
    server thread's copies run there: the 10.5M-parameter MLP at 2 workers on 2
    cores, rank 0's worker spent 41.7 ms a step in its exchange with the remote's transfers over
    loopback and 38.8 ms with them on a 1 Gbit/s link, 3 ms for 84 MB through memory where the
    model had charged 65 ms (docs/experiments/async_exchange.py). ``None``: as ``overlap``.
    """
    check_int("workers", workers, minimum=1)
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
            rate = wire.bandwidth
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
            encode_s, decode_s, encode_call_s, decode_call_s = profile.codec(bits)
            encodes, decodes = codec_call_counts(profile.tensors, len(buckets), n, profile.codec_per_bucket)
            encoded, decoded = codec_elements(profile.params, n)
            codec = (
                0.0
                if n == 1
                else (encode_s * encoded + decode_s * decoded + encode_call_s * encodes + decode_call_s * decodes)
            )
            # the step's (samples, active ranks) count travels in a small all-reduce of its own
            codec += ring_allreduce_time(16, n, network)
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
    if candidate.algorithm in ("block_momentum", "model_averaging"):
        k = block_steps(int(_option(options, "block_size", 1024)), profile.batch)
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
    # async: rank 0's own worker reaches the server in-process and never waits; the others pay the
    # round trip. The step is the job's: workers / sum of each worker's steps per second.
    compute, own, remote = async_rank_steps(profile, network, candidate, n, overlap=overlap, spare_core=spare_core)
    if n > 1:  # each side's measured fixed cost: rank 0's worker's and a remote worker's (async_fixed_labels)
        own_label, remote_label = async_fixed_labels(candidate.label)
        own += profile.fixed(own_label)
        remote += profile.fixed(remote_label)
    step = n / (1 / own + (n - 1) / remote)
    k = block_steps(int(_option(options, "sync_period", 1)), profile.batch)
    sent = 0.0 if n == 1 else profile.gradient_bytes / k  # a remote worker's push
    return Prediction(candidate.label, n, compute, step, remote - compute, step - compute, 0.0, sent)


def exact_released_together(profile: Profile, candidate: Candidate, workers: int, overlap: bool) -> bool:
    """Whether ``candidate`` is exact (data parallel, full precision: one collective a step) at ``workers``
    ranks sharing cores (``ranks_per_core`` above 1) over a link (``overlap``: not through memory) with
    :attr:`Profile.synced_straggler_s` timed: its step then waits that straggler, not ``straggler_s``.

    At 4 ranks on 2 cores over loopback, exact's ranks leave their exchange a time slice apart (about 7
    ms for the digits CNN) and two compute while two wait (``docs/experiments/exact_stagger.py``): the
    step pays the wait of steps run free. Over a shaped link the same step's exchange is bound by the
    wire, which releases every rank at once, and their computes start together: the digits CNN's exact
    at 1 Gbit/s stepped in 32.0 ms, as on loopback (31.2 ms), where a 15.5 ms exchange on top of
    loopback's step had priced it +36% (predict-30)."""
    if workers <= 1 or not overlap or profile.ranks_per_core <= 1 or profile.synced_straggler_s is None:
        return False
    options = candidate.options
    return (
        candidate.algorithm == "data_parallel"
        and int(_option(options, "bits", 32)) == 32
        and options.get("compression") not in ("fp16", "bf16")
    )


def async_rank_steps(
    profile: Profile,
    network: Network,
    candidate: Candidate,
    workers: int,
    *,
    overlap: bool = True,
    spare_core: bool | None = None,
) -> tuple[float, float, float]:
    """``(compute, rank 0's worker's step, a remote worker's step)`` of async SGD, before the measured fixed
    costs (:func:`predict` adds them, :func:`async_fixed_labels`): ``compute`` as the ranks' sharing of
    cores leaves it (:func:`shared_compute`), rank 0's worker reaching the server in-process, a remote
    worker paying its round trip (:func:`async_step`). Arguments as :func:`predict`'s.

    Without a spare core the server thread's work of a round, ``(N - 1)`` pushes and pulls through
    memory and applies, counts as one more thread on the CPU for the share of each remote step it
    fills (:func:`shared_compute`), slowing every rank's compute; rank 0's worker is not charged it
    alone. Charged to rank 0's worker, the 10.5M MLP at 4 workers on 2 cores over loopback had
    rank 0's worker at 438-547 ms, measured 108-134 ms, and its job +16% to +52% (predict-21 to
    predict-23; docs/experiments/plan.md, "The server thread as one more thread"). With a
    core per rank the server's work fills exactly the remotes' round trips and nothing slows.

    Rank 0's worker computes at :attr:`Profile.core_compute_s` where ranks share cores and it was
    timed (the compute of a rank on a core of its own), not at the shared compute: that sharing
    prices the remote workers, which wait; rank 0's worker never does, and measured it stepped at
    about the same speed on loopback as on 100 Mbit/s links (docs/experiments/plan.md, "Rank 0's worker on a
    core of its own"). Its passes stay priced at the shared compute's slowdown, as the server's are."""
    check_int("workers", workers, minimum=1)
    n = workers
    compute = profile.compute_s
    k = block_steps(int(_option(candidate.options, "sync_period", 1)), profile.batch)
    nbytes = profile.gradient_bytes  # a message carries the parameters in their own dtypes
    ranks_per_core = max(1.0, profile.ranks_per_core)
    alone = compute / ranks_per_core

    def pass_s(c: float) -> float:  # one pass over the parameters while the compute takes c
        if n <= 1:
            return 0.0
        if profile.core_copy_s_per_element > 0 and ranks_per_core > 1:  # slowed as the compute is
            return profile.core_copy_s_per_element * profile.params * max(1.0, c / alone)
        return profile.copy_s_per_element * profile.params

    crowded = not (overlap if spare_core is None else spare_core) and n > 1

    def steps(c: float) -> tuple[float, float, float]:  # (remote step, server's round work, a remote's passes)
        apply_s = ASYNC_SERVER_PASSES * pass_s(c)  # the server's work on a remote push, between receive and reply
        local_s = ASYNC_REMOTE_PASSES * pass_s(c)
        remote_s, _ = async_step(c, nbytes, n, network, k, apply_s, local_s, convoy=not crowded)
        # no spare core: the server thread's transfers and applies of a round are CPU work beside the ranks'
        server_s = (n - 1) * (2 * (network.latency_s + nbytes / network.bandwidth) + apply_s) / k if crowded else 0.0
        return remote_s, server_s, local_s

    def busy(c: float) -> float:  # threads on the CPU per rank: rank 0's worker always, the server thread
        remote_s, server_s, local_s = steps(c)
        remotes = (n - 1) * min(1.0, (c + local_s / k) / remote_s)
        return (1 + remotes + min(1.0, server_s / remote_s)) / n

    if n > 1 and (crowded or ranks_per_core > 1):  # ranks waiting leave their cores to the others
        compute = shared_compute(compute, ranks_per_core, busy)
    remote = steps(compute)[0]
    # rank 0's worker reaches the server in-process and never waits: where ranks share cores and the
    # compute of one rank per core was timed, it computes at that, whatever the remotes do
    own_compute = profile.core_compute_s if n > 1 and ranks_per_core > 1 and profile.core_compute_s > 0 else compute
    own = own_compute + ASYNC_OWN_PASSES * pass_s(compute) / k
    return compute, own, remote


def async_fixed_labels(label: str) -> tuple[str, str]:
    """The :attr:`Profile.fixed_s` labels of an async candidate's two fixed costs: ``(label, label + "/remote")``,
    rank 0's worker's step and a remote worker's, each beyond what :func:`predict` counts for that side.

    The two sides differ: on the tiny model of :func:`bunsan.algorithms.measure.measure_fixed_costs`
    at 4 workers on 2 cores a remote worker's round trip (a wake-up of rank 0's server thread and of
    its own, both queued behind the others') takes milliseconds where rank 0's worker, which never
    waits, takes its local step. Taken as one excess of the slowest rank over the job's step and added
    to the job's step, it charged the remote workers' excess to rank 0's worker too, which is most of
    the job (``N / sum(1 / step_r)``): MNIST-1D's async at 4 workers was predicted +53% to +60%
    (docs/experiments/plan.md, "Checking the predictions"). A profile without the remote label prices the remote
    side with none.
    """
    return label, f"{label}/remote"


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
    spare_core: bool | None = None,
) -> list[Prediction]:
    """:func:`predict` for every candidate at every worker count (worker counts outer)."""
    return [
        predict(profile.at_workers(n, global_batch=global_batch), network, c, n, overlap=overlap, spare_core=spare_core)
        for n in workers
        for c in candidates
    ]
