"""Where this process stands in its job, read from the variables its launcher set. Pure, no torch.

Launchers recognised, first match wins (:func:`detect_environment`):

============  ==========================================================  =========================
launcher      rank / size / local rank / local size                        master address and port
============  ==========================================================  =========================
bunsan run,   ``RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE``              ``MASTER_ADDR MASTER_PORT``
torchrun
OpenMPI       ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``        see below
MPICH / PMI   ``PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS``        see below
Slurm srun    ``SLURM_PROCID SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``)  first node of
              ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``             ``SLURM_STEP_NODELIST``
none          a lone process: 0 / 1 / 0 / 1                                none needed
============  ==========================================================  =========================

Under MPI, ``MASTER_ADDR`` is taken from the environment when set (``mpirun -x
MASTER_ADDR=node1``); when all ranks share one host it is 127.0.0.1; otherwise, if
mpi4py is installed, rank 0's host name is broadcast over MPI; else :func:`bunsan.init`
says what to set. Without ``MASTER_PORT`` the port is derived from the job id of
the launcher (Slurm, OpenMPI), so that every rank computes the same one; else 29500.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from bunsan.errors import ConfigurationError

__all__ = ["DEFAULT_PORT", "WorldInfo", "detect_environment", "parse_slurm_nodelist", "parse_slurm_tasks_per_node"]

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class WorldInfo:
    """Where this process stands in the job, as read from its environment."""

    launcher: str  # "bunsan", "torchrun", "env", "openmpi", "pmi", "slurm" or "none"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int
    job_id: str


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={value!r} is not an integer") from None


def _port_from_job(job: str | None, environ: Mapping[str, str]) -> int:
    if "MASTER_PORT" in environ:
        return _int(environ, "MASTER_PORT")
    if job:
        digits = int(re.sub(r"\D", "", job) or "0") if re.search(r"\d", job) else sum(map(ord, job))
        return 15000 + digits % 20000  # same on every rank, unlikely to collide with another job
    return DEFAULT_PORT


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list, e.g. ``"gpu[01-03,7],cpu5"``.

    Returns:
        The host names in order (``["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]``).
    """
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?(?:,|$)", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if not prefix and not ranges:
            continue
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ConfigurationError(f"cannot parse Slurm node list {nodelist!r} (range {part!r})")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    if not hosts:
        raise ConfigurationError(f"empty Slurm node list {nodelist!r}")
    return hosts


def parse_slurm_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's ``"2(x3),1"`` form into ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ConfigurationError(f"cannot parse Slurm tasks per node {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _mpi_world(
    env: Mapping[str, str], launcher: str, names: tuple[str, str, str, str], job: str | None, default_job: str
) -> WorldInfo:
    """The world of an MPI launcher from its rank, size, local rank and local size variables (in that order)."""
    rank_name, size_name, local_rank_name, local_size_name = names
    size_ = _int(env, size_name)
    local_size_ = _int(env, local_size_name) if local_size_name in env else size_
    return WorldInfo(
        launcher,
        _int(env, rank_name),
        size_,
        _int(env, local_rank_name) if local_rank_name in env else 0,
        local_size_,
        env.get("MASTER_ADDR") or ("127.0.0.1" if local_size_ == size_ else None),
        _port_from_job(job, env),
        job or default_job,
    )


def detect_environment(environ: Mapping[str, str] | None = None) -> WorldInfo:
    """Read rank, world size and rendezvous address from the launcher's variables.

    Pure: it only reads ``environ`` (``os.environ`` by default). See the module
    docstring for the variables and their precedence.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = env.get("BUNSAN_LAUNCHER") or ("torchrun" if "TORCHELASTIC_RUN_ID" in env else "env")
        rank_, size_ = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank_ = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank_
        local_size_ = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else size_
        if size_ > 1 and "MASTER_ADDR" not in env:
            raise ConfigurationError(
                "RANK and WORLD_SIZE are set but MASTER_ADDR is not; set MASTER_ADDR and MASTER_PORT"
            )
        # A restarted attempt gets its own namespace of store keys (an abort key of the
        # failed attempt must not end the new one).
        if env.get("BUNSAN_JOB_ID"):
            job = f"{env['BUNSAN_JOB_ID']}.{env.get('BUNSAN_RESTART', '0')}"
        else:
            job = f"{env.get('TORCHELASTIC_RUN_ID', 'env')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        info = WorldInfo(
            launcher,
            rank_,
            size_,
            local_rank_,
            local_size_,
            env.get("MASTER_ADDR", "127.0.0.1"),
            _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT,
            job,
        )
    elif "OMPI_COMM_WORLD_RANK" in env:
        prefix = "OMPI_COMM_WORLD_"
        mpi_job = env.get("OMPI_MCA_ess_base_jobid") or env.get("OMPI_MCA_orte_ess_jobid") or env.get("PMIX_NAMESPACE")
        names = (f"{prefix}RANK", f"{prefix}SIZE", f"{prefix}LOCAL_RANK", f"{prefix}LOCAL_SIZE")
        info = _mpi_world(env, "openmpi", names, mpi_job, "mpi")
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        pmi_job = env.get("PMI_JOBID") or env.get("PMIX_NAMESPACE")
        info = _mpi_world(env, "pmi", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), pmi_job, "pmi")
    elif "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
        size_ = _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        local_size_ = parse_slurm_tasks_per_node(per_node)[node] if per_node else size_
        master = env.get("MASTER_ADDR") or (parse_slurm_nodelist(nodelist)[0] if nodelist else "127.0.0.1")
        job = f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
        info = WorldInfo(
            "slurm",
            _int(env, "SLURM_PROCID"),
            size_,
            _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            local_size_,
            master,
            _port_from_job(env.get("SLURM_JOB_ID"), env),
            job,
        )
    else:
        info = WorldInfo("none", 0, 1, 0, 1, None, DEFAULT_PORT, "solo")
    if not 0 <= info.rank < info.world_size:
        raise ConfigurationError(f"rank {info.rank} is outside 0..{info.world_size - 1} (launcher {info.launcher})")
    if not 0 <= info.local_rank < max(info.local_world_size, 1):
        raise ConfigurationError(f"local rank {info.local_rank} is outside 0..{info.local_world_size - 1}")
    return info
