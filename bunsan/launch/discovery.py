"""Where an elastic job may run its workers: the pool of hosts and slots, and the discovery script that changes it.

``bunsan run -np 4 --min-np 2 --max-np 6 --host-discovery-script ./hosts.sh train.py`` (Horovod Elastic's
spelling) runs the script at the start and every :data:`DISCOVERY_INTERVAL_S` seconds; it prints one
``HOST:SLOTS`` line per host that may run workers now (a bare ``HOST`` is one slot). With ``-H`` or
``--hostfile`` instead, the pool is the hosts and slots listed, fixed for the whole job; with neither, it is
this machine with ``-np`` slots.

The arithmetic of the pool is here and pure (docs/how-to/elastic.md, "Growing the group"):

* a slot is free when its host is in the pool and runs fewer workers than it has slots;
* a lost worker that is started again (``--max-restarts``) goes back on its own host if that host still has
  a free slot, else on the first free slot in the pool's order;
* the group grows onto free slots, in the pool's order, while fewer than ``--max-np`` workers run; a worker
  lost for good (no restart left) keeps its place in that count, so only ``--max-restarts`` decides how many
  lost workers are replaced;
* a host that leaves the pool keeps the workers it runs until they end; none is started there again.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections import Counter
from collections.abc import Mapping, Sequence

from bunsan.launch.hosts import MAX_HOST_NAME, Host
from bunsan.launch.quoting import MAX_QUOTED_PATH, quoted

__all__ = [
    "DISCOVERY_INTERVAL_S",
    "DISCOVERY_TIMEOUT_S",
    "DiscoveryError",
    "free_slots",
    "grow_count",
    "parse_discovery",
    "place",
    "run_discovery",
]

DISCOVERY_INTERVAL_S = 2.0  # seconds between two runs of the discovery script (Horovod runs its own every second)
DISCOVERY_TIMEOUT_S = 30.0  # a run that takes longer counts as a failed one

_LINE_RE = re.compile(r"^(?P<name>[A-Za-z0-9_][A-Za-z0-9_.@-]*)(?::(?P<slots>[0-9]+))?$")


class DiscoveryError(ValueError):
    """The discovery script failed or printed something that is not ``HOST:SLOTS`` lines; one sentence."""


def parse_discovery(text: str, source: str = "the discovery script") -> list[Host]:
    """The hosts of the script's output: one ``HOST:SLOTS`` or ``HOST`` line each; blank lines are skipped.

    Raises:
        DiscoveryError: A line is not ``HOST[:SLOTS]``, has 0 slots, or repeats a host.
    """
    hosts: list[Host] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        match = _LINE_RE.match(line)
        if match is None or len(match["name"]) > MAX_HOST_NAME:
            raise DiscoveryError(f"{source} printed {quoted(line)} on line {lineno}; expected HOST:SLOTS, e.g. node1:4")
        slots = int(match["slots"]) if match["slots"] is not None else 1
        if slots < 1:
            raise DiscoveryError(f"{source} gave host {quoted(match['name'])} 0 slots on line {lineno}")
        if any(host.name == match["name"] for host in hosts):
            raise DiscoveryError(f"{source} listed host {quoted(match['name'])} twice (line {lineno})")
        hosts.append(Host(match["name"], slots))
    return hosts


def run_discovery(path: str, timeout_s: float = DISCOVERY_TIMEOUT_S) -> list[Host]:
    """Run the discovery script at ``path`` once and parse what it printed.

    Raises:
        DiscoveryError: It could not be run, took longer than ``timeout_s``, exited with an error, or printed
            something else than ``HOST:SLOTS`` lines.
    """
    name = f"the discovery script {quoted(path, MAX_QUOTED_PATH)}"
    try:
        process = subprocess.Popen(
            [os.path.abspath(path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # on a timeout its children go too: they would hold its pipes open
        )
    except OSError as err:
        raise DiscoveryError(f"{name} cannot be run ({err.strerror}); it must be an executable file") from None
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise DiscoveryError(f"{name} did not finish within {timeout_s:.0f} s") from None
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["nothing on stderr"]
        raise DiscoveryError(f"{name} exited with code {done.returncode} ({said[0][:200]})")
    try:
        text = done.stdout.decode()
    except UnicodeDecodeError:
        raise DiscoveryError(f"{name} printed bytes that are not UTF-8 text") from None
    return parse_discovery(text, name)


def free_slots(pool: Sequence[Host], running: Mapping[str, int]) -> list[str]:
    """One host name per free slot of ``pool``, in the pool's order; ``running`` counts the workers per host."""
    return [host.name for host in pool for _ in range(max(0, host.slots - running.get(host.name, 0)))]


def place(pool: Sequence[Host], running: Mapping[str, int], prefer: str | None = None) -> str | None:
    """The host for one more worker: ``prefer`` (a lost worker's own host) if it has a free slot, else the
    first free slot in the pool's order; ``None`` when no slot is free."""
    free = free_slots(pool, running)
    if prefer is not None and prefer in free:
        return prefer
    return free[0] if free else None


def grow_count(max_np: int, running: int, lost: int, pool: Sequence[Host], by_host: Mapping[str, int]) -> int:
    """How many workers to start to grow the group: up to ``max_np`` counting the ``lost`` ones, onto free slots."""
    return max(0, min(max_np - running - lost, len(free_slots(pool, by_host))))


def count_by_host(hosts: Sequence[str]) -> dict[str, int]:
    """The workers per host, from the host of each running worker."""
    return dict(Counter(hosts))
