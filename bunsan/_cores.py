"""Intra-op threads for CPU workers that share a host: no more threads in all than the host has cores."""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any

import torch

from bunsan import comm

__all__ = ["share", "usable_cores"]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def share(group: Any = None) -> None:
    """Collective over ``group``: where the workers sharing this host would run more intra-op threads together
    than it has cores, give each ``cores // workers on the host`` threads, as :func:`bunsan.init` gives the
    workers it starts one (two workers each using both cores of a 2-core machine made a step 15 times
    slower), and say so once, on the host's lowest rank. Where ``OMP_NUM_THREADS`` is set, the threads are
    the user's: only the warning."""
    threads, cores = torch.get_num_threads(), usable_cores()
    everyone = comm.all_gather_object((socket.gethostname(), threads, cores), group=group)
    host = everyone[comm.get_rank(group)][0]
    here = [r for r, (name, _, _) in enumerate(everyone) if name == host]
    if threads <= 1 or len(here) * threads <= cores:
        return
    fair = max(1, cores // len(here))
    chosen = "OMP_NUM_THREADS" in os.environ
    if not chosen:
        torch.set_num_threads(fair)
    if comm.get_rank(group) == here[0]:
        warnings.warn(
            f"{len(here)} workers share this host's {cores} cores and each ran {threads} intra-op threads; "
            + (
                f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} is set, so they keep them (oversubscribed "
                f"cores slow every step; {fair} each would fit)"
                if chosen
                else f"each now runs {fair} (set OMP_NUM_THREADS to choose)"
            ),
            stacklevel=4,
        )
