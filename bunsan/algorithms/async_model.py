"""Asynchronous SGD's and core-sharing pricing, and the predictions of every algorithm that ``bunsan plan``
makes: built on the synchronous model (:mod:`bunsan.algorithms.cost_model`), which ``algorithm="auto"``
uses alone and which never imports this module.

* **asynchronous SGD** with the server on rank 0 (``AsyncSGD``): each remote
  worker pushes its update and pulls the model (``M`` bytes each way) every
  ``sync_period`` samples. A worker waits for its own round trip; rank 0's link
  carries every remote worker's push and pull, so a remote step is at least
  ``(N - 1)`` round trips' worth of bytes on one link per sync. Rank 0's own
  worker talks to the server in-process and never waits, so workers run at
  different rates; the step reported is the job's, ``N / sum(1 / step_r)``
  (the harmonic mean: the time per step at the job's throughput).
* **ranks that share cores** (:attr:`~bunsan.algorithms.cost_inputs.Profile.ranks_per_core` above 1):
  a rank that waits on the network leaves its core to the others, so the compute of those that
  do not is faster than when every rank computed at once (:func:`shared_compute`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bunsan._validate import check_int
from bunsan.algorithms.cost_inputs import Candidate, Prediction, Profile
from bunsan.algorithms.cost_model import block_steps
from bunsan.algorithms.cost_model import predict as predict_synchronous
from bunsan.algorithms.network_model import Network, burst_credit

__all__ = [
    "ASYNC_OWN_PASSES",
    "ASYNC_REMOTE_PASSES",
    "ASYNC_SERVER_PASSES",
    "async_fixed_labels",
    "async_rank_steps",
    "async_step",
    "default_candidates",
    "predict",
    "predict_all",
    "shared_compute",
]

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


def predict(
    profile: Profile,
    network: Network,
    candidate: Candidate,
    workers: int,
    *,
    overlap: bool = True,
    spare_core: bool | None = None,
) -> Prediction:
    """The predicted step of any ``candidate`` at ``workers`` workers (the profile is per worker at that
    count): async SGD priced here, every other algorithm by :func:`bunsan.algorithms.cost_model.predict`.

    Options and ``overlap`` as there, and ``sync_period`` (samples per worker) for async.

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
    if candidate.algorithm != "async":
        return predict_synchronous(profile, network, candidate, workers, overlap=overlap)
    # rank 0's own worker reaches the server in-process and never waits; the others pay the
    # round trip. The step is the job's: workers / sum of each worker's steps per second.
    n = workers
    compute, own, remote = async_rank_steps(profile, network, candidate, n, overlap=overlap, spare_core=spare_core)
    if n > 1:  # each side's measured fixed cost: rank 0's worker's and a remote worker's (async_fixed_labels)
        own_label, remote_label = async_fixed_labels(candidate.label)
        own += profile.fixed(own_label)
        remote += profile.fixed(remote_label)
    step = n / (1 / own + (n - 1) / remote)
    k = block_steps(int(candidate.option("sync_period", 1)), profile.batch)
    sent = 0.0 if n == 1 else profile.gradient_bytes / k  # a remote worker's push
    return Prediction(candidate.label, n, compute, step, remote - compute, step - compute, 0.0, sent)


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
    bunsan's validation runs (docs/experiments/predict/) (20 rows: four models, both links): within 16% of this in all 20
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
    sum still grows; on the 92 async rows of bunsan's validation runs (docs/experiments/predict/) the rounds settle within 21.) With ``ranks_per_core`` 1 (or less: a core
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
    rank 0's worker at 438-547 ms, measured 108-134 ms, and its job +16% to +52% (
    bunsan's validation runs (docs/experiments/predict/)). With a
    core per rank the server's work fills exactly the remotes' round trips and nothing slows.

    Rank 0's worker computes at :attr:`Profile.core_compute_s` where ranks share cores and it was
    timed (the compute of a rank on a core of its own), not at the shared compute: that sharing
    prices the remote workers, which wait; rank 0's worker never does, and measured it stepped at
    about the same speed on loopback as on 100 Mbit/s links (docs/experiments/plan.md, "Rank 0's worker on a
    core of its own"). Its passes stay priced at the shared compute's slowdown, as the server's are."""
    check_int("workers", workers, minimum=1)
    n = workers
    compute = profile.compute_s
    k = block_steps(int(candidate.option("sync_period", 1)), profile.batch)
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
