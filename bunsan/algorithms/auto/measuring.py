"""What Auto measures of the job, collectively: the step times, the network, the codec, the fixed costs.

Every function here is called on every rank of the group at the same point, and every rank returns
the same figures: the slowest rank's (a synchronous step, an all-reduce or an encode ends when its
slowest rank ends), all-reduced with ``max``, or the ranks' mean where the figure is each rank's own
(its compute outside the exchange). The network is fitted to the alpha-beta model (Hockney 1994;
:func:`bunsan.algorithms.measure.measure_network`); the codec is timed on every rank at once, as the
job's exchange meets it. :class:`Measured` keeps what a decision point measured, so that a later
one reuses it (no probe twice).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup

from bunsan import comm
from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.auto.decision import probe_family
from bunsan.algorithms.auto.policy import AutoPolicy
from bunsan.algorithms.measure import measure_codec, measure_codecs, measure_copy, measure_fixed_costs, measure_network

__all__ = ["Measured", "job_codecs", "job_copy", "job_network", "local_compute", "probe_fixed_costs", "slowest"]

Codecs = tuple[tuple[int | float, ...], ...]


@dataclass
class Measured:
    """What one decision point measured, kept where it did not decide, for the next (every rank alike)."""

    network: cm.Network | None
    overlap: bool = True
    codec: dict[str, float] = field(default_factory=dict)
    codecs: Codecs = ()
    codec_deferred: bool = False  # only the copy measured: the codec waits for a decision it can change
    fixed: dict[str, float] = field(default_factory=dict)  # the fixed-cost probes' results, by label
    probed: set[str] = field(default_factory=set)  # the probe families run so far
    network_s: float = 0.0  # seconds the network probe took
    probe_s: float = 0.0  # seconds the probes took, all attempts
    started: float = 0.0  # perf_counter from which the record counts the time to decide (earlier attempts too)
    spent_s: float = 0.0  # seconds the decision points that kept this spent measuring


def slowest(values: Sequence[float], group: ProcessGroup | None, op: str = "max") -> list[float]:
    """Collective: ``values`` reduced over the ranks (``max``: the slowest rank's; ``sum``)."""
    figures = torch.tensor(list(values), dtype=torch.float64, device=comm.tensor_device(group))
    comm.all_reduce(figures, op=op, group=group)
    return [float(v) for v in figures.tolist()]


def job_network(group: ProcessGroup | None, gradient_bytes: int, policy: AutoPolicy) -> cm.Network | None:
    """Collective: the group's alpha and beta from all-reduces up to the gradients' size (and that size),
    once more at larger sizes and more repeats where noise hid the growth with size (loopback, a loaded
    machine); ``None`` where that fails too. Every rank fits the same max-reduced timings, so all
    succeed or fail alike."""
    sizes = [s for s in policy.network_sizes if s <= max(gradient_bytes, 2**20)]
    sizes = sorted({*sizes, gradient_bytes} if gradient_bytes < sizes[-1] else sizes)  # its own size too
    try:
        return measure_network(
            group, sizes=sizes, repeats=policy.network_repeats, enough_s=policy.enough_s, enough_bytes=gradient_bytes
        )
    except ValueError:
        try:
            return measure_network(
                group, sizes=policy.retry_sizes, repeats=policy.retry_repeats, enough_s=policy.enough_s
            )
        except ValueError:
            return None


def job_codecs(
    numel: int, risk: str, group: ProcessGroup | None, device: torch.device, policy: AutoPolicy
) -> tuple[dict[str, float], Codecs]:
    """Collective: the codec and, past risk "low", each further width's own (8-bit encoding costs
    several times 1-bit's per element on CPU), every rank at once."""
    repeats = policy.codec_repeats
    codec = measure_codec(numel, repeats=repeats, collective=True, group=group, device=device)
    codecs: Codecs = ()
    if risk != "low":
        codecs = measure_codecs(numel, (2, 8), repeats=repeats, collective=True, group=group, device=device)
    return codec, codecs


def job_copy(numel: int, group: ProcessGroup | None, device: torch.device, policy: AutoPolicy) -> dict[str, float]:
    """Collective: a copy's speed (a block round's passes over the parameters), every rank at once."""
    return measure_copy(numel, repeats=policy.codec_repeats, collective=True, group=group, device=device)


def local_compute(
    durations: Sequence[float], locals_: Sequence[float], device: torch.device, group: ProcessGroup | None
) -> float | None:
    """Collective on CPU: the ranks' mean of their median time outside the exchange over the timed steps
    (their local compute), or ``None`` where any rank lacks it. ``None`` at once on a GPU, without a
    collective (the same on every rank): its backward returns before its kernels end, so the exchange's
    wait holds compute too."""
    own = [statistics.median(locals_)] if len(locals_) == len(durations) > 0 else []
    if device.type != "cpu":
        return None
    total, ranks = slowest([own[0] if own else 0.0, 1.0 if own else 0.0], group, op="sum")
    return total / ranks if round(ranks) == comm.get_world_size(group) else None


def probe_fixed_costs(
    probes: Sequence[cm.Candidate],
    families: set[str],
    network: cm.Network,
    group: ProcessGroup | None,
    overlap: bool,
    policy: AutoPolicy,
) -> dict[str, float]:
    """Collective: the fixed cost per step of each of ``probes`` in ``families`` (the same list on every
    rank), on a tiny model (:func:`bunsan.algorithms.measure.measure_fixed_costs`)."""
    chosen = [p for p in probes if probe_family(p) in families]
    return dict(
        measure_fixed_costs(
            chosen,
            network,
            group=group,
            overlap=overlap,
            steps=policy.probe_steps,
            warmup=policy.probe_warmup,
            repeats=policy.probe_repeats,
        )
    )
