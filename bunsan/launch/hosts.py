"""Parse host lists and hostfiles, and assign ranks to slots.

Pure: no processes, no network, no torch. The one function that touches the
file system, :func:`read_hostfile`, only reads the file and hands its text to
:func:`parse_hostfile`, so every rule is unit-tested on strings;
:func:`usable_cores` asks the kernel, and :func:`check_oversubscription` takes
its answer as an argument.

Two spellings describe the same thing, a list of hosts with a number of slots
(worker processes) each::

    -H node1:4,node2:4            # --hosts; a bare name means one slot

    # hostfile                    # one host per line, '#' starts a comment
    node1 slots=4
    node2 slots=4
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bunsan.launch.quoting import MAX_QUOTED_PATH, quoted

__all__ = [
    "MAX_HOST_NAME",
    "OVERSUBSCRIBE_LIMIT",
    "Host",
    "Slot",
    "assign_slots",
    "check_oversubscription",
    "is_local_host",
    "parse_hostfile",
    "parse_hosts",
    "read_hostfile",
    "usable_cores",
]

# Host names, IPv4 addresses and "user@host" (an ssh login) for the ssh fan-out.
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.@-]*"
_HOSTS_ITEM_RE = re.compile(rf"^(?P<name>{_NAME})(?::(?P<slots>[0-9]+))?$")
_HOSTFILE_LINE_RE = re.compile(rf"^(?P<name>{_NAME})(?::(?P<colon_slots>[0-9]+)|\s+slots\s*=\s*(?P<slots>[0-9]+))?$")

MAX_HOST_NAME = 255  # longer than any DNS name (253) or ssh login; anything longer is junk
OVERSUBSCRIBE_LIMIT = 8  # workers per core above which a launch is refused without --oversubscribe

_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


@dataclass(frozen=True)
class Host:
    """A machine and how many workers it runs.

    Attributes:
        name: Host name or address, as written by the user.
        slots: Number of worker processes it may run; >= 1.
    """

    name: str
    slots: int


@dataclass(frozen=True)
class Slot:
    """Where one rank runs, with the torchrun-style numbers it is given.

    Attributes:
        host: Name of the host that runs this rank.
        rank: Global rank, 0-based.
        local_rank: Rank among the workers on the same host.
        world_size: Number of workers in the job.
        local_world_size: Number of workers on this host.
        group_rank: Index of the host among the hosts that run workers
            (torchrun's ``GROUP_RANK``, the node rank).
    """

    host: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int


def _check_name_length(name: str, where: str) -> None:
    if len(name) > MAX_HOST_NAME:
        raise ValueError(
            f"{where}: host name {quoted(name)} is longer than any valid host name ({MAX_HOST_NAME} characters)"
        )


def parse_hosts(spec: str) -> list[Host]:
    """Parse a ``-H``/``--hosts`` value such as ``"node1:4,node2:4"``.

    Args:
        spec: Comma-separated ``NAME[:SLOTS]`` items; a bare name has one slot.

    Returns:
        The hosts in the order given.

    Raises:
        ValueError: An item does not parse, has zero slots, or a host is
            listed twice.
    """
    hosts: list[Host] = []
    for item in spec.split(","):
        item = item.strip()
        match = _HOSTS_ITEM_RE.match(item)
        if match is None:
            raise ValueError(
                f"cannot read {quoted(item)} in --hosts {quoted(spec)}; expected NAME:SLOTS items such as node1:4,node2:4"
            )
        name = match["name"]
        _check_name_length(name, f"--hosts {quoted(spec)}")
        slots = int(match["slots"]) if match["slots"] is not None else 1
        if slots < 1:
            raise ValueError(f"host {quoted(name)} in --hosts {quoted(spec)} has 0 slots; give it 1 or more or drop it")
        if any(host.name == name for host in hosts):
            raise ValueError(f"--hosts {quoted(spec)} lists {quoted(name)} twice; list it once with all its slots")
        hosts.append(Host(name, slots))
    return hosts


def parse_hostfile(text: str, source: str = "<hostfile>") -> list[Host]:
    """Parse the text of a hostfile: ``HOST slots=N`` lines, ``#`` comments.

    A line may also be a bare ``HOST`` (one slot) or ``HOST:N``. Blank lines
    and everything after ``#`` are ignored.

    Args:
        text: The file's contents.
        source: Name used in error messages, normally the file's path.

    Returns:
        The hosts in file order.

    Raises:
        ValueError: Naming ``source`` and the line number, when a line does
            not parse, has zero slots or repeats a host; or when the file
            lists no host at all.
    """
    hosts: list[Host] = []
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE_RE.match(line)
        if match is None:
            raise ValueError(
                f"{source}:{lineno}: cannot read {quoted(line)}; expected 'HOST slots=N', e.g. 'node1 slots=4'"
            )
        name = match["name"]
        _check_name_length(name, f"{source}:{lineno}")
        slots_text = match["slots"] or match["colon_slots"]
        slots = int(slots_text) if slots_text is not None else 1
        if slots < 1:
            raise ValueError(
                f"{source}:{lineno}: host {quoted(name)} has 0 slots; give it slots=1 or more, or remove the line"
            )
        if name in first_line:
            raise ValueError(
                f"{source}:{lineno}: host {quoted(name)} is already listed on line {first_line[name]}; "
                "list it once with all its slots"
            )
        first_line[name] = lineno
        hosts.append(Host(name, slots))
    if not hosts:
        raise ValueError(f"{source} lists no hosts; add lines such as 'node1 slots=4'")
    return hosts


def read_hostfile(path: str | Path) -> list[Host]:
    """Read and parse the hostfile at ``path`` (see :func:`parse_hostfile`).

    Raises:
        ValueError: The file cannot be read or does not parse; the message
            names the file (and the line, for a parse error).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(
            f"cannot read hostfile {quoted(path, MAX_QUOTED_PATH)} ({reason}); check the --hostfile path"
        ) from None
    return parse_hostfile(text, source=str(path))


def assign_slots(hosts: Sequence[Host], nproc: int | None = None) -> list[Slot]:
    """Give ranks ``0..nproc-1`` to slots, filling each host before the next.

    Filling in order keeps neighbouring ranks on one machine, where their
    traffic is cheapest. Hosts that get no rank are left out, and
    ``group_rank`` counts only the hosts that run workers.

    Args:
        hosts: Hosts in the order to fill.
        nproc: Number of workers; ``None`` uses every slot.

    Returns:
        One slot per rank, in rank order.

    Raises:
        ValueError: ``hosts`` is empty, ``nproc`` < 1, or ``nproc`` exceeds
            the number of slots.
    """
    if not hosts:
        raise ValueError("no hosts to run on; pass -H NAME:SLOTS or --hostfile PATH, or leave both out to run locally")
    capacity = sum(host.slots for host in hosts)
    if nproc is None:
        nproc = capacity
    if nproc < 1:
        raise ValueError(f"-np must be >= 1, got {nproc}; pass the number of worker processes, e.g. -np 2")
    if nproc > capacity:
        listed = ", ".join(f"{host.name}:{host.slots}" for host in hosts)
        raise ValueError(
            f"-np {nproc} is more than the {capacity} slot(s) of the hosts ({listed}); "
            "lower -np or give the hosts more slots"
        )
    slots: list[Slot] = []
    for group_rank, host in enumerate(hosts):
        if len(slots) == nproc:
            break
        local_world_size = min(host.slots, nproc - len(slots))
        slots += [
            Slot(host.name, len(slots) + i, i, nproc, local_world_size, group_rank) for i in range(local_world_size)
        ]
    return slots


def is_local_host(name: str, hostname: str) -> bool:
    """Whether ``name`` means this machine.

    Args:
        name: A host name or address from ``-H`` or a hostfile.
        hostname: This machine's name (``socket.gethostname()``), passed in
            so the function stays pure.

    Returns:
        True for ``localhost`` and its usual aliases, loopback addresses,
        and ``hostname`` with or without its domain. A name with a user
        (``root@localhost``) is never local: it asks for an ssh login.
    """
    lowered = name.lower()
    own = hostname.lower()
    if lowered in _LOCAL_NAMES or lowered in (own, own.split(".", 1)[0]):
        return True
    try:
        return ipaddress.ip_address(lowered).is_loopback
    except ValueError:
        return False


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under ``taskset`` or a cgroup cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except OSError:
            pass
    return max(1, os.cpu_count() or 1)


def check_oversubscription(workers: int, cores: int, host: str, allowed: bool) -> str | None:
    """Say whether ``workers`` processes on a host with ``cores`` cores are too many. Pure.

    More workers than cores slow every worker down (each one waits for a core);
    more than :data:`OVERSUBSCRIBE_LIMIT` per core is almost always a typo
    (``-np 640``, ``slots=100000``) that would start thousands of processes.

    Args:
        workers: Workers planned on the host.
        cores: Its usable cores (:func:`usable_cores` there).
        host: The host's name, for the message.
        allowed: ``--oversubscribe`` was given: no warning, no refusal.

    Returns:
        A one-sentence warning when ``workers > cores``, else None.

    Raises:
        ValueError: ``workers`` exceeds ``OVERSUBSCRIBE_LIMIT * cores`` and
            ``allowed`` is false.
    """
    if allowed or workers <= cores:
        return None
    if workers > OVERSUBSCRIBE_LIMIT * cores:
        raise ValueError(
            f"{workers} workers on {quoted(host)}, which has {cores} CPU core(s), is more than "
            f"{OVERSUBSCRIBE_LIMIT} per core; lower -np or the slots, or pass --oversubscribe to start them anyway"
        )
    return (
        f"{workers} workers on {quoted(host)}, which has {cores} CPU core(s), oversubscribe it and each will run "
        "slower; lower -np or the slots to the core count, or pass --oversubscribe to silence this"
    )
