"""What the ssh fan-out runs on each host: the ssh command line, the agent's command, the host plans
and the choice of ``MASTER_ADDR``. Pure (but for the local script check of :func:`plan_hosts`).

:mod:`bunsan.launch.ssh` runs the plans; this module imports nothing of the agent
(:mod:`bunsan.launch.remote`), so ``bunsan.launch`` can export these names eagerly.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bunsan.launch.config import HOST_KEY_CHECKING
from bunsan.launch.hosts import Slot
from bunsan.launch.plan import JOB_ID_VARIABLE, worker_command
from bunsan.launch.quoting import quoted

__all__ = [
    "HostPlan",
    "SshOptions",
    "agent_command",
    "master_address",
    "plan_hosts",
    "remote_command",
    "ssh_command",
]


@dataclass(frozen=True)
class SshOptions:
    """How to reach the hosts with the system's ``ssh`` client.

    Attributes:
        port: ``-p``; ``None`` leaves it to ssh (its config, or 22).
        identity: ``-i`` key file; ``None`` leaves it to ssh.
        host_key_checking: ``StrictHostKeyChecking``: ``"yes"``, ``"accept-new"``
            or ``"no"``; ``"no"`` also keeps the keys out of ``known_hosts``
            (``UserKnownHostsFile=/dev/null``). ``None`` leaves it to ssh's config.
        options: More ``-o KEY=VALUE`` options, passed as given.
        connect_timeout_s: ``ConnectTimeout``.
        executable: The ssh client.
    """

    port: int | None = None
    identity: str | None = None
    host_key_checking: str | None = None
    options: tuple[str, ...] = ()
    connect_timeout_s: int = 10
    executable: str = "ssh"

    def __post_init__(self) -> None:
        if self.host_key_checking is not None and self.host_key_checking not in HOST_KEY_CHECKING:
            raise ValueError(
                f"--ssh-host-key-checking must be one of {', '.join(HOST_KEY_CHECKING)}, "
                f"got {quoted(self.host_key_checking)}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "identity": self.identity,
            "host_key_checking": self.host_key_checking,
            "options": list(self.options),
            "connect_timeout_s": self.connect_timeout_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SshOptions:
        return cls(
            data.get("port"),
            data.get("identity"),
            data.get("host_key_checking"),
            tuple(data.get("options", ())),
            int(data.get("connect_timeout_s", 10)),
        )


def ssh_command(host: str, command: str, options: SshOptions) -> list[str]:
    """Return the argv that runs the shell command ``command`` on ``host``. Pure.

    ``BatchMode=yes``: a missing key fails at once instead of prompting for a
    password. ``-T``: no pseudo terminal, so output stays byte-exact and
    stderr separate. Keep-alives make a dead connection end the client
    within 15 s, which the launcher reports as a lost host.
    """
    argv = [
        options.executable,
        "-T",
        "-x",
        "-a",
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={options.connect_timeout_s}",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
        "-o",
        "LogLevel=ERROR",
    ]
    if options.host_key_checking is not None:
        argv += ["-o", f"StrictHostKeyChecking={options.host_key_checking}"]
        if options.host_key_checking == "no":
            argv += ["-o", "UserKnownHostsFile=/dev/null"]
    for option in options.options:
        argv += ["-o", option]
    if options.port is not None:
        argv += ["-p", str(options.port)]
    if options.identity is not None:
        argv += ["-i", options.identity]
    return [*argv, "--", host, command]


def remote_command(python: str, module: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> str:
    """The shell command that runs ``python -m module args`` on a host, with ``env`` set. Pure.

    ``exec`` replaces the login shell, so the agent is the ssh session's
    own child and nothing sits between them.
    """
    assignments = [f"{name}={value}" for name, value in (env or {}).items()]
    prefix = ["env", *assignments] if assignments else []
    return "exec " + shlex.join([*prefix, python, "-m", module, *args])


def agent_command(python: str, job_id: str) -> str:
    """The shell command that starts the agent of job ``job_id`` (it carries ``BUNSAN_JOB_ID``)."""
    return remote_command(python, "bunsan.launch.remote", env={JOB_ID_VARIABLE: job_id})


def master_address(rank0_host: str, rank0_is_local: bool, ssh_connections: Mapping[str, str]) -> str:
    """Choose ``MASTER_ADDR`` from what the agents saw of their ssh connections. Pure.

    Args:
        rank0_host: The host of rank 0, as the user wrote it.
        rank0_is_local: Whether that host is this machine.
        ssh_connections: ``SSH_CONNECTION`` (``"client_ip client_port
            server_ip server_port"``) of each remote host's agent, in host order.

    Returns:
        For a remote rank 0, the address the launcher reached it at; for rank 0
        here, this machine's address as the first remote host sees it. Where
        that is unknown or a loopback address (an ssh tunnel), the host name.
    """

    def usable(address: str) -> bool:
        return bool(address) and not address.startswith("127.") and address != "::1"

    if rank0_is_local:
        for connection in ssh_connections.values():
            fields = connection.split()
            if len(fields) == 4 and usable(fields[0]):
                return fields[0]
        return socket.gethostname()
    fields = ssh_connections.get(rank0_host, "").split()
    if len(fields) == 4 and usable(fields[2]):
        return fields[2]
    return rank0_host.rsplit("@", 1)[-1]


@dataclass(frozen=True)
class HostPlan:
    """One host of a multi-host job and what its agent runs.

    Attributes:
        host: Host name, as the user wrote it.
        group_rank: Index of the host among the hosts of the job.
        local: This machine: its agent runs without ssh.
        slots: ``[rank, local_rank, world_size, local_world_size]`` per worker.
        argv: The worker command, resolved for this host.
        script: A ``.py`` script the agent checks for, or ``None``.
        python: The interpreter that runs the agent (and ``.py`` scripts).
        cwd: The workers' working directory.
    """

    host: str
    group_rank: int
    local: bool
    slots: tuple[tuple[int, int, int, int], ...]
    argv: tuple[str, ...]
    script: str | None
    python: str
    cwd: str


def plan_hosts(
    slots: Sequence[Slot],
    command: Sequence[str],
    is_local: Callable[[str], bool],
    remote_python: str | None = None,
    remote_cwd: str | None = None,
) -> list[HostPlan]:
    """Group the slots by host and resolve each host's command. Pure but for the local script check.

    Raises:
        ValueError: The command cannot be resolved for this machine (a local host).
    """
    hosts = list(dict.fromkeys(slot.host for slot in slots))
    plans = []
    for host in hosts:
        mine = [s for s in slots if s.host == host]
        here = is_local(host)
        python = sys.executable if here else (remote_python or sys.executable)
        argv = worker_command(command, python=python, check=here)
        script = command[0] if command[0].endswith(".py") else None
        plans.append(
            HostPlan(
                host,
                mine[0].group_rank,
                here,
                tuple((s.rank, s.local_rank, s.world_size, s.local_world_size) for s in mine),
                tuple(argv),
                script,
                python,
                os.getcwd() if here else (remote_cwd or os.getcwd()),
            )
        )
    return plans
