"""``Auto``: train exactly for a few steps while measuring, then switch every rank to the predicted fastest algorithm.

``bunsan.distribute(model, optimizer, "auto")`` (or ``bunsan.Auto(...)``) starts
as exact :class:`~bunsan.algorithms.data_parallel.DataParallelSGD`. After
``measure_steps`` steps, or sooner where steps are slow (below), it takes, collectively:

* the step time of exact SGD on this job (median over the steps, slowest rank);
* the network of the job's own process group: all-reduces and all-gathers of
  several sizes fitted to alpha and beta (:func:`bunsan.algorithms.measure.measure_network`);
* the codec's speed, timed on every rank at once as the exchange encodes
  (:func:`bunsan.algorithms.measure.measure_codec`, ``collective=True``).

Rank 0 feeds them to :mod:`bunsan.algorithms.cost_model`. On CPU, with the network
measured, the compute per step is measured too: each rank's time outside the gradient
exchange (its step less its wait in the exchange), the ranks' mean; what the exact step
holds beyond that compute, the exchange predicted for it and its fixed cost is the time a
synchronous step waits for its slowest rank (``straggler_s``; :func:`split_compute`), which
a block algorithm pays once a block. Ranks that share cores spend most of it: at 4 workers
on 2 cores the MNIST-1D CNN's exact step took 12-15 ms, of which 3.7-3.8 ms outside the
exchange, and model averaging's local steps 2.8-6.7 ms (docs/experiments/exchange_wait.py). Otherwise (a given network, a GPU, whose backward
returns before its kernels end) the compute is what remains of the measured exact step
once the exposed exchange predicted for it is taken off (a fixed point, as the exposed
part depends on the compute that hides it), which charged every algorithm the waiting of
a synchronous step: on that machine it put model averaging only 10% ahead of exact where
its epochs were 1.7 times as fast at 2 workers and 3 times at 4. It predicts every candidate the accepted ``risk`` allows and keeps the
fastest, but only when it beats exact SGD by ``min_gain``: exact SGD is the only
one without an accuracy cost. Rank 0 broadcasts the decision, every rank builds
the same algorithm at the same step, and rank 0 prints one short table.

The candidates, by ``risk`` (what bunsan's own accuracy measurements support;
docs/how-to/choose-algorithm.md):

* ``"low"``: exact; fp16 traffic.
* ``"medium"`` (default): also 8-bit and 2-bit quantized gradients with error feedback.
* ``"high"``: also 1-bit (with ``rotate=True`` under SGD momentum >= 0.7, where
  plain 1 bit failed on MNIST-1D), block momentum and model averaging.

Rules for the settings: the measuring steps are the warm start of compressed and block
algorithms (``warm_start`` adds to it, in global samples); a block is the smallest of 2,
4, 8, 16 or 32 steps whose amortized exchange costs at most 5% of the compute, as small
blocks stay closest to exact SGD, and at decision time never longer than 32 steps even
where the exchange then costs more (past it, see below). The cap is bunsan's block-length sweep
(``docs/experiments/block_sweep.sh``, docs/experiments/plan.md): each model's block algorithm at 8
to 128 steps per block against exact SGD, seeds 0-2, on loopback and at 100 Mbit/s. On
the digits CNN the epochs to exact's final error plus a point stay at 8-10 from 8 to 32
steps and grow to 9-11 at 64 and 14 at 128; on MNIST-1D they stay at 26-29 up to 128. In
time to that error 32-step blocks beat 16-step ones in all 8 of the sweep's rows
(1.00-1.15 of the fastest setting against 1.14-1.62); longer blocks were faster only on
MNIST-1D, whose epochs do not grow (64-128 steps, 3-15% faster than 32), and tied at 64
steps on the digits CNN at 100 Mbit/s and 4 workers. The earlier cap of 16 steps
followed Lin et al. 2020 ("Don't Use Large Mini-Batches, Use Local SGD", ICLR), whose
local SGD matches minibatch SGD up to about 16 local steps; the sweep is the measurement
on bunsan's own models.

Past the cap, the job's own times decide: after deciding on a block at the cap, Auto
times the first block's local steps (median, end to end) and the exchange that ends it
(the whole round: its all-reduces, waits included, and its passes over the parameters) on every rank; the next round's sample
counts carry them (no collective of their own, so a rank that has joined takes part
alike), and every rank lengthens the block from their means by the same rule
(:func:`lengthened_block`): doubled while a doubling cuts the time per step by more than
the most a doubling past 32 steps cost that algorithm, as Auto builds it, in epochs to target in
bunsan's sweeps (:data:`EPOCH_GROWTH`), up to 256 steps, the longest block they measured. Block
momentum (``block_learning_rate`` 1): 14/9, the digits CNN at 4 workers, 64 to 128 steps, 9 to
14 epochs (every other doubling of it 1.0-1.4: the digits CNN at 2 workers, 32 to 64, 8 to 11;
the 10.5M MLP at 4 workers, 32 to 64, 8, 11, 8 to 11, 11, 10 by seed). Model averaging: 15/13,
the digits CNN at 4 workers, 32 to 64 steps, 13 to 15 epochs (the MLP's took as many epochs or
fewer, MNIST-1D's 26-29 at every length). So the time to target falls where the block
doubles even if the epochs grow that much, which happens only where the exchange a step
exceeds 2.5 times the compute for block momentum and 0.36 times for model averaging,
whose epochs barely grow with its blocks. Until 2026-11-28 one factor served both, 1.625
(the MLP's worst doubling under block momentum at ``block_learning_rate`` 0.5, which Auto
never builds): it kept the 10.5M MLP at 100 Mbit/s and 4 workers at 32 steps with the
exchange 3.15 times its 58 ms local step (1.32 of the best setting's time to accuracy; 1.16
with its blocks lengthened to 64 steps by this rule), and MNIST-1D's model averaging at 32
steps at 4 workers, where this rule lengthens 12 of 18 runs to 64 and shortens their whole
runs without moving their time to accuracy (docs/experiments/plan.md, runs 45-47). The first
step cannot decide this (its compute is only an upper bound), nor the exact steps on a
slow link (each costs a whole exchange); the first block times the steps the job will
take. The check and its figures go into the decision (``block_check``), so a resumed run
builds the lengthened block. The two block algorithms exchange the same bytes once per block
and are predicted alike (block momentum's Nesterov start costs a third of a pass over the
parameters more a round; within 1%, :data:`BLOCK_TIE`, the two are a tie); a tie goes by
the optimizer's own momentum. Block momentum
(BMUF, Chen and Huo 2016) filters the block updates with a momentum of ``1 - 1/N``,
which stacks on the optimizer's: with SGD momentum 0.9 on MNIST-1D at 4 workers it ended
1.9-4.7 points behind exact where model averaging ended 0.4 behind (README, accuracy
table), so from momentum 0.5 the tie goes to model averaging, the plain local SGD of Lin
et al. Without momentum the block momentum is what the optimizer lacks: on the digits
CNN at 4 workers (SGD, no momentum) Auto's block momentum with blocks of 16 steps was at
0.8% test error after 10 epochs and model averaging at 4.4% (exact SGD ends at 1.1%
after 30; time-to-accuracy campaign, docs/experiments/plan.md), so below 0.5 it goes to block
momentum.

Where the timed steps keep exact and a block algorithm is predicted faster than exact by at least
``min_gain`` less :data:`TRIAL_WINDOW` (10 points: from 0% at the default), the block algorithm the
tie rule would take goes on trial (:func:`trial_candidate`): blocks of :data:`TRIAL_STEPS` (8) local
steps, whose timed local steps and round (as the first block past the cap is timed, below) ride on the
second round; there every rank keeps it, its block at the cap or past it by :func:`lengthened_block`,
where a step at that block beats exact's measured step by ``min_gain`` (:func:`trial_verdict`), and
otherwise returns to exact, the local optimizers' states averaged as the round averaged the models (a
rank that has joined keeps the block: the hand-over needs every rank). On ResNet-20 at 2 workers on
1 Gbit/s (2 shared cores) Auto kept exact predicting block momentum 4.0-9.1% faster, while the block
algorithms' epochs ran 9-13% shorter and reached the target in 5 epochs to exact's 6 (time to accuracy
1.29 of the best setting; docs/experiments/plan.md, run 60); with the trial, 0.96 (run 61). Its timed local steps
matched the compute measured in exact steps within 1-3% (runs 61-62): the prediction fell short by
pricing the block-size rule's block of 2-4 steps, whose round of 10-33 ms still cost 3-8 ms a step,
where the trial's verdict prices the cap's (about 1 ms). A trial costs 16 steps of short blocks, about as fast as exact where it
returns. The record keeps it (``decision["trial"]``: the candidate, its predicted gain, the timed local
step, round, gain and outcome); a run resumed before the verdict starts the trial over. Rounds made
by ``sync_replicas()`` (an evaluation's) carry no report: a loop that calls it every step never
reaches the verdict (nor the block check past the cap), and its blocks stay at 8 steps.

Measuring stops early once the slowest rank's timed steps add up to
``measure_budget_s`` (0.1 s), after at least 3 of them, or 2 where the job's time of
each (the slowest rank's, step by step: a synchronous step ends when its slowest rank
ends) agrees within ``min_gain``: where a step takes tens of milliseconds or more, its
time is far above the machine's timing noise and 2-3 steps pin it down, while 10 exact
steps cost most where exact is slowest (58-92 ms each for the digits CNN at 100 Mbit/s
in bunsan's time-to-accuracy campaign, 3.9 s each for the 10.5M MLP at 100 Mbit/s and 2
workers). A third step is timed where the two differ by more than the margin the decision
itself asks: one outlier then cannot be the mean. From the second timed step on, each
measuring step all-reduces three numbers, so that every rank stops at the same step.

Where steps take milliseconds, the budget is not reached before ``measure_steps``; after 3
timed steps Auto measures (network, codec, the fixed-cost probes wanted at any of the step
times below) and predicts at their median, at the fastest and at the slowest (each the
slowest rank's time of that step). Where all three choose the same algorithm with the same
settings (the block's length aside: :func:`same_choice`), it decides then, with the
median's block (recorded as ``step_span_s``): the step times that more measuring steps
would add are unlikely to fall far outside what 3 have shown, and within that span they
cannot change the choice. Otherwise measuring goes on to the budget or ``measure_steps``, and the decision
there reuses the network, codec and probes measured (no probe twice). On MNIST-1D's CNN at
2 workers, 10 exact measuring steps act as a warm start that delayed model averaging by a
median of 2 epochs to target over 8 seeds, and a warm start of 4 steps by none (docs/experiments/plan.md).

The first step may decide at once: its time (from distribute() on, on the slowest rank) is an
upper bound of the step's (the first step also pays one-time costs), and where predictions
from that bound choose a block algorithm that beats exact and fp16 by ``min_gain`` without
the fixed-cost probes, a shorter step would choose a block algorithm too, its block as long or
longer (:func:`settled_by_first_step`). Measuring on could then only confirm the algorithm with
exact steps, so Auto decides at step 0. Where the bound's block is at the 32-step cap, so is the
true one; where it is shorter, Auto decides at the cap and the first block's timed local steps
and round set the length by the same 5% rule (:func:`block_from_timed`, never under the bound's
block; past the cap as below). The 10.5M MLP at 100 Mbit/s, 2 workers, needs the early decision
most: its exact steps take 3.9 s, and Auto's 3 of them cost 10 s of a 34 s time to accuracy
against the same block setting trained from the start (docs/experiments/plan.md, run 15); at 1 Gbit/s, where
its exact steps take 0.4-0.6 s, deciding at step 0 took its time to accuracy from 1.00 to 0.73 of
the rule before (a first step of 1 s or more) side by side (docs/experiments/plan.md, after run 39). From
53c86f5 to 2026-11-28 Auto decided at step 0 only where the bound's block was at the cap and 2
more exact steps would cost ``measure_budget_s`` (0.1 s) over it; that left MNIST-1D's CNN at 4
workers measuring 4 exact steps and deciding twice (0.2 s and more of a 3.7 s time to accuracy)
at the seeds where the first step had already settled model averaging (1-2 of 6 at 100 Mbit/s
and 1 Gbit/s, docs/experiments/plan.md, run 48: its bound's gain sits near ``min_gain``). Exact measuring steps are no warm start worth keeping: on MNIST-1D's CNN 4
of them delayed model averaging by no epoch at 2 workers, 10 by a median of 2 (above), and at 4
workers its crossing came 1.5-2.5 epochs after the same setting trained from step 0 (runs 45-47).
Where the first step leaves the choice open, the second decides the same way, before its exchange:
its time (from the end of the first step, the slowest rank's) is one sample of the steady step's
and counts as a bound at :data:`SECOND_STEP_MARGIN` (2) times, the spread of bunsan's timed exact
steps (over 79 span checks of the campaigns the median of 3 was at most 1.86 times the fastest).
The run is then exact SGD for one step and the decided algorithm after it. Where neither settles
it, the network and codec measured at the first step serve the later decision.

That first step is timed twice: at the end of its backward, before any of its buckets leaves
(a fresh run's first exchange waits for it), and after its exchange. At the end of backward,
every rank measures the network and the cost of a copy (a block round's passes), and rank 0
adds the exact exchange they predict to the first step's compute: where that exact step
settles a block algorithm, as above, Auto decides there, and the exchange it would
make pointless is never sent. The codec prices only fp16 and the quantized exchange, so it is
left out of that first prediction (those candidates at their fastest): a block that they
cannot beat even so stays settled at any codec cost, and the codec is measured only where
the choice is still open (on the 10.5M MLP at 4 workers it was about 0.7 s of 1.4 s of
measuring; the record then says ``codec_measured: False``). The decided algorithm starts at
step 0 from the broadcast model, whose backward becomes its first local step (the run equals
that algorithm's from the start, bit for bit: tests/dist/test_auto.py). On the 10.5M MLP at 100 Mbit/s and 4 workers that exchange, a 42 MB
all-reduce, was 5.8 s of Auto's 48 s to accuracy (docs/experiments/plan.md, run 17). Where it does not
settle, the exchange goes on, and the network and codec measured serve the later decision; the
first step's time leaves their measuring out. The price is one exchange not overlapped with
backward, once. Not with a user's ``warm_start`` (it asks for exact steps first). A rank whose
first backward reaches no parameter meets the others' measuring in ``optimizer.step()``, where
its exchange would have run, with the same collectives.

Every rank must take at least ``measure_steps + 1`` steps: the decision is
collective, and a rank that has already called ``join()`` does not take part in it.

The decision and the measurements go into ``state_dict()``; loading it builds
the decided algorithm directly, so a resumed run does not change algorithm, unless
it is asked to (``on_resume="decide"``: a job moved to another cluster) or the state
was saved by a job of another number of ranks, for whose worker count and network the
decision was predicted: then it measures and decides again, with a warning, and the
counters go on. (A ``TrainingSession`` restoring into another number of workers starts
the algorithm's state afresh anyway.) A run checkpointed before
the decision keeps its timed steps and goes on measuring; where it decides, and
what, depends on step times (``measure_budget_s``, the network, the codec), so it
need not decide as an uninterrupted run of the same job would. A resume that must
equal an uninterrupted run bit for bit needs both runs to decide alike: checkpoint
after the decision, or fix the inputs (``measure_budget_s=None``, a given
``network``; tests/dist/test_training_session.py does both).

This is a thin wrapper: the wrapped algorithm (``self.inner``) does the work.
Delegated: ``setup`` (builds the exact one), ``setup_buffers``,
``attach_optimizer``, ``count_samples``, ``note_forward``, ``confirm_forward``,
``reduce_gradients``, ``complete_exchange``, ``after_step`` (plus the decision),
``join``, ``sync_replicas``, ``begin_accumulation``, ``end_accumulation``,
``stats``, ``state_dict``/``load_state_dict`` (nested), and the counters
``step``, ``samples``, ``local_samples``, ``traffic``, ``buffer_sync``; other
public attributes are read from the inner algorithm.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from bunsan import comm, runtime
from bunsan._validate import check_choice, check_int, check_number, check_type
from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.base import Algorithm
from bunsan.algorithms.block_momentum import BlockMomentumSGD
from bunsan.algorithms.blockwise import BlockwiseSGD
from bunsan.algorithms.data_parallel import HEAVY_MOMENTUM_1BIT, DataParallelSGD
from bunsan.algorithms.data_parallel.stripes import coded_per_bucket
from bunsan.algorithms.measure import (
    can_overlap,
    measure_codec,
    measure_codecs,
    measure_copy,
    measure_fixed_costs,
    measure_network,
    synchronize,
)
from bunsan.algorithms.model_averaging import ModelAveragingSGD
from bunsan.compression import Quantizer
from bunsan.errors import CheckpointError

__all__ = [
    "PROBE_FAMILIES",
    "Auto",
    "candidates_for",
    "choose",
    "codec_can_settle",
    "infer_compute",
    "later_probes_needed",
    "lengthened_block",
    "probe_family",
    "probes_needed",
    "same_choice",
    "trial_candidate",
    "trial_verdict",
]

RISKS = ("low", "medium", "high")
ON_RESUME = ("keep", "decide")  # Auto(on_resume=...): keep a saved decision, or measure and decide again
# an optimizer momentum under this: a tie between the block algorithms goes to block momentum, else
# to model averaging (module docstring); measured at 0 and 0.9 only
BLOCK_MOMENTUM_BELOW = 0.5
# an all-reduce this long is far past the latency: larger probe sizes would only cost time
ENOUGH_S = 0.02
# the network probe once more when the first fit found no growth with size: on loopback the
# 4-byte all-reduce's median of 3 can exceed a 1 MiB one's (2 of 6 campaign runs on a loaded machine)
RETRY_SIZES = (4, 1024 * 1024, 4 * 1024 * 1024)
BLOCK_STEPS = (2, 4, 8, 16, 32)  # local steps per block; the last is the cap (module docstring)
MIN_TIMED = 3  # the fewest timed steps an early end of measuring rests on (measure_budget_s) ...
MIN_AGREEING = 2  # ... or these many, where they agree within min_gain (Auto._budget_spent)
BLOCK_BUDGET = 0.05  # a block's amortized exchange may cost this share of the compute
# Past the cap (module docstring): by block algorithm as Auto builds it, the most a doubling of the
# block past 32 steps cost in epochs to target in bunsan's sweeps (docs/experiments/plan.md): block momentum at
# block_learning_rate 1, the digits CNN at 4 workers, 64 -> 128 steps, 9 -> 14 epochs (median of
# seeds 0-2); model averaging, the digits CNN at 4 workers, 32 -> 64 steps, 13 -> 15. And the
# longest block they measured.
EPOCH_GROWTH = {"block_momentum": 14 / 9, "model_averaging": 15 / 13}
# The second step's compute, one sample, counts as a bound at this multiple: over 79 span checks of
# bunsan's campaigns (docs/experiments/plan.md) the median of 3 timed exact steps was at most 1.86 times the fastest
SECOND_STEP_MARGIN = 2.0
MAX_BLOCK_STEPS = 256
BLOCK_ALGORITHMS = ("block_momentum", "model_averaging")
# block algorithms predicted within this share of each other are a tie (choose): it goes by momentum
BLOCK_TIE = 0.01
# The trial (Auto._end_trial): where exact is kept and a block algorithm is predicted faster by at least
# min_gain less this share, blocks of TRIAL_STEPS local steps run until the round after the first one,
# whose timed local steps and round keep the block algorithm or return to exact. On ResNet-20 at 2 workers
# on 1 Gbit/s the block algorithms were predicted 4.0-9.1% faster than exact where their epochs ran 9-13%
# shorter (docs/experiments/plan.md, run 60); timed, a step at the 32-step cap was 7.5-13.5% faster (runs 61-62).
TRIAL_WINDOW = 0.1
TRIAL_STEPS = 8
# The fixed-cost probe's steps per candidate: 2 untimed (one block of the block probe, 2 steps),
# then 3 timed runs of 4 (14 steps, against 24 with runs of 6 warmed up by one whole run): the 4
# probes of risk="high" took 0.13 s instead of 0.20 at 2 workers and 0.49 s instead of 0.79 at 4
# on 2 cores (medians of 6 trials), with fixed costs that spread over the trials about as much
# as before (docs/experiments/probe_cost.py; docs/experiments/plan.md)
PROBE_STEPS, PROBE_WARMUP, PROBE_REPEATS = 4, 2, 3
# What a decision may build, by registry name. Imported directly, not through the registry in
# bunsan.algorithms, which imports this module (no import cycle).
_CHOICES: dict[str, type[Algorithm]] = {cls.name: cls for cls in (DataParallelSGD, BlockMomentumSGD, ModelAveragingSGD)}


class _EarlyMeasures(NamedTuple):
    """What Auto measured after a first step that did not settle the decision (Auto._decide)."""

    network: cm.Network
    codec: dict[str, float]
    codecs: tuple[tuple[int | float, ...], ...]
    network_s: float  # seconds the network probe took
    spent_s: float  # seconds that whole measuring took
    # the fixed-cost probes run so far (the check at MIN_TIMED steps runs them; the first step does not)
    fixed: tuple[tuple[str, float], ...] = ()
    probed: frozenset[str] = frozenset()
    probe_s: float = 0.0  # seconds those probes took
    codec_deferred: bool = False  # only the copy measured: the codec waits for a decision it can change


def _delegated(name: str) -> Any:
    """A property that reads and writes ``self.inner.<name>``: the counters live in the inner algorithm."""

    def fget(self: Auto) -> Any:
        return getattr(self.inner, name)

    def fset(self: Auto, value: Any) -> None:
        setattr(self.inner, name, value)

    return property(fget, fset)


def infer_compute(
    step_s: float, profile: cm.Profile, network: cm.Network, workers: int, *, overlap: bool = True
) -> float:
    """The compute ``c`` with ``c + exposed exact exchange(c) = step_s`` (a few fixed-point rounds)."""
    exact = cm.Candidate("data_parallel", {}, "exact")
    compute = step_s
    for _ in range(20):
        trial = cm.Profile(**{**vars(profile), "compute_s": compute})
        predicted = cm.predict(trial, network, exact, workers, overlap=overlap)
        compute = max(step_s * 0.05, step_s - (predicted.step_s - compute))
    return compute


def split_compute(
    step_s: float,
    local_s: float | None,
    profile: cm.Profile,
    network: cm.Network,
    workers: int,
    *,
    overlap: bool = True,
) -> tuple[float, float]:
    """``(compute, straggler)`` of an exact step of ``step_s`` (the slowest rank's) whose ranks spent
    ``local_s`` each, on average, outside the exchange (their local compute; ``None``: not measured;
    Auto measures it on CPU where it also measures the network).

    Without ``local_s`` the compute is inferred (:func:`infer_compute`): what the cost model does not
    count in a synchronous step stays in it. Measured, the compute is ``local_s`` and the rest of the
    step, past the modelled exchange and fixed cost, is what a synchronous step spends waiting for its
    slowest rank (:attr:`bunsan.algorithms.cost_model.Profile.straggler_s`), so that exact's
    prediction is still the measured step. It matters where ranks share cores: on the 2-core machine
    of the docs, the MNIST-1D CNN's exact step at 4 workers took 12-15 ms, of which 3.7-3.8 ms outside
    the exchange on each rank, and the inferred compute was 9.4 ms where model averaging's local steps
    took 2.8-6.7 ms (docs/experiments/plan.md). ``local_s`` not under the inferred compute, or a straggler that
    would be negative (the model's exchange already exceeds what the step left), keeps the inferred
    compute, with no straggler.
    """
    inferred = infer_compute(step_s, profile, network, workers, overlap=overlap)
    if local_s is None or not 0 < local_s < inferred:
        return inferred, 0.0
    trial = cm.Profile(**{**vars(profile), "compute_s": local_s, "straggler_s": 0.0})
    exact = cm.Candidate("data_parallel", {}, "exact")
    straggler = step_s - cm.predict(trial, network, exact, workers, overlap=overlap).step_s
    return (local_s, straggler) if straggler > 0 else (inferred, 0.0)


def _block_size(profile: cm.Profile, network: cm.Network, workers: int, name: str, overlap: bool = True) -> int:
    for k in BLOCK_STEPS:
        candidate = cm.Candidate(name, {"block_size": k * profile.batch})
        if (
            cm.predict(profile, network, candidate, workers, overlap=overlap).exposed_s
            <= BLOCK_BUDGET * profile.compute_s
        ):
            return k * profile.batch
    return BLOCK_STEPS[-1] * profile.batch


def lengthened_block(steps: int, compute_s: float, exchange_s: float, growth: float) -> int:
    """Steps per block past the cap, from a block of ``steps`` that ran: doubled while a doubling cuts
    the time per step (``compute_s`` a local step, plus ``exchange_s`` a block amortized over its
    steps) by more than ``growth``, the most a doubling cost the algorithm in epochs to target in
    bunsan's sweeps (:data:`EPOCH_GROWTH`), up to :data:`MAX_BLOCK_STEPS`. Where it doubles, the
    time to target falls even if the epochs grow that much. With ``c`` the local step and ``e`` the
    exchange per step, a doubling pays where ``growth * (c + e/2) < c + e``, i.e. where
    ``e > c (growth - 1) / (1 - growth/2)``: 2.5 c for block momentum (growth 14/9), 0.36 c for
    model averaging (15/13)."""
    check_number("growth", growth, minimum=1.0, hint="the factor a doubling may cost in epochs to target")
    k = steps
    while k < MAX_BLOCK_STEPS and growth * (compute_s + exchange_s / (2 * k)) < compute_s + exchange_s / k:
        k *= 2
    return k


def block_from_timed(steps: int, floor_steps: int, compute_s: float, exchange_s: float, growth: float) -> int:
    """Steps per block from a first block of ``steps`` (the cap) that ran, after a decision made at the
    first step with its block under the cap: the block-size rule on the timed figures (the smallest
    of :data:`BLOCK_STEPS` whose round, ``exchange_s``, amortized costs at most ``BLOCK_BUDGET`` of a
    local step, ``compute_s``), never under ``floor_steps`` (the block the first step's compute, an
    upper bound, gave: a shorter step can only lengthen it); where the rule keeps the cap, past it by
    :func:`lengthened_block`. The decision on timed exact steps puts the same rule to their compute."""
    for k in BLOCK_STEPS:
        if k >= floor_steps and k < steps and exchange_s / k <= BLOCK_BUDGET * compute_s:
            return k
    return lengthened_block(steps, compute_s, exchange_s, growth)


def candidates_for(
    risk: str,
    profile: cm.Profile,
    network: cm.Network,
    workers: int,
    *,
    momentum: float = 0.0,
    warm_start: int = 0,
    overlap: bool = True,
) -> list[cm.Candidate]:
    """The candidates ``risk`` accepts, with their settings chosen by the documented rules."""
    check_choice("risk", risk, RISKS)
    found = [cm.Candidate("data_parallel", {}, "exact"), cm.Candidate("data_parallel", {"compression": "fp16"}, "fp16")]
    if risk in ("medium", "high"):
        found += [cm.Candidate("data_parallel", {"bits": b, "warm_start": warm_start}, f"{b}-bit") for b in (8, 2)]
    if risk == "high":
        rotate = momentum >= HEAVY_MOMENTUM_1BIT
        found.append(
            cm.Candidate(
                "data_parallel",
                {"bits": 1, "warm_start": warm_start, "rotate": rotate},
                "1-bit rotated" if rotate else "1-bit",
            )
        )
        # the two exchange alike and are predicted alike: a tie goes to the first (module docstring)
        order = ("model_averaging", "block_momentum")
        if momentum < BLOCK_MOMENTUM_BELOW:
            order = order[::-1]
        for name in order:
            size = _block_size(profile, network, workers, name, overlap)
            found.append(cm.Candidate(name, {"block_size": size, "warm_start": warm_start}, f"{name}:{size}"))
    return found


PROBE_FAMILIES = ("exact", "fp16", "quantized", "block")  # one fixed-cost probe each (Auto._probes)


def probe_family(candidate: cm.Candidate) -> str:
    """The fixed-cost probe family of a candidate: ``exact``, ``fp16`` (either half type), ``quantized``
    (every bit width: one striped exchange) or ``block`` (both block algorithms)."""
    if candidate.algorithm in BLOCK_ALGORITHMS:
        return "block"
    if "bits" in candidate.options:
        return "quantized"
    return "fp16" if candidate.options.get("compression") else "exact"


def probes_needed(
    candidates: Sequence[cm.Candidate], predictions: Sequence[cm.Prediction], min_gain: float, batch: int
) -> tuple[str, str]:
    """Which fixed-cost probes can change a decision predicted without them: ``(families, why)``.

    ``families``: ``"none"``, or the families of :data:`PROBE_FAMILIES` whose probes run,
    joined by ``+`` (e.g. ``"exact+block"``).

    Without the probes every candidate is charged exact's fixed cost: it stays in the
    inferred compute, or, where the compute is measured (:func:`split_compute`), in the
    wait for the slowest rank, which a block algorithm pays once a block (as ``sqrt(k)``
    times it). The probes take it out and charge each candidate its own. In the probe's medians (docs/experiments/plan.md) a block algorithm's fixed cost per step is
    below exact's, and exact's below fp16's and the quantized widths', so the probes can
    only lower a block algorithm's prediction against the per-step candidates'. A
    quantized width's probe can only slow it: its striped exchange makes two collectives
    per bucket where exact makes one, and its probe came out at 1.26-4.5 times exact's in
    all 18 pairs of ``bunsan bench predict``. fp16's probe may come out a little under
    exact's, hence a margin of ``min_gain`` for it.

    Where, without them, a block algorithm is the fastest and beats exact and fp16 by
    ``min_gain``: ``"none"`` if its block is already at the 32-step cap, where it stays;
    else ``"exact+block"``, for the block size: with both known the budget of the
    block-size rule (5% of the compute) shrinks and a block's exposed cost grows, so the
    block can only lengthen. Otherwise exact's probe (to take its fixed cost out of the
    compute) and the block probe (it can make a block algorithm the choice) run, fp16's
    where fp16 is within ``min_gain`` of the fastest, and the quantized probe where a bit
    width is the fastest (one that is not can only fall further behind). A candidate
    whose probe did not run is charged exact's fixed cost, under its own. Of the families
    named, fp16's and the quantized probe run second, after exact's and the block's, and
    only where :func:`later_probes_needed` finds they can still change the decision.
    """
    index, _ = choose(predictions, min_gain)
    chosen = candidates[index]
    fastest = min(range(len(predictions)), key=lambda i: predictions[i].step_s)
    best = predictions[fastest].step_s
    margin = f"{100 * min_gain:.0f}%"
    # exact and fp16 within min_gain of the fastest: their probes can lower them (fp16's may come out under exact's)
    close = {
        p.label: probe_family(c)
        for c, p in zip(candidates, predictions)
        if probe_family(c) in ("exact", "fp16") and p.step_s < (1 + min_gain) * best
    }
    if chosen.algorithm in BLOCK_ALGORITHMS and not close:
        lead = f"{chosen.label} is fastest and beats exact and fp16 by {margin} or more without them"
        if int(chosen.options["block_size"]) >= BLOCK_STEPS[-1] * batch:
            return "none", f"{lead}, at the {BLOCK_STEPS[-1]}-step cap"
        return "exact+block", f"{lead}; exact's and the block probe for its block size"
    if index == 0 and fastest == 0:
        why = "exact predicted fastest without them"
    elif index == 0:
        why = f"exact kept without them ({candidates[fastest].label} less than {margin} faster)"
    elif chosen.algorithm in BLOCK_ALGORITHMS:
        why = f"{', '.join(close)} within {margin} of {chosen.label}"
    else:
        why = f"{chosen.label} predicted fastest without them"
    families = ["exact"]
    if "fp16" in close.values():
        families.append("fp16")
    if probe_family(candidates[fastest]) == "quantized":
        families.append("quantized")
    if any(probe_family(c) == "block" for c in candidates):
        families.append("block")
    if families == ["exact"]:  # exact's probe alone moves its fixed cost out of the compute and back
        return "none", f"{why}: no probe can change the decision"
    return "+".join(families), why


def later_probes_needed(
    candidates: Sequence[cm.Candidate],
    predictions: Sequence[cm.Prediction],
    later: set[str],
    exact_fixed_s: float,
    min_gain: float,
) -> tuple[str, str]:
    """Which of the ``later`` probe families (``fp16``, ``quantized``) can still change the decision
    once exact's and the block probe have run: ``(families or "none", why they were skipped)``.

    ``predictions`` charge each candidate what the first probes found, and one whose probe did not
    run exact's fixed cost. A probe can only move its candidates from there to their own fixed
    cost; the decision is the fastest candidate against exact (:func:`choose`). A later family's
    probe is skipped where even its optimistic bound is not faster than the fastest other
    candidate: fp16 charged ``(1 - min_gain)`` of exact's fixed cost (its probe may come out a
    little under exact's), a quantized width exact's (its striped exchange makes two collectives
    per bucket where exact makes one: 1.26-4.5 times exact's in ``bunsan bench predict``). On
    the MNIST-1D CNN at 4 workers on 2 cores, 6.9 of the 9.1 ms of an exact step were fixed
    cost, and with it known the 32-step model averaging was predicted at 2.4 ms a step, far
    below fp16 at any fixed cost near exact's: fp16's probe (a third of the probing) could not
    change the choice.
    """
    optimistic = {"fp16": (1 - min_gain) * exact_fixed_s, "quantized": exact_fixed_s}
    keep, skipped = [], []
    for family in sorted(later):
        mine = [i for i, c in enumerate(candidates) if probe_family(c) == family]
        others = [p.step_s for i, p in enumerate(predictions) if i not in mine]
        if not mine or not others:
            continue
        # each of the family's predictions with its charged fixed cost (exact's) swapped for the bound
        bound = min(predictions[i].step_s - max(0.0, exact_fixed_s - optimistic[family]) for i in mine)
        if bound < min(others):
            keep.append(family)
        else:
            skipped.append(f"{family}'s probe skipped (at its lowest fixed cost still not the fastest)")
    return ("+".join(keep) if keep else "none"), "; ".join(skipped)


def settled_by_first_step(
    candidates: Sequence[cm.Candidate],
    predictions: Sequence[cm.Prediction],
    min_gain: float,
    batch: int,
) -> tuple[str, str] | None:
    """Whether predictions made from the first step's time already give the algorithm that the true
    step time would: ``("none", why)`` (no probe runs) where they do, else ``None``.

    The first step, timed from distribute() on, includes one-time costs (allocation, a lazy
    initialization, a GPU's kernel tuning, the user's own set-up), so its compute is an upper
    bound of the compute per step. Only one choice is certain at every compute below a bound: a
    block algorithm that beats exact and fp16 by ``min_gain`` without the fixed-cost probes
    (:func:`probes_needed`: the probes can only favour it). As the compute shrinks, the
    block-size rule's block can only lengthen (its amortized exchange covers a larger share of a
    shorter step); every per-step candidate's exposed exchange can only grow, as less compute
    hides it; and exact's lead over the block (its exposed exchange less the block's amortized
    one) only grows while the step it is measured against shrinks, so a block algorithm stays
    fastest and its gain over exact stays above ``min_gain``. Any other choice can change with
    the compute, and measuring goes on. ``tests/unit/test_auto.py`` checks the claim on the cost
    model over a grid of model sizes, networks, worker counts, momenta and first steps.

    The block's length is not settled where the bound puts it under the cap (at the true, shorter
    step it lies between that block and the cap): Auto then decides at the cap and its first block's
    timed local steps and round set the length by the same 5% rule (:func:`block_from_timed`,
    never under the bound's block). Measuring on would confirm the choice with exact steps only:
    on MNIST-1D's CNN at 4 workers (2 cores) its 4 exact steps and a second decision cost 0.25 s of
    a 3.7 s time to accuracy and shifted model averaging's crossing 1.5-2.5 epochs later (docs/experiments/plan.md,
    runs 45-47); until 2026-11-28 Auto decided here only where the bound put the block at the cap
    and 2 more exact steps would cost ``measure_budget_s`` over it.
    """
    index, _ = choose(predictions, min_gain)
    families, _ = probes_needed(candidates, predictions, min_gain, batch)
    chosen = candidates[index]
    # probes_needed names "exact+block" for a block algorithm under the cap that beats exact and fp16
    # by min_gain (those probes could only lengthen its block), "none" for one at the cap
    if chosen.algorithm not in BLOCK_ALGORITHMS or families not in ("none", "exact+block"):
        return None
    cap = BLOCK_STEPS[-1]
    lead_s = predictions[0].step_s - predictions[index].step_s  # exact's excess a step over the block's
    block = (
        f"at the {cap}-step cap"
        if int(chosen.options["block_size"]) >= cap * batch
        else f"its block as long or longer (decided at the {cap}-step cap; the first block's timed steps set it)"
    )
    return "none", (
        f"{chosen.label} beats exact and fp16 by {100 * min_gain:.0f}% or more without the probes, {block}; "
        f"settled by the first step (at any shorter step a block algorithm stays the choice; exact is "
        f"{lead_s * 1e3:.0f} ms a step slower at the first step's compute)"
    )


def codec_can_settle(
    candidates: Sequence[cm.Candidate],
    predictions: Sequence[cm.Prediction],
    min_gain: float,
    batch: int,
) -> bool:
    """Whether measuring the codec could make a first step's predictions, made without it, settle a block
    algorithm (:func:`settled_by_first_step`): only where they would settle it without fp16 and the
    quantized exchange, the two the codec prices (its cost can only slow them). Where exact itself
    is within ``min_gain`` of the block, no codec cost can change that, and the codec is left to the
    decision that prices every candidate: on MNIST-1D's CNN at 4 workers (2 cores) the decisions at the
    second step took a median of 0.21 s where the first had measured the codec (17 of 21: fp16 or 1 bit
    close to the block there) and 0.12 s where it had not (docs/experiments/plan.md, run 55)."""
    kept = [i for i, c in enumerate(candidates) if probe_family(c) not in ("fp16", "quantized")]
    return (
        settled_by_first_step([candidates[i] for i in kept], [predictions[i] for i in kept], min_gain, batch)
        is not None
    )


def same_choice(a: cm.Candidate, b: cm.Candidate) -> bool:
    """The same algorithm with the same settings, whatever the length of its block: what Auto's check after
    3 timed steps asks of the choice at their fastest and slowest step (the block comes from their median).

    The block-size rule halves or doubles the block as the compute estimate crosses its 5% budget,
    while the epochs to target barely move with it below the cap: in bunsan's block-length sweep
    (docs/experiments/plan.md, seeds 0-2) MNIST-1D's were 26-29 at every block from 8 to 128 steps and the digits
    CNN's 8-10 from 8 to 32 steps."""

    def settings(c: cm.Candidate) -> tuple[str, dict[str, Any]]:
        return c.algorithm, {k: v for k, v in c.options.items() if k != "block_size"}

    return settings(a) == settings(b)


def choose(predictions: Sequence[cm.Prediction], min_gain: float) -> tuple[int, str]:
    """Index of the chosen prediction (the first is exact) and why."""
    exact = predictions[0]
    best = min(range(len(predictions)), key=lambda i: predictions[i].step_s)
    if predictions[best].label.split(":")[0] in BLOCK_ALGORITHMS:
        # the two block algorithms differ by block momentum's Nesterov start, a third of a pass over the
        # parameters a round: within BLOCK_TIE the first listed wins (candidates_for: by momentum)
        best = next(
            i
            for i, p in enumerate(predictions)
            if p.label.split(":")[0] in BLOCK_ALGORITHMS and p.step_s <= (1 + BLOCK_TIE) * predictions[best].step_s
        )
    gain = exact.step_s / predictions[best].step_s - 1
    if best == 0:
        return 0, "exact is predicted fastest"
    if gain < min_gain:
        return 0, (
            f"{predictions[best].label} is predicted only {100 * gain:.1f}% faster than exact "
            f"(< min_gain {100 * min_gain:.0f}%): exact has no accuracy cost"
        )
    return best, f"predicted {100 * gain:.1f}% faster than exact (>= min_gain {100 * min_gain:.0f}%)"


def trial_candidate(
    candidates: Sequence[cm.Candidate], predictions: Sequence[cm.Prediction], min_gain: float
) -> int | None:
    """The block algorithm worth a trial (its index), or ``None``: where :func:`choose` keeps exact and the
    block algorithm it would take (the tie rule's) is predicted faster than exact by ``min_gain`` less
    :data:`TRIAL_WINDOW` or more. The prediction prices the block-size rule's block, whose exchange may
    still cost up to 5% of the step, and rests on a model of the exchange and the wait for the slowest
    rank; near the bar only timed local steps and rounds tell (run 60, docs/experiments/plan.md: 4.0-9.1% predicted,
    9-13% shorter epochs measured; runs 61-62: 7.5-13.5% faster steps timed at the cap)."""
    index, _ = choose(predictions, min_gain)
    blocks = [i for i, c in enumerate(candidates) if c.algorithm in BLOCK_ALGORITHMS]
    if index != 0 or not blocks:
        return None
    fastest = min(predictions[i].step_s for i in blocks)
    best = next(i for i in blocks if predictions[i].step_s <= (1 + BLOCK_TIE) * fastest)
    gain = predictions[0].step_s / predictions[best].step_s - 1
    return best if min_gain - TRIAL_WINDOW <= gain < min_gain else None


def trial_verdict(
    exact_step_s: float, local_step_s: float, round_s: float, min_gain: float, growth: float
) -> tuple[bool, int, float, float]:
    """``(keep, steps, block_step_s, gain)`` of a trial: the block at the 32-step cap, past it where the
    timed figures lengthen it (:func:`lengthened_block`), the time of a step at that block (a local step
    and the round amortized over the block) and its gain over exact's measured step; kept where that gain
    is at least ``min_gain``, the bar :func:`choose` sets. Every other candidate was predicted under that
    bar when exact was kept, so a block that clears it is also faster than they were predicted.

    The cap, not the block-size rule's shorter block (its exchange within 5% of the compute): a trial
    runs where the gain is near the bar, and a block shorter than the cap gives up to 5% of the step to
    its exchange. In bunsan's block-length sweep (docs/experiments/plan.md) 32-step blocks reached the target sooner
    than 16-step ones in all 8 rows, their epochs to target as few (8-10 on the digits CNN from 8 to 32
    steps, 26-29 on MNIST-1D). On ResNet-20 at 2 workers (runs 61-62) rounds of 10-33 ms against local
    steps of 110-115 ms put the rule's block at 2-4 steps, 3-8 ms a step, against about 1 ms at the cap."""
    steps = lengthened_block(BLOCK_STEPS[-1], local_step_s, round_s, growth)
    block_step_s = local_step_s + round_s / steps
    gain = exact_step_s / max(block_step_s, 1e-12) - 1
    return gain >= min_gain, steps, block_step_s, gain


@torch.no_grad()
def _average_optimizer_state(
    optimizer: torch.optim.Optimizer | None, params: Sequence[Tensor], group: ProcessGroup | None
) -> None:
    """Collective: every rank's floating-point optimizer state tensors of ``params`` (SGD's momentum,
    Adam's moments and its step count) become their mean over the ranks that hold them, and a rank
    that lacks one (a parameter its local steps never reached: a layer only some ranks' forward uses)
    takes that mean too, so that the exact steps after it update every replica alike (without the
    step count a rank's Adam would start that parameter's moments over). Where ranks stepped a
    parameter unequally often, the step count is their mean, and its bias correction follows it."""
    if optimizer is None:
        return
    index = {id(p): i for i, p in enumerate(params)}
    mine = sorted(
        (index[id(p)], key, tuple(value.shape), str(value.dtype), str(value.device))
        for p, state in optimizer.state.items()
        if id(p) in index
        for key, value in state.items()
        if torch.is_tensor(value) and value.is_floating_point()
    )
    holders: dict[tuple[int, str, tuple[int, ...], str, str], int] = {}
    for entries in comm.all_gather_object(mine, group=group):
        for entry in set(entries):
            holders[entry] = holders.get(entry, 0) + 1
    by_dtype: dict[str, list[tuple[int, str, tuple[int, ...], str, str]]] = {}
    for entry in sorted(holders):
        by_dtype.setdefault(entry[3], []).append(entry)
    device = comm.tensor_device(group)  # where the backend moves tensors (a CPU step count on NCCL too)
    for name, entries in by_dtype.items():
        held = [optimizer.state[params[i]].get(key) for i, key, *_ in entries]
        fits = [torch.is_tensor(h) and tuple(h.shape) == shape for h, (_, _, shape, *_) in zip(held, entries)]
        dtype = getattr(torch, name.removeprefix("torch."))  # the same on every rank, held or not
        flat = torch.cat(
            [
                (h.reshape(-1) if ok else torch.zeros(shape).reshape(-1)).to(device=device, dtype=dtype)
                for h, ok, (_, _, shape, *_) in zip(held, fits, entries)
            ]
        )
        comm.all_reduce(flat, group=group)
        offset = 0
        for h, ok, entry in zip(held, fits, entries):
            i, key, shape, _, where = entry
            numel = int(torch.Size(shape).numel())
            mean = flat[offset : offset + numel].view(shape) / holders[entry]
            offset += numel
            if ok:
                h.copy_(mean)
            else:
                optimizer.state[params[i]][key] = mean.to(torch.device(where)).clone()


class Auto(Algorithm):
    """Exact SGD while measuring, then the algorithm the cost model predicts fastest, on every rank.

    Args:
        measure_steps: exact steps timed before deciding (the first is not timed).
        measure_budget_s: decide sooner, once the slowest rank's timed steps add up to this
            many seconds (after at least 3 timed steps, or 2 that agree within ``min_gain``), or
            after 3 where the choice is the same at their fastest and slowest;
            ``None`` always takes ``measure_steps``.
        risk: which candidates are allowed: ``"low"`` exact and fp16 traffic; ``"medium"``
            (default) also 8- and 2-bit quantized gradients with error feedback; ``"high"`` also
            1 bit, block momentum and model averaging (docs/how-to/choose-algorithm.md).
        min_gain: a candidate replaces exact SGD only when predicted at least this much faster.
        warm_start: samples (global) trained exactly before compression or blocks start, counted
            from the beginning of training; the measuring steps count towards it.
        network: a known :class:`~bunsan.algorithms.cost_model.Network` instead of measuring it.
        fixed_costs: measure every candidate's fixed cost per step on a tiny model first
            (:func:`bunsan.algorithms.measure.measure_fixed_costs`, collective: a few tenths
            of a second), only those that can change the decision
            (:func:`probes_needed`); ``False`` counts exact's
            fixed cost in every candidate's compute instead.
        verbose: rank 0 prints the decision table.
        on_resume: what loading a saved state does with its decision. ``"keep"`` (default): the
            resumed run builds the saved choice without measuring again, unless the state was saved
            by a job of another number of ranks, whose network and worker count the decision was
            predicted for: then it measures and decides again (with a warning naming the old
            choice). ``"decide"``: measure and decide again in any case (a job moved to another
            cluster, or a resume that should re-check); the counters (steps, samples) go on.
        group: process group; ``None`` means every rank of the job.
    """

    name = "auto"

    def __init__(
        self,
        *,
        measure_steps: int = 10,
        measure_budget_s: float | None = 0.1,
        risk: str = "medium",
        min_gain: float = 0.1,
        warm_start: int = 0,
        network: cm.Network | None = None,
        fixed_costs: bool = True,
        verbose: bool = True,
        on_resume: str = "keep",
        group: ProcessGroup | None = None,
    ) -> None:
        self.inner: Algorithm = DataParallelSGD(group=group)
        super().__init__(group=group)
        self.measure_steps: int = check_int(
            "measure_steps", measure_steps, minimum=2, hint="exact steps timed before deciding"
        )
        if measure_budget_s is not None:
            measure_budget_s = check_number(
                "measure_budget_s", measure_budget_s, minimum=0.0, hint="seconds of timed steps, or None"
            )
        self.measure_budget_s: float | None = measure_budget_s
        self.risk: str = check_choice("risk", risk, RISKS)
        self.min_gain: float = check_number("min_gain", min_gain, minimum=0.0, hint="0.1 asks for 10% faster")
        self.warm_start: int = check_int("warm_start", warm_start, minimum=0, hint="global samples")
        if network is not None:
            check_type("network", network, cm.Network, hint="or None to measure it")
        self.network = network
        self.fixed_costs = check_type("fixed_costs", fixed_costs, bool)
        self.verbose = verbose
        self.on_resume: str = check_choice("on_resume", on_resume, ON_RESUME)
        self.decision: dict[str, Any] | None = None
        self._durations: list[float] = []  # seconds of measured steps (end to end)
        # the same steps less the time this process spent completing their exchange (its local compute)
        self._locals: list[float] = []
        self._measured = 0  # steps completed while measuring (kept across a resume)
        self._last_end: float | None = None  # perf_counter at the end of the last step, this process
        self._started: float | None = None  # perf_counter when distribute() attached the optimizer (step 0's start)
        # what a first-step decision measured when it could not decide yet: kept for the decision
        self._early: _EarlyMeasures | None = None
        self._first_checked = False  # the first step was weighed at the end of its backward (_before_exchange_check)
        # the second step is weighed at the end of its backward too where the first's bound left the choice open
        # (tests of the measuring after it turn this off)
        self._second_check = True
        # the local steps' times of the first block after deciding on a block at the cap (None: not timing)
        self._block_steps_s: list[float] | None = None

    # -- the counters live in the inner algorithm ---------------------------------------------------
    step = _delegated("step")
    samples = _delegated("samples")
    local_samples = _delegated("local_samples")
    traffic = _delegated("traffic")
    buffer_sync = _delegated("buffer_sync")
    _pending_samples = _delegated("_pending_samples")
    _unconfirmed_samples = _delegated("_unconfirmed_samples")

    def __getattr__(self, name: str) -> Any:  # public attributes of the chosen algorithm (bits, block_size, ...)
        if name.startswith("_") or "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    # -- delegation ----------------------------------------------------------------------------------
    def setup(self, named_params: Sequence[tuple[str, Tensor]]) -> None:
        self.named_params = list(named_params)
        self.inner.setup(named_params)

    def setup_buffers(self, modules: Sequence[tuple[str, Any, list[str]]]) -> None:
        self._buffer_modules = list(modules)
        self.inner.setup_buffers(modules)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.inner.attach_optimizer(optimizer)
        if (
            isinstance(self.inner, DataParallelSGD)
            and self.measure_budget_s is not None
            and self.warm_start == 0
            and self.world_size > 1
        ):
            self.inner.before_exchange = self._before_exchange_check  # at the end of the first backward
        self._started = time.perf_counter()  # distribute()'s last act: the first step starts after it

    def count_samples(self, n: int) -> None:
        self.inner.count_samples(n)

    def note_forward(self, n: int) -> None:
        self.inner.note_forward(n)

    def confirm_forward(self, n: int) -> None:
        self.inner.confirm_forward(n)

    def reduce_gradients(self) -> None:
        inner = self.inner
        inner.reduce_gradients()
        if self.inner is not inner:  # replaced at its first exchange, which ran here (no backward reached it)
            self.inner.reduce_gradients()

    def complete_exchange(self) -> None:
        self.inner.complete_exchange()

    def after_step(self) -> None:
        if self._block_steps_s is not None:
            self._time_block_step()
            return
        self.inner.after_step()
        if self.decision is None:
            synchronize(self._device())  # on a GPU: the step's kernels and exchange, not their launches
            now = time.perf_counter()
            waited = 0.0  # in this step's exchange
            if isinstance(self.inner, DataParallelSGD):
                waited, self.inner.exchange_s = self.inner.exchange_s, 0.0
            if self._last_end is not None:
                self._durations.append(now - self._last_end)
                self._locals.append(max(0.0, now - self._last_end - waited))
            self._last_end = now
            first = self._measured == 0 and self._started is not None  # step 0 of a fresh run
            self._measured += 1
            # Decide after measure_steps + 1 steps, counted from the start of training (a resumed run
            # counts on from where it stopped); the same count on every rank. Or sooner, when the
            # timed steps are slow enough (_budget_spent, collective; it depends on their times), or
            # right after a first step long enough to settle it (_first_step_s, collective).
            if (self._measured > self.measure_steps and self._durations) or self._budget_spent():
                self._decide()
            elif self.measure_budget_s is not None and len(self._durations) == MIN_TIMED and self.world_size > 1:
                self._decide(span=True)  # decides only where the fastest and slowest timed step agree
            elif first and (first_s := self._first_step_s(now)) is not None:
                self._decide(first_step_s=first_s)
            if (
                first
                and self.decision is None
                and self._first_checked
                and self._early is not None
                and self._second_check
                and isinstance(self.inner, DataParallelSGD)
            ):  # the same on every rank: the first step's check ran and measured the network, undecided
                self.inner.before_exchange = self._before_exchange_check  # at the end of the second backward
            if self.decision is None or self._block_steps_s is not None:
                self._last_end = time.perf_counter()  # the check's all-reduce not counted in the next step

    def _time_block_step(self) -> None:
        """After deciding on a block algorithm at the cap: time the first block's local steps (end to
        end: the median leaves out a step that an evaluation between steps lengthened) and take the
        round that ends it, whole (its all-reduce and its passes over the parameters); hand both to the next round's report
        (:meth:`_lengthen`). Local: the report rides on the round that the block algorithm makes anyway."""
        inner = self.inner
        assert isinstance(inner, BlockwiseSGD) and self._block_steps_s is not None
        blocks = inner.blocks
        inner.after_step()
        synchronize(self._device())
        now = time.perf_counter()
        if self._last_end is not None and inner.report_values is None:
            seconds = now - self._last_end
            if inner.blocks > blocks:  # this step ended the block: its exchange, as the round timed it
                if self._block_steps_s:
                    inner.report_values = [1.0, statistics.median(self._block_steps_s), inner.last_round_s]
            elif inner.block_steps > 0:  # a local step (not the warm start's exact steps)
                self._block_steps_s.append(seconds)
        self._last_end = time.perf_counter()

    def _arm_lengthening(self) -> None:
        """Where the decision is a block algorithm at the cap, not yet checked: time its first block."""
        decision = self.decision
        inner = self.inner
        if (
            decision is None
            or "block_check" in decision
            or decision["algorithm"] not in BLOCK_ALGORITHMS
            or not isinstance(inner, BlockwiseSGD)
            or self.world_size < 2
        ):
            return
        if "trial" in decision:  # a trial under way (a resumed one starts over)
            if "outcome" not in decision["trial"]:
                self._block_steps_s = []
                self._last_end = None
                inner.report_width, inner.report_values, inner.on_report = 3, None, self._end_trial
            return
        batch = int(decision.get("measured", {}).get("batch", 0))  # a decision made by hand may lack it
        if batch <= 0 or int(decision["options"]["block_size"]) < BLOCK_STEPS[-1] * batch:
            return
        self._block_steps_s = []
        self._last_end = None
        inner.report_width, inner.report_values, inner.on_report = 3, None, self._lengthen

    def _lengthen(self, report: list[float], active: int) -> None:
        """Every rank, at a round: from the ranks' mean local step and block exchange, lengthen the
        block past the cap where the exchange dominates (:func:`lengthened_block`), or, after a decision
        at the first step whose bound put the block under the cap, set it by the block-size rule on
        these figures (:func:`block_from_timed`); the same on every rank, as the sums are. A round that
        carries no report (none timed yet) leaves it for the next."""
        reporters, local_s, exchange_s = report
        if reporters <= 0:
            return
        inner = self.inner
        decision = self.decision
        assert isinstance(inner, BlockwiseSGD) and decision is not None
        compute_s, exchange_s = local_s / reporters, exchange_s / reporters
        batch = int(decision["measured"]["batch"])
        steps = int(decision["options"]["block_size"]) // batch
        growth = EPOCH_GROWTH[decision["algorithm"]]
        longer = lengthened_block(steps, compute_s, exchange_s, growth)
        floor = decision["measured"].get("first_step_block_steps")  # decided at the first step, under the cap
        after = longer if floor is None else block_from_timed(steps, int(floor), compute_s, exchange_s, growth)
        inner.report_width, inner.report_values, inner.on_report = 0, None, None
        self._block_steps_s = None
        decision["block_check"] = {
            "local_step_s": compute_s,
            "exchange_s": exchange_s,
            "steps": steps,
            "epoch_growth": growth,
            "lengthened_to": longer,
            **({"first_step_block_steps": int(floor), "steps_after": after} if floor is not None else {}),
            "at_block": inner.blocks,
        }
        if after != steps:
            self._set_block(after * batch)
        if self.verbose and comm.get_rank(self.group) == 0:
            print(
                f"[bunsan] Auto after block {inner.blocks}: a local step {compute_s * 1e3:.2f} ms, the exchange "
                f"{exchange_s * 1e3:.1f} ms a block: "
                + (
                    f"blocks of {after} steps from now on (were {steps}; the exchange dominates)"
                    if after > steps
                    else f"blocks of {after} steps from now on (were {steps}; the exchange within 5% of the compute)"
                    if after < steps
                    else f"blocks stay at {steps} steps"
                ),
                flush=True,
            )

    def _set_block(self, size: int) -> None:
        """Every rank: the block algorithm's blocks hold ``size`` samples from now on, and the decision says so."""
        decision = self.decision
        assert isinstance(self.inner, BlockwiseSGD) and decision is not None
        self.inner.block_size = size
        decision["options"] = {**decision["options"], "block_size": size}
        decision["label"] = f"{decision['algorithm']}:{size}"

    def _device(self) -> torch.device:
        """Where the model's parameters are: where its steps, its exchange and its codec run."""
        return self.named_params[0][1].device if self.named_params else torch.device("cpu")

    def _before_exchange_check(self) -> bool:
        """Every rank, at the end of a fresh run's first backward, before its exchange (collective): where
        predictions from the first step's compute (from distribute() on: an upper bound) plus the exact
        exchange predicted on the network measured now settle a block algorithm
        (:func:`settled_by_first_step`), decide now: the decided
        algorithm takes this backward's gradients as its first local step, and the exact exchange that the
        choice would make pointless is never sent (on the 10.5M MLP at 100 Mbit/s and 4 workers it cost
        5.8 s of a 48 s time to accuracy, docs/experiments/plan.md). Otherwise the exchange goes on; the network and
        codec stay measured for the decision, and their time is not counted in the first step.

        Where that first check measured the network and left the choice open, the second backward is
        weighed the same way before its exchange: its compute (from the end of the first step, the
        slowest rank's) is one sample of the steady step's, not a bound, so it is taken at
        :data:`SECOND_STEP_MARGIN` times (the spread of bunsan's timed exact steps), with the network
        and codec measured at the first. On MNIST-1D's CNN at 4 workers the first step's bound, 20
        times the steady compute, settled model averaging at 1-2 seeds of 6, and the rest measured 4
        exact steps and decided twice (docs/experiments/plan.md, run 48). True where this algorithm was replaced."""
        step = self._measured
        if self.decision is not None or self._started is None or self.world_size < 2 or step > 1:
            return False
        if step == 1 and (self._early is None or self._last_end is None):
            return False
        self._first_checked = True
        old = self.inner
        assert isinstance(old, DataParallelSGD)
        synchronize(self._device())
        began = time.perf_counter()
        since = self._started if step == 0 else self._last_end
        assert since is not None
        first = torch.tensor([began - since], dtype=torch.float64, device=comm.tensor_device(self.group))
        comm.all_reduce(first, op="max", group=self.group)
        seconds = float(first[0])
        if step == 0:
            self._decide(first_step_s=seconds, before_exchange=True)
        else:
            self._decide(first_step_s=SECOND_STEP_MARGIN * seconds, before_exchange=True, second_step_s=seconds)
        if self.decision is None:  # the step's time leaves this measuring out
            if step == 0:
                self._started += time.perf_counter() - began
            else:
                self._last_end = since + (time.perf_counter() - began)
            return False
        # this backward's samples, taken by its first gradient hook, are the decided algorithm's first step's
        # (and any counted or noted on a rank whose backward reached no parameter)
        taken = old._round[0] if old._round is not None else 0
        old._round = None
        self.inner.local_samples -= taken
        self.inner._pending_samples += taken + old._pending_samples
        self.inner._unconfirmed_samples += old._unconfirmed_samples
        old._pending_samples = old._unconfirmed_samples = 0
        return True

    def _first_step_s(self, now: float) -> float | None:
        """The slowest rank's first step, from distribute() on (collective: every rank gets the same
        answer), where it was not weighed at the end of its backward already; else ``None``."""
        if self.measure_budget_s is None or self._started is None or self.world_size < 2 or self._first_checked:
            return None
        first = torch.tensor([now - self._started], dtype=torch.float64, device=comm.tensor_device(self.group))
        comm.all_reduce(first, op="max", group=self.group)
        seconds = float(first[0])
        return seconds

    def _budget_spent(self) -> bool:
        """Whether the slowest rank's timed steps add up to ``measure_budget_s`` (collective from the
        ``MIN_AGREEING``-th timed step on: every rank has timed as many steps, and all stop together).
        At ``MIN_AGREEING`` steps only if the slowest rank's time of each step (the job's step time) agrees
        within ``min_gain`` (the margin the decision itself asks): a fast rank's jitter of a tenth of a
        millisecond does not hold back a job whose steps take 50 ms. From ``MIN_TIMED`` on, their median
        rejects one outlier."""
        count = len(self._durations)
        if self.measure_budget_s is None or count < MIN_AGREEING:
            return False
        figures = torch.tensor(
            [sum(self._durations), *self._durations[:MIN_AGREEING]],
            dtype=torch.float64,
            device=comm.tensor_device(self.group),
        )
        comm.all_reduce(figures, op="max", group=self.group)
        spent, first = float(figures[0]), figures[1:].tolist()
        spread = max(first) / max(min(first), 1e-12) if count < MIN_TIMED else 1.0
        return spent >= self.measure_budget_s and spread <= 1 + self.min_gain

    def join(self) -> None:
        self.inner.join()

    def sync_replicas(self) -> None:
        self.inner.sync_replicas()

    def begin_accumulation(self) -> None:
        self.inner.begin_accumulation()

    def end_accumulation(self) -> None:
        self.inner.end_accumulation()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    # -- the decision (collective) -------------------------------------------------------------------
    def _profile(self, compute_s: float) -> cm.Profile:
        params = [p for _, p in self.named_params]
        batch = max(1, round(self.inner.local_samples / max(self.inner.step + 1, 1)))
        numel = sum(p.numel() for p in params)
        return cm.Profile(
            compute_s=compute_s,
            params=numel,
            batch=batch,
            # the gradients' bytes per dtype: every exchange travels in the parameters' own dtypes
            bytes_per_element=sum(p.numel() * p.element_size() for p in params) / numel if numel else 4,
            tensors=len(params),
            chunks=sum(-(-p.numel() // cm.DEFAULT_CHUNK_SIZE) for p in params),
            codec_per_bucket=coded_per_bucket(Quantizer(1), self._device()),
        )

    def _momentum(self) -> float:
        groups = self.optimizer.param_groups if isinstance(self.optimizer, torch.optim.SGD) else []
        return max((float(g.get("momentum", 0.0)) for g in groups), default=0.0)

    def _probes(self) -> tuple[list[cm.Candidate], dict[str, str]]:
        """The fixed-cost probes of ``risk`` (the same list on every rank, no warm start), and which
        candidates share a probe's result: every bit width runs the same striped exchange and hooks
        (the codec's own cost per width is measured apart), and both block algorithms the same block
        exchange, so one probe of each family stands for all of it (the probes are most of Auto's
        measuring time on a small model: about 0.12 s each at 4 workers on 2 cores)."""
        probes = [
            cm.Candidate("data_parallel", {}, "exact"),
            cm.Candidate("data_parallel", {"compression": "fp16"}, "fp16"),
        ]
        shared: dict[str, str] = {}
        if self.risk == "medium":
            probes.append(cm.Candidate("data_parallel", {"bits": 2}, "2-bit"))
            shared["8-bit"] = "2-bit"
        elif self.risk == "high":
            rotate = self._momentum() >= HEAVY_MOMENTUM_1BIT
            quantized = "1-bit rotated" if rotate else "1-bit"
            probes.append(cm.Candidate("data_parallel", {"bits": 1, "rotate": rotate}, quantized))
            shared.update({"8-bit": quantized, "2-bit": quantized})
            probes.append(cm.Candidate("block_momentum", {"block_size": 64}, "block_momentum"))
            shared["model_averaging"] = "block_momentum"
        return probes, shared

    def _predict(
        self,
        step_s: float,
        network: cm.Network,
        n: int,
        overlap: bool,
        fixed: dict[str, float],
        codec: dict[str, float],
        codecs: tuple[tuple[int | float, ...], ...],
        local_s: float | None = None,
    ) -> tuple[cm.Profile, float, list[cm.Candidate], list[cm.Prediction]]:
        """Rank 0: the profile, the compute (measured as ``local_s`` or inferred: :func:`split_compute`),
        the candidates and their predictions."""
        # each candidate its probe's fixed cost; block algorithms by name (probed at another block
        # size, per block), so that the block-size rule amortizes theirs
        draft = cm.Profile(**{**vars(self._profile(step_s)), "fixed_s": tuple(fixed.items())})
        compute, straggler = split_compute(step_s, local_s, draft, network, n, overlap=overlap)
        profile = cm.Profile(
            **{**vars(draft), "compute_s": compute, "straggler_s": straggler, **codec, "codecs": codecs}
        )
        candidates = candidates_for(
            self.risk, profile, network, n, momentum=self._momentum(), warm_start=self.warm_start, overlap=overlap
        )
        return profile, compute, candidates, [cm.predict(profile, network, c, n, overlap=overlap) for c in candidates]

    def _numel(self) -> int:
        return sum(p.numel() for _, p in self.named_params)

    def _measure_codecs(self, device: torch.device) -> tuple[dict[str, float], tuple[tuple[int | float, ...], ...]]:
        """Every rank at once (collective; the slowest rank's timings): the codec and, past risk "low",
        each further width's own (8-bit encoding costs several times 1-bit's per element on CPU)."""
        numel = self._numel()
        codec = measure_codec(numel, repeats=2, collective=True, group=self.group, device=device)
        codecs: tuple[tuple[int | float, ...], ...] = ()
        if self.risk != "low":
            codecs = measure_codecs(numel, (2, 8), repeats=2, collective=True, group=self.group, device=device)
        return codec, codecs

    def _local_compute(self) -> float | None:
        """Collective: the ranks' mean of their median time outside the exchange over the timed steps (their
        local compute; :func:`split_compute`), or ``None`` where any rank lacks it, or on a GPU: its
        backward returns before its kernels end, so the exchange's wait holds compute too."""
        own = [statistics.median(self._locals)] if len(self._locals) == len(self._durations) > 0 else []
        if self._device().type != "cpu":
            return None
        figures = torch.tensor(
            [own[0] if own else 0.0, 1.0 if own else 0.0], dtype=torch.float64, device=comm.tensor_device(self.group)
        )
        comm.all_reduce(figures, group=self.group)
        total, ranks = figures.tolist()
        return total / ranks if round(ranks) == self.world_size else None

    def _decide(
        self,
        first_step_s: float | None = None,
        span: bool = False,
        before_exchange: bool = False,
        second_step_s: float | None = None,
    ) -> None:
        """Measure, predict, decide on rank 0 and apply everywhere (collective). With ``first_step_s``
        (the slowest rank's first step, from distribute() on), decide only where that settles it
        (:func:`settled_by_first_step`); ``before_exchange``: that step's time ends before its exchange,
        and the exact step it stands for adds the exchange predicted on the network (``second_step_s``: the
        second step's own compute, of which ``first_step_s`` is the margin's multiple); with ``span`` (after ``MIN_TIMED`` timed steps), only where
        the choice is the same at the fastest and the slowest of them as at their median. Where
        either does not decide, what was measured (network, codec, fixed costs) is kept for the
        decision and measuring goes on."""
        started = time.perf_counter()
        spread: tuple[float, ...] = ()
        if first_step_s is None:
            # the job's step time: the slowest rank's median; and for the span check the slowest rank's
            # time of each timed step (a synchronous step ends when its slowest rank ends)
            slowest = torch.tensor(
                [statistics.median(self._durations), *(self._durations if span else ())],
                dtype=torch.float64,
                device=comm.tensor_device(self.group),
            )
            comm.all_reduce(slowest, op="max", group=self.group)
            step_s = float(slowest[0])
            if span:
                spread = (min(slowest[1:].tolist()), max(slowest[1:].tolist()))
            # the split needs the job's own network: with one given, the difference between it and the
            # real exchange would be counted as waiting for the slowest rank
            local_s = self._local_compute() if self.network is None else None
        else:
            step_s, local_s = first_step_s, None
        steps_s = (step_s, *spread)  # rank 0 predicts at each; the first is the one the record keeps
        n = self.world_size
        gradient_bytes = sum(p.numel() * p.element_size() for _, p in self.named_params)
        network: cm.Network | None = self.network if n > 1 else None
        early = self._early
        if early is not None:  # measured by an earlier attempt that did not decide
            network = early.network
        elif network is None and n > 1:  # one worker exchanges nothing: exact, without probing a network
            sizes = [s for s in (4, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024) if s <= max(gradient_bytes, 2**20)]
            sizes = sorted({*sizes, gradient_bytes} if gradient_bytes < sizes[-1] else sizes)  # its own size too
            # every rank fits the same (max-reduced) timings, so all succeed or all fail, and retry alike
            try:
                network = measure_network(
                    self.group, sizes=sizes, repeats=3, enough_s=ENOUGH_S, enough_bytes=gradient_bytes
                )
            except ValueError:  # noise hid the growth with size (loopback, a loaded machine): larger, longer
                try:
                    network = measure_network(self.group, sizes=RETRY_SIZES, repeats=7, enough_s=ENOUGH_S)
                except ValueError:
                    network = None
        if span and network is None:  # inconclusive: left to the decision at the end of measuring
            return
        # the exchange overlaps backward only where it does not need the compute's core
        local = runtime.local_size()
        device = self._device()
        overlap = can_overlap(device, local, over_memory=local == runtime.size())
        network_s = time.perf_counter() - started
        deciding = comm.get_rank(self.group) == 0  # rank 0 decides; the others receive its decision below
        codec: dict[str, float] = {}
        codecs: tuple[tuple[int | float, ...], ...] = ()
        codec_deferred = False  # only the copy measured so far (the first step's check)
        fixed: dict[str, float] = {}
        probed: set[str] = set()  # the probe families run, by this attempt or an earlier one
        earlier_probe_s = 0.0  # seconds an earlier attempt's probes took
        if early is not None:
            codec, codecs, network_s = early.codec, early.codecs, early.network_s
            fixed, probed, earlier_probe_s = dict(early.fixed), set(early.probed), early.probe_s
            started -= early.spent_s  # the record's time to decide counts the earlier measuring too
            codec_deferred = early.codec_deferred
            if codec_deferred and first_step_s is None:  # the timed steps' decision prices every candidate
                codec, codecs = self._measure_codecs(device)
                codec_deferred = False
        elif network is not None and first_step_s is not None:
            # The first step can settle only a block algorithm (settled_by_first_step), and the codec
            # prices only fp16 and the quantized exchange: predicted without it (at their fastest), a
            # block that is settled stays settled whatever the codec costs. A copy prices the block
            # rounds' passes; the codec waits until that prediction leaves the choice open.
            codec = measure_copy(self._numel(), repeats=2, collective=True, group=self.group, device=device)
            codec_deferred = True
        elif network is not None:  # the same on every rank (max-reduced timings): all measure, at once
            codec, codecs = self._measure_codecs(device)
        probe_s = earlier_probe_s

        def keep_measuring() -> None:
            """Every rank: keep what was measured for the decision at the end of measuring."""
            if network is not None:
                self._early = _EarlyMeasures(
                    network,
                    codec,
                    codecs,
                    network_s,
                    time.perf_counter() - started,
                    tuple(fixed.items()),
                    frozenset(probed),
                    probe_s,
                    codec_deferred,
                )

        plan: tuple[Any, ...] | None = None
        probing: tuple[str, str] | None = None
        if first_step_s is not None:
            settled: tuple[str, str] | None = None
            codec_matters = False  # whether the codec's cost could settle what its absence leaves open
            if deciding and network is not None:
                if before_exchange:  # the exact step it stands for: this compute and the exchange predicted
                    exact = cm.Candidate("data_parallel", {}, "exact")
                    step_s = cm.predict(self._profile(step_s), network, exact, n, overlap=overlap).step_s
                plan = self._predict(step_s, network, n, overlap, {}, codec, codecs)
                settled = settled_by_first_step(plan[2], plan[3], self.min_gain, plan[0].batch)
                codec_matters = (
                    settled is None
                    and codec_deferred
                    and codec_can_settle(plan[2], plan[3], self.min_gain, plan[0].batch)
                )
            settled, codec_matters = comm.broadcast_object((settled, codec_matters), src=0, group=self.group)
            if settled is None and codec_matters:  # every rank: the codec may settle it
                codec, codecs = self._measure_codecs(device)
                codec_deferred = False
                if deciding:
                    assert network is not None  # the codec is deferred only where the network was measured
                    plan = self._predict(step_s, network, n, overlap, {}, codec, codecs)
                    settled = settled_by_first_step(plan[2], plan[3], self.min_gain, plan[0].batch)
                settled = comm.broadcast_object(settled, src=0, group=self.group)
            elif settled is not None and codec_deferred:
                settled = (
                    settled[0],
                    f"{settled[1]}; the codec not measured: without it fp16 and the quantized exchange are still slower",
                )
            if settled is None:  # go on measuring; the network and codec stay measured (the codec, where it
                keep_measuring()  # could not settle this, by the decision that needs it)
                return
            probing = settled
        probe_started = time.perf_counter() - earlier_probe_s
        if network is not None and self.fixed_costs and first_step_s is None:
            # Rank 0 predicts without the probes first and tells every rank which probes can change
            # the decision (probes_needed) at any of the step times it weighs: they are most of Auto's
            # measuring time. A family an earlier attempt probed is not probed again.
            if deciding:
                plans = [self._predict(s, network, n, overlap, {}, codec, codecs, local_s) for s in steps_s]
                plan = plans[0]
                needed = [probes_needed(p[2], p[3], self.min_gain, p[0].batch) for p in plans]
                wanted = {f for families, _ in needed for f in families.split("+")} - {"none"}
                todo = [f for f in PROBE_FAMILIES if f in wanted - probed]
                probing = ("+".join(todo) or "none", needed[0][1])
            probing = comm.broadcast_object(probing, src=0, group=self.group)
            assert probing is not None
            if probing[0] != "none":  # every rank: the probe is collective
                families = set(probing[0].split("+"))
                probes, shared = self._probes()

                def probe(wanted: set[str]) -> dict[str, float]:
                    chosen = [p for p in probes if probe_family(p) in wanted]
                    return dict(
                        measure_fixed_costs(
                            chosen,
                            network,
                            group=self.group,
                            overlap=overlap,
                            steps=PROBE_STEPS,
                            warmup=PROBE_WARMUP,
                            repeats=PROBE_REPEATS,
                        )
                    )

                # exact's and the block probe first; fp16's and the quantized one only where, given
                # those, they can still change the decision (later_probes_needed)
                first_families = families & {"exact", "block"}
                if first_families:
                    fixed.update(probe(first_families))
                later = families - {"exact", "block"}
                ran = probed | first_families
                if later:
                    skipped: tuple[str, str] | None = None
                    if deciding:
                        assert plan is not None
                        so_far = {**fixed, **{a: fixed[b] for a, b in shared.items() if b in fixed}}
                        so_far.update(
                            {
                                c.label: fixed["exact"]
                                for c in plan[2]
                                if c.algorithm not in BLOCK_ALGORITHMS and c.label not in so_far
                            }
                        )
                        found = [
                            later_probes_needed(first[2], first[3], later, fixed["exact"], self.min_gain)
                            for first in (
                                self._predict(s, network, n, overlap, so_far, codec, codecs, local_s) for s in steps_s
                            )
                        ]
                        keep = {f for families_, _ in found for f in families_.split("+")} - {"none"}
                        # a family runs where any step time wants it; the median's reasons for the others
                        reasons = [r for r in found[0][1].split("; ") if r and r.split("'s probe")[0] not in keep]
                        skipped = ("+".join(sorted(keep)) or "none", "; ".join(reasons))
                    skipped = comm.broadcast_object(skipped, src=0, group=self.group)
                    assert skipped is not None
                    wanted = set(skipped[0].split("+")) - {"none"}
                    if wanted:
                        fixed.update(probe(wanted))
                    ran |= wanted
                    if skipped[1]:
                        probing = (probing[0], f"{probing[1]}; {skipped[1]}")
                probed |= ran
                kept = set(fixed)
                shared = {label: source for label, source in shared.items() if source in kept}
                fixed.update({label: fixed[source] for label, source in shared.items()})
                if plan is not None:  # rank 0: a per-step candidate whose probe did not run at exact's, under its own
                    fixed.update(
                        {
                            c.label: fixed["exact"]
                            for c in plan[2]
                            if c.algorithm not in BLOCK_ALGORITHMS and c.label not in fixed
                        }
                    )
            plan = None  # predicted again below, with the fixed costs
            if probed:  # the record names the probes that ran, in this attempt or an earlier one
                probing = ("+".join(f for f in PROBE_FAMILIES if f in probed), probing[1])
        probe_s = time.perf_counter() - probe_started
        decision: dict[str, Any] | None = None
        if deciding and network is None:
            decision = {
                "algorithm": "data_parallel",
                "options": {},
                "label": "exact",
                "step": self._measured,
                "workers": n,
                "why": (
                    "the network measurement was inconclusive (times did not grow with size): exact kept"
                    if n > 1
                    else "one worker: nothing to exchange, exact kept"
                ),
                "measured": {"exact_step_s": step_s},
                "predictions": [],
            }
            if self.verbose:
                print(f"[bunsan] Auto at step {self._measured}: {decision['why']}", flush=True)
        elif deciding and network is not None:
            if plan is None:
                plan = self._predict(step_s, network, n, overlap, fixed, codec, codecs, local_s)
            profile, compute, candidates, predictions = plan
            index, why = choose(predictions, self.min_gain)
            floor_steps: int | None = None
            cap_size = BLOCK_STEPS[-1] * profile.batch
            if first_step_s is not None and int(candidates[index].options.get("block_size", cap_size)) < cap_size:
                # settled_by_first_step: a block algorithm at any shorter step, its block as long or longer:
                # the cap now, and the first block's timed steps set the length (block_from_timed)
                floor_steps = int(candidates[index].options["block_size"]) // profile.batch
                candidates = [
                    cm.Candidate(c.algorithm, {**c.options, "block_size": cap_size}, f"{c.algorithm}:{cap_size}")
                    if c.algorithm in BLOCK_ALGORITHMS
                    else c
                    for c in candidates
                ]
                predictions = [cm.predict(profile, network, c, n, overlap=overlap) for c in candidates]
                index, why = choose(predictions, self.min_gain)
            agree = True
            for other in spread:  # the span check: the same choice at the fastest and slowest timed step
                o = self._predict(other, network, n, overlap, fixed, codec, codecs, local_s)
                agree = agree and same_choice(o[2][choose(o[3], self.min_gain)[0]], candidates[index])
            if spread and agree:
                why = (
                    f"{why}; the same at the fastest and the slowest of {len(self._durations)} timed steps "
                    f"({spread[0] * 1e3:.2f}-{spread[1] * 1e3:.2f} ms)"
                )
            if agree:
                decision = {
                    "algorithm": candidates[index].algorithm,
                    "options": dict(candidates[index].options),
                    "label": candidates[index].label,
                    "why": why,
                    "step": self._measured,
                    "workers": n,
                    "measured": {
                        "exact_step_s": step_s,
                        **({"first_step": True} if first_step_s is not None and second_step_s is None else {}),
                        **(
                            {"second_step_before_exchange_s": second_step_s, "bound_margin": SECOND_STEP_MARGIN}
                            if second_step_s is not None
                            else {}
                        ),
                        **({"first_step_block_steps": floor_steps} if floor_steps is not None else {}),
                        **(
                            {"first_step_before_exchange_s": first_step_s}
                            if before_exchange and second_step_s is None
                            else {}
                        ),
                        **({"step_span_s": list(spread)} if spread else {}),
                        "compute_s": compute,
                        **({"local_step_s": local_s} if local_s is not None else {}),
                        "straggler_s": profile.straggler_s,
                        "latency_s": network.latency_s,
                        "bandwidth": network.bandwidth,
                        "gather_bandwidth": network.gather_bandwidth,
                        "half_bandwidth": network.half_bandwidth,
                        **codec,
                        "codecs": [list(c) for c in codecs],
                        **({"codec_measured": False} if codec_deferred else {}),
                        "overlap": overlap,
                        "fixed_s": {c.label: profile.fixed(c.label) for c in candidates},
                        "params": profile.params,
                        "batch": profile.batch,
                        "bytes_per_element": profile.bytes_per_element,
                        # the rest of the profile, so that `bunsan plan --job` predicts other worker counts alike
                        "tensors": profile.tensors,
                        "chunks": profile.chunks,
                        "codec_per_bucket": profile.codec_per_bucket,
                    },
                    "predictions": [
                        {"label": p.label, "step_s": p.step_s, "bytes_per_step": p.bytes_per_step} for p in predictions
                    ],
                }
                decision["measured"].update(
                    decide_s=time.perf_counter() - started, network_s=network_s, fixed_probe_s=probe_s
                )
                if probing is not None:
                    decision["measured"]["probes"] = list(probing)
                tried = trial_candidate(candidates, predictions, self.min_gain) if first_step_s is None else None
                if tried is not None:
                    self._start_trial(decision, candidates[tried], predictions, tried)
                if self.verbose:
                    print(format_decision(decision), flush=True)
        decision = comm.broadcast_object(decision, src=0, group=self.group)
        if decision is None:  # the span check found a choice that the step time can still change
            keep_measuring()
            return
        self._apply(decision)

    def _apply(self, decision: dict[str, Any]) -> None:
        """Replace the exact algorithm by the decided one (the same on every rank, at the same step)."""
        self.decision = decision
        exact = decision["algorithm"] == "data_parallel" and not decision["options"]
        if exact and type(self.inner) is DataParallelSGD and self.inner.bits == 32 and not self.inner.compression:
            return  # exact it stays
        self._build(decision["algorithm"], decision["options"])
        self._arm_lengthening()

    def _build(self, algorithm: str, options: dict[str, Any]) -> None:
        """Every rank: the inner algorithm becomes ``algorithm(**options)``, with the counters kept."""
        old = self.inner
        new = _CHOICES[algorithm](group=self.group, **options)
        if isinstance(old, DataParallelSGD):
            old.remove_hooks()  # the exact algorithm's gradient hooks must stop firing
        new.step, new.samples, new.local_samples = old.step, old.samples, old.local_samples
        new.setup(self.named_params)
        new.setup_buffers(getattr(self, "_buffer_modules", []))
        if self.optimizer is not None:
            new.attach_optimizer(self.optimizer)
        self.inner = new

    def _start_trial(
        self, decision: dict[str, Any], candidate: cm.Candidate, predictions: Sequence[cm.Prediction], index: int
    ) -> None:
        """Rank 0: turn a decision that keeps exact into a trial of ``candidate`` (:func:`trial_candidate`)
        in blocks of :data:`TRIAL_STEPS` steps; the candidate and its prediction go into ``decision["trial"]``."""
        batch = int(decision["measured"]["batch"])
        size = TRIAL_STEPS * batch
        gain = predictions[0].step_s / predictions[index].step_s - 1
        decision["trial"] = {
            "of": candidate.label,
            "predicted_gain": gain,
            "steps": TRIAL_STEPS,
            "exact_step_s": decision["measured"]["exact_step_s"],
        }
        decision["why"] = (
            f"{decision['why']}; a trial: {candidate.label} predicted {100 * gain:.1f}% faster, within "
            f"{100 * TRIAL_WINDOW:.0f} points under min_gain: blocks of {TRIAL_STEPS} steps, whose timed local "
            "steps and round keep it or return to exact"
        )
        decision.update(
            algorithm=candidate.algorithm,
            options={**candidate.options, "block_size": size},
            label=f"{candidate.algorithm}:{size}",
        )

    def _end_trial(self, report: list[float], active: int) -> None:
        """Every rank, at the round after a trial's first block (which carries its timed local steps and
        round, :meth:`_time_block_step`): keep the block algorithm, its block by the block-size rule on the
        timed figures, or return to exact (:func:`trial_verdict`); the same on every rank, as the sums are.
        The return averages the local optimizers' states (momentum, Adam's moments), which the block's local
        steps made differ, as the round averaged the parameters: exact steps then keep every replica equal.
        It needs every rank training: where one has joined (its data ended), the block algorithm stays."""
        reporters, local_s, exchange_s = report
        if reporters <= 0:
            return
        inner = self.inner
        decision = self.decision
        assert isinstance(inner, BlockwiseSGD) and decision is not None and "trial" in decision
        compute_s, exchange_s = local_s / reporters, exchange_s / reporters
        batch = int(decision["measured"]["batch"])
        trial = decision["trial"]
        growth = EPOCH_GROWTH[decision["algorithm"]]
        keep, steps, block_step_s, gain = trial_verdict(
            float(trial["exact_step_s"]), compute_s, exchange_s, self.min_gain, growth
        )
        inner.report_width, inner.report_values, inner.on_report = 0, None, None
        self._block_steps_s = None
        joined = not keep and active < self.world_size
        trial.update(
            local_step_s=compute_s,
            exchange_s=exchange_s,
            block_step_s=block_step_s,
            steps_after=steps,
            gain=gain,
            kept=keep or joined,
            at_block=inner.blocks,
            **({"joined": True} if joined else {}),
        )
        if keep or joined:
            self._set_block(steps * batch)
            outcome = (
                f"{decision['label']} kept: {100 * gain:.1f}% faster than exact"
                if keep
                else f"{decision['label']} kept, {100 * gain:.1f}% faster than exact: a rank has joined"
            )
        else:
            _average_optimizer_state(self.optimizer, [p for _, p in self.named_params], self.group)
            decision.update(algorithm="data_parallel", options={}, label="exact")
            self._build("data_parallel", {})
            outcome = f"back to exact: {100 * gain:.1f}% faster than exact (< min_gain {100 * self.min_gain:.0f}%)"
        trial["outcome"] = outcome
        if self.verbose and comm.get_rank(self.group) == 0:
            print(
                f"[bunsan] Auto's trial after block {trial['at_block']}: a local step {compute_s * 1e3:.2f} ms, "
                f"the round {exchange_s * 1e3:.1f} ms, {block_step_s * 1e3:.2f} ms a step in blocks of {steps} "
                f"against exact's {float(trial['exact_step_s']) * 1e3:.2f} ms: {outcome}",
                flush=True,
            )

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.name,
            "world_size": self.world_size,
            # a copy: a trial's verdict and the block check change the live decision after a checkpoint
            "decision": copy.deepcopy(self.decision),
            "measured_steps": self._measured,
            "durations": list(self._durations),
            "locals": list(self._locals),
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state_is_mine(state)
        saved_size = int(state.get("world_size", self.world_size))
        again = self.on_resume == "decide" or saved_size != self.world_size
        if not again:
            if state["decision"] is not None:
                self._apply(state["decision"])  # the same choice as before, without measuring again
            self.inner.load_state_dict(state["inner"])
            # An undecided run goes on measuring and decides at the same step as it would have.
            self._measured = int(state.get("measured_steps", 0))
            self._durations = [float(d) for d in state.get("durations", [])]
            self._locals = [float(d) for d in state.get("locals", [])]  # none in a state saved before 2026-11-26
            self._last_end = None
            return
        if saved_size != self.world_size and self.on_resume == "keep":
            what = f"its decision ({state['decision']['label']})" if state["decision"] else "its measuring"
            warnings.warn(
                f"Auto's state was saved by a job of {saved_size} ranks and this job has {self.world_size}: "
                f"{what} was for that job's worker count and network; it measures and decides again",
                stacklevel=2,
            )
        # Measure and decide again from here, with exact SGD, as a fresh Auto does; the counters go on. A
        # saved exact algorithm's own state (its local momentum, residuals) fits the exact one measuring now.
        if self.decision is not None or not isinstance(self.inner, DataParallelSGD) or self.inner.bits != 32:
            raise CheckpointError(
                "load Auto's state before its first step (into a fresh Auto, as distribute() builds it)"
            )
        inner = state["inner"]
        if inner.get("algorithm") == DataParallelSGD.name and not (state["decision"] or {}).get("options"):
            self.inner.load_state_dict(inner)
        else:  # another algorithm's state (a block's momentum, a quantized exchange's residuals): only the counters
            self.inner.step, self.inner.samples = int(inner["step"]), int(inner["samples"])
            self.inner.local_samples = int(inner["local_samples"])
        self._measured, self._durations, self._locals, self._last_end = 0, [], [], None

    def __repr__(self) -> str:
        chosen = f", chosen={self.decision['label']!r}" if self.decision else ""
        return f"Auto(risk={self.risk!r}, measure_steps={self.measure_steps}{chosen})"


def format_decision(decision: dict[str, Any]) -> str:
    """Rank 0's short table: candidates, predicted ms per step, the choice and why."""
    m = decision["measured"]
    lines = [
        f"[bunsan] Auto at step {decision['step']}, {decision['workers']} workers: "
        + (
            f"first step before its exchange {m['first_step_before_exchange_s'] * 1e3:.2f} ms (from distribute() on), "
            f"as an exact step {m['exact_step_s'] * 1e3:.2f} ms"
            if "first_step_before_exchange_s" in m
            else f"second step before its exchange {m['second_step_before_exchange_s'] * 1e3:.2f} ms, taken at "
            f"{m['bound_margin']:g} times as a bound, as an exact step {m['exact_step_s'] * 1e3:.2f} ms"
            if "second_step_before_exchange_s" in m
            else f"{'first step (from distribute() on)' if m.get('first_step') else 'exact step'} "
            f"{m['exact_step_s'] * 1e3:.2f} ms"
        )
        + f" (compute {m['compute_s'] * 1e3:.2f} ms"
        + (f", waiting for the slowest rank {m['straggler_s'] * 1e3:.2f} ms" if m.get("straggler_s", 0.0) > 0 else "")
        + "), network "
        f"{m['bandwidth'] * 8 / 1e9:.3f} Gbit/s, latency {m['latency_s'] * 1e6:.1f} us; measured and "
        f"decided in {m['decide_s']:.2f} s"
        + (
            f" (network {m['network_s']:.2f} s, fixed-cost probes {m['fixed_probe_s']:.2f} s)"
            if "network_s" in m
            else ""
        )
    ]
    for p in decision["predictions"]:
        mark = "  <- chosen" if p["label"] == decision["label"] else ""
        lines.append(f"[bunsan]   {p['label']:<28} {p['step_s'] * 1e3:9.2f} ms/step predicted{mark}")
    lines.append(f"[bunsan]   chosen: {decision['label']}: {decision['why']}")
    if "probes" in m:  # which probes ran and why (probes_needed): the record then says what Auto's time went on
        mode = m["probes"][0]
        older = {"all": "every family", "blocks": "exact and block momentum only"}  # records before 'exact+block'
        which = older.get(mode) or ("none" if mode == "none" else ", ".join(mode.split("+")))
        lines.append(f"[bunsan]   fixed-cost probes: {which}: {m['probes'][1]}")
    return "\n".join(lines)
