"""What the cost models read and return: a worker's :class:`Profile`, a :class:`Candidate` setting and
its :class:`Prediction`.

Plain frozen records, shared by the synchronous model that ``algorithm="auto"`` decides with
(:mod:`bunsan.algorithms.cost_model`) and the asynchronous and core-sharing pricing that only
``bunsan plan`` and the cost model's validation add (:mod:`bunsan.algorithms.async_model`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from bunsan._validate import check_int, check_number, check_type
from bunsan.algorithms.network_model import check_seconds

__all__ = ["ALGORITHMS", "Candidate", "Prediction", "Profile"]

ALGORITHMS = ("data_parallel", "block_momentum", "model_averaging", "async")


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
            (:func:`~bunsan.algorithms.cost_model.block_round_passes`), at ``copy_s_per_element`` each.
        copy_s_per_element: one pass over the parameters in memory (a float32 copy), per
            element: async SGD's in-process exchange is made of such passes
            (:data:`~bunsan.algorithms.async_model.ASYNC_OWN_PASSES`,
            :data:`~bunsan.algorithms.async_model.ASYNC_REMOTE_PASSES`), and so is a block round beside
            its all-reduce (:func:`~bunsan.algorithms.cost_model.block_round_passes`); 0 where not measured.
        straggler_s: how much longer the slowest of the workers takes, on average, than
            their mean compute in a step (:func:`~bunsan.algorithms.cost_model.compute_with_stragglers`); a
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
            of one call per segment (:func:`~bunsan.algorithms.cost_model.codec_calls`).
        codecs: the codec at other bit widths, ``(bits, encode_s_per_element,
            decode_s_per_element, codec_call_s)`` each, or with ``encode_call_s`` and
            ``decode_call_s`` after them; a quantized candidate of those bits uses its own entry
            (8-bit encoding costs several times 1-bit's per element on CPU), any other the
            fields above.
        core_copy_s_per_element: that copy timed with one rank per core copying at once (the
            others waiting), where ``ranks_per_core`` is above 1; 0: not timed, the passes priced
            at ``copy_s_per_element``. Async SGD's passes then cost it times the slowdown
            :func:`~bunsan.algorithms.async_model.shared_compute` gives the compute
            (:func:`~bunsan.algorithms.async_model.async_rank_steps`): timed with every rank at once, 4 ranks on 2 cores, the 10.5M MLP's copy came out at 5.9-11.4 ms in
            bunsan's validation runs (docs/experiments/predict/) and 10.9-15.9 ms in a probe after (a copy is short beside a time
            slice: how often a rank is preempted decides it), with one rank per core at once
            5.4-7.7 ms, and rank 0's worker, on a core of its own while the remote workers wait
            on 100 Mbit/s links, made its six passes at 5-7 ms each (priced at the first, its
            job was predicted 22-31% slow in three runs).
        core_compute_s: ``compute_s`` timed with one rank per core computing at once (the others
            waiting, :func:`bunsan.algorithms.measure.in_turns`), where ``ranks_per_core`` is above 1;
            0: not timed, rank 0's worker priced at the shared compute
            (:func:`~bunsan.algorithms.async_model.shared_compute`), as the remote workers are. Async
            SGD's rank 0 worker, which never waits, is priced at it whatever the remote workers do
            (:func:`~bunsan.algorithms.async_model.async_rank_steps`): at 4 workers on 2 cores, its fixed cost taken out, its step was 0.63-0.73 of ``compute_s``
            on every network for the digits CNN and ResNet-20 (0.44-0.84 for MNIST-1D's 4-6 ms
            steps; bunsan's validation runs (docs/experiments/predict/)), where the model's sharing gave it the whole ``compute_s``
            while the remotes computed (loopback, 1 Gbit/s) and ``compute_s / 2`` while they
            waited (100 Mbit/s), and a rank on a core of its own is slower than half of two
            sharing it (the 2-worker jobs' compute was 1.63-1.94 times less, not 2): the job's
            step, which rank 0's worker sets most, came out +6% to +15% on loopback and -16% to
            -21% at 100 Mbit/s for those three models (docs/experiments/plan.md, "Rank 0's worker on a core
            of its own").
        ranks_per_core: the ranks of a host over its usable cores while ``compute_s`` was timed,
            every rank computing at once (1: a core or more each). Above 1 a rank computes
            faster while others wait: async SGD's remote workers spend their round trips off the
            cores (:func:`~bunsan.algorithms.async_model.shared_compute`). Synchronous steps compute and
            wait together, so only async reads it.
        fixed_s: seconds a candidate costs beyond what the model counts (the framework's
            hooks and bookkeeping, the in-situ latency of waking the backend's threads),
            ``(label, seconds)`` per candidate label: per step, but per block for the block
            algorithms (their synchronization is once a block; :func:`~bunsan.algorithms.cost_model.predict` divides by
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

    def option(self, name: str, default: Any) -> Any:
        """The option ``name``, or ``default`` where it is not given or ``None``."""
        value = self.options.get(name, default)
        return default if value is None else value


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
