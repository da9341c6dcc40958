"""``bunsan run``: start workers, watch them, leave no process behind, on one host or many.

Imports nothing of the training side (no torch): the launcher only starts and
watches processes. Host parsing and slot assignment (:mod:`bunsan.launch.hosts`)
and option parsing (:mod:`bunsan.launch.config`) are pure; planning a job
is :mod:`bunsan.launch.plan`; starting and watching the workers of one machine
is :mod:`bunsan.launch.local` (its run loop), :mod:`bunsan.launch.proctree`
(finding and signalling the job's processes, the janitor),
:mod:`bunsan.launch.output` (tagged output) and :mod:`bunsan.launch.blame`
(which rank failed first); the ssh
fan-out over several hosts is :mod:`bunsan.launch.ssh` (what runs where:
:mod:`bunsan.launch.ssh_plan`), with one agent per host
(:mod:`bunsan.launch.remote`, speaking :mod:`bunsan.launch.protocol`); :mod:`bunsan.launch.cleanup` ends what is
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
    worker_command,
    worker_environment,
)
from bunsan.launch.ssh import run_hosts
from bunsan.launch.ssh_plan import HostPlan, SshOptions, plan_hosts

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
    "worker_command",
    "worker_environment",
]
