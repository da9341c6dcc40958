"""``bunsan run``: start workers, watch them, leave no process behind, on one host or many.

Imports nothing of the training side (no torch): the launcher only starts and
watches processes. The modules, from the pure ones up:

* :mod:`~bunsan.launch.hosts`: host lists, hostfiles, slot assignment;
* :mod:`~bunsan.launch.options` and :mod:`~bunsan.launch.config`: the options of
  ``bunsan run``, each declared once, into a :class:`LaunchConfig`;
* :mod:`~bunsan.launch.plan`: each worker's command line and environment;
* :mod:`~bunsan.launch.blame`: which rank failed first;
* :mod:`~bunsan.launch.proctree`: finding and signalling a job's processes, the janitor;
* :mod:`~bunsan.launch.output`: the workers' output, tagged with their rank;
* :mod:`~bunsan.launch.local`: the run loop of the workers of one machine;
* :mod:`~bunsan.launch.ssh_plan`, :mod:`~bunsan.launch.protocol`,
  :mod:`~bunsan.launch.remote` and :mod:`~bunsan.launch.ssh`: the fan-out over
  ssh, one agent per host;
* :mod:`~bunsan.launch.cleanup` (``bunsan run --cleanup``),
  :mod:`~bunsan.launch.doctor` (``bunsan doctor``) and
  :mod:`~bunsan.launch.treewatch` (a worker's own children, under any launcher).
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
