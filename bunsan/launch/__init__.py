"""``bunsan run``: start workers, watch them, leave no process behind, on one host or many.

Imports nothing of the training side (no torch): the launcher only starts and
watches processes. Host parsing and slot assignment (:mod:`bunsan.launch.hosts`)
and option parsing (:mod:`bunsan.launch.config`) are pure; starting and
watching the workers of one machine is :mod:`bunsan.launch.local`; the ssh
fan-out over several hosts is :mod:`bunsan.launch.ssh`, with one agent per
host (:mod:`bunsan.launch.remote`); :mod:`bunsan.launch.cleanup` ends what is
left of a job (``bunsan run --cleanup``) and :mod:`bunsan.launch.doctor`
checks the hosts before a job (``bunsan doctor``).
"""

from __future__ import annotations

from bunsan.launch.config import LaunchConfig, UsageError, parse_run_args
from bunsan.launch.hosts import Host, Slot, assign_slots, is_local_host, parse_hostfile, parse_hosts, read_hostfile
from bunsan.launch.local import (
    JobOutcome,
    WorkerSpec,
    plan_workers,
    run_attempts,
    run_job,
    run_workers,
    worker_command,
    worker_environment,
)

# bunsan.launch.ssh imports bunsan.launch.remote, the agent that runs as
# `python -m bunsan.launch.remote`: imported here eagerly, runpy would warn on
# every host that the module was imported before it ran. So lazily (PEP 562).
_LAZY = {"HostPlan", "SshOptions", "plan_hosts", "run_hosts"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from bunsan.launch import ssh

        return getattr(ssh, name)
    raise AttributeError(f"module 'bunsan.launch' has no attribute {name!r}")


__all__ = [
    "Host",
    "HostPlan",
    "JobOutcome",
    "LaunchConfig",
    "Slot",
    "SshOptions",
    "UsageError",
    "WorkerSpec",
    "assign_slots",
    "is_local_host",
    "parse_hostfile",
    "parse_hosts",
    "parse_run_args",
    "plan_hosts",
    "plan_workers",
    "read_hostfile",
    "run_attempts",
    "run_hosts",
    "run_job",
    "run_workers",
    "worker_command",
    "worker_environment",
]
