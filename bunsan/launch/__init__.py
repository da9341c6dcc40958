"""``bunsan run``: start workers, watch them, leave no process behind.

Imports nothing of the training side (no torch): the launcher only starts and
watches processes. Host parsing and slot assignment (:mod:`bunsan.launch.hosts`)
and option parsing (:mod:`bunsan.launch.config`) are pure; starting and
watching local workers is :mod:`bunsan.launch.local`.
"""

from __future__ import annotations

from bunsan.launch.config import LaunchConfig, UsageError, parse_run_args
from bunsan.launch.hosts import Host, Slot, assign_slots, is_local_host, parse_hostfile, parse_hosts, read_hostfile
from bunsan.launch.local import WorkerSpec, plan_workers, run_workers, worker_command, worker_environment

__all__ = [
    "Host",
    "LaunchConfig",
    "Slot",
    "UsageError",
    "WorkerSpec",
    "assign_slots",
    "is_local_host",
    "parse_hostfile",
    "parse_hosts",
    "parse_run_args",
    "plan_workers",
    "read_hostfile",
    "run_workers",
    "worker_command",
    "worker_environment",
]
