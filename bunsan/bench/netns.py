"""A shaped network on one machine: each worker in its own network namespace, on a rate-limited link.

On one machine the workers of a job talk over loopback, which is far faster
than any real network, so a benchmark there can never show a job that is
bound by communication. With ``--network rate=1gbit`` (``bunsan bench
compare``, ``bunsan bench throughput``, ``bunsan bench comm``) each worker
instead runs in a network namespace of its own, joined to the others through
a bridge by a veth link shaped to that rate in both directions, like hosts on
one switch::

    ns bunsan-<pid>-w0                ns bunsan-<pid>-br                ns bunsan-<pid>-w1
    bsn0 10.213.0.1 <== veth, tbf ==> w0 --[bridge bsn-br]-- w1 <== veth, tbf ==> bsn0 10.213.0.2

Each link direction has a token-bucket filter (``tc qdisc ... tbf``) of the
given rate; the burst defaults to 1 ms of traffic (at least 16 KiB), so that
short messages do not slip through at memory speed (what ``tbf`` delivers
against the rate asked: docs/benchmarks.md and docs/experiments/design-notes.md, "bench").
Only the rate can be shaped: delay, jitter and loss need ``tc qdisc ... netem``,
which the kernel this was built on does not have, so ``delay=...`` and the like
are refused.

The workers are started by this module's own small launcher (``python -m
bunsan.bench.netns``), each as ``ip netns exec <its namespace> <command>``
with the variables :func:`bunsan.init` reads: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (all workers are on this machine),
``MASTER_ADDR`` (rank 0's address in its namespace), ``MASTER_PORT``,
``BUNSAN_JOB_ID``, and ``GLOO_SOCKET_IFNAME`` (the worker's end of its link,
so that Gloo uses it). The namespaces are fresh, so the port never collides
with anything. The launcher creates the namespaces, links and filters before
the workers start and removes them in a ``finally`` block: after a normal end,
a failed worker (the others are stopped; its exit code is returned), Ctrl-C
or SIGTERM. Should the launcher itself be killed with SIGKILL, its workers die
with it (``PR_SET_PDEATHSIG``) and the next launcher removes the namespaces
whose launcher is gone (or run ``python -m bunsan.bench.netns --cleanup``).

This needs root (network namespaces, veth links and ``tc`` need
CAP_NET_ADMIN) and the ``ip`` and ``tc`` commands of iproute2; without them
it refuses with one sentence. Traffic stays inside the namespaces it creates.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from bunsan.bench.netns_plan import (
    PREFIX,
    NetworkSpec,
    Topology,
    launcher_command,
    parse_network,
    parse_rate,
    plan_topology,
    setup_commands,
    worker_environment,
)

__all__ = [
    "NetworkSpec",
    "Topology",
    "add_arguments",
    "check_network_argument",
    "check_privileges",
    "create_network",
    "launcher_command",
    "list_namespaces",
    "main",
    "parse_network",
    "parse_rate",
    "plan_topology",
    "remove_network",
    "remove_stale",
    "run_workers",
    "setup_commands",
    "worker_environment",
]


STOP_GRACE_S = 5.0
_STALE = re.compile(rf"{PREFIX}-(?P<pid>\d+)-(?:br|w\d+)")


# -- privileged: create, remove, run ---------------------------------------------------------
def check_privileges() -> None:
    """Refuse, in one sentence, where namespaces cannot be made: not root, or no ``ip``/``tc``.

    Raises:
        PermissionError: not root.
        FileNotFoundError: ``ip`` or ``tc`` (iproute2) is missing.
    """
    if os.geteuid() != 0:
        raise PermissionError(
            "the shaped network (--network) needs root: network namespaces, veth links and tc "
            "need CAP_NET_ADMIN; run as root, or drop --network to use loopback"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(
                f"the shaped network (--network) needs the {tool!r} command of iproute2; "
                "install iproute2 (apt-get install iproute2)"
            )


def _run(command: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, check=False, timeout=30)


def list_namespaces() -> list[str]:
    """Names of this machine's network namespaces (``ip netns list``)."""
    result = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _kill_inside(namespace: str) -> None:
    """SIGKILL every process still inside ``namespace``: only the workers we started can be there."""
    result = _run(["ip", "netns", "pids", namespace])
    for pid in result.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_network(topology: Topology) -> list[str]:
    """Kill what is left inside ``topology``'s namespaces and delete them; return those that would not go.

    Deleting a namespace deletes the links and filters inside it. Safe to call
    on a half-built or already removed topology.
    """
    existing = set(list_namespaces())
    left = []
    for namespace in reversed(topology.namespaces):  # workers first, then the bridge
        if namespace not in existing:
            continue
        _kill_inside(namespace)
        if _run(["ip", "netns", "del", namespace]).returncode != 0 and namespace in list_namespaces():
            left.append(namespace)
    return left


def create_network(topology: Topology, spec: NetworkSpec | None) -> None:
    """Build ``topology`` (namespaces, bridge, links, filters). On failure, remove what was built and raise.

    Raises:
        RuntimeError: a command failed; the message names it and what it said.
    """
    for command in setup_commands(topology, spec):
        result = _run(command)
        if result.returncode != 0:
            remove_network(topology)
            raise RuntimeError(
                f"building the shaped network failed at `{shlex.join(command)}`: "
                f"{(result.stderr or result.stdout).strip() or 'exit ' + str(result.returncode)}"
            )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces of launchers that are gone (killed with SIGKILL); return their names."""
    removed = []
    for namespace in list_namespaces():
        match = _STALE.fullmatch(namespace)
        if match and int(match["pid"]) != os.getpid() and not _alive(int(match["pid"])):
            _kill_inside(namespace)
            if _run(["ip", "netns", "del", namespace]).returncode == 0:
                removed.append(namespace)
    return removed


class _Stop(Exception):
    """SIGTERM or SIGHUP reached the launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signum)


def _stop_workers(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each worker's process group, then SIGKILL whatever is left after a grace period."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run_workers(
    spec: NetworkSpec | None, world_size: int, command: Sequence[str], say: Callable[[str], None] | None = None
) -> int:
    """Run ``command`` on ``world_size`` workers, each in its namespace; return the job's exit code.

    Builds the network, starts the workers, waits; when one fails the others
    are stopped and its exit code returned. The namespaces are removed
    whatever happens (Ctrl-C and SIGTERM included). ``spec=None`` runs on
    unshaped veth links (a reference for the shaped runs).
    """
    from bunsan.launch import local  # the launcher's helpers: job id, die-with-launcher

    say = say or (lambda message: print(f"bunsan netns: {message}", file=sys.stderr, flush=True))
    check_privileges()
    stale = remove_stale()
    if stale:
        say(f"removed {len(stale)} namespace(s) left by launchers that were killed: {', '.join(stale)}")
    argv = local.worker_command(list(command))
    topology = plan_topology(world_size)
    job_id = local.new_job_id()
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        create_network(topology, spec)
        preexec = local.die_with_launcher_hook()
        for rank in range(world_size):
            env = worker_environment(topology, rank, dict(os.environ), job_id)
            processes.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", topology.namespace(rank), *argv],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            )
        while True:
            codes = [p.poll() for p in processes]
            failed = next(((rank, code) for rank, code in enumerate(codes) if code is not None and code != 0), None)
            if failed is not None:
                say(f"worker {failed[0]} exited with code {_exit_code(failed[1])}; stopping the others")
                return _exit_code(failed[1])
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        say("interrupted; stopping the workers and removing the namespaces")
        return 130
    except _Stop as stop:
        say(f"{stop} received; stopping the workers and removing the namespaces")
        return 128 + stop.signum
    finally:
        # Signals must not cut the clean-up short: ignore them until the namespaces are gone.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            _stop_workers(processes)
            left = remove_network(topology)
            if left:
                say(f"could not remove namespace(s) {', '.join(left)}; remove them with `ip netns del NAME`")
        finally:
            signal.signal(signal.SIGINT, old_int)
            for s, handler in previous.items():
                signal.signal(s, handler)


# -- the benchmarks' --network option ------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--network rate=RATE[,burst=SIZE]`` to a benchmark's parser."""
    parser.add_argument(
        "--network",
        metavar="rate=RATE[,burst=SIZE]",
        help="run every job's workers in network namespaces joined by veth links shaped to RATE "
        "(e.g. rate=1gbit, rate=100mbit) with tc tbf, both directions; needs root. Rate only: "
        "delay/loss emulation (netem) is not available",
    )


def check_network_argument(args: argparse.Namespace) -> str | None:
    """The refusal (one sentence) for ``args.network``, or ``None`` when it is absent or usable."""
    if getattr(args, "network", None) is None:
        return None
    try:
        parse_network(args.network)
        check_privileges()
    except (ValueError, PermissionError, FileNotFoundError) as err:
        return str(err)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bunsan.bench.netns --network rate=1gbit -np 2 -- COMMAND...``: the shaped-network launcher."""
    parser = argparse.ArgumentParser(
        prog="python -m bunsan.bench.netns",
        description="Run COMMAND on N workers, each in its own network namespace, joined by veth links shaped "
        "with tc tbf; the namespaces are removed at the end. Needs root.",
    )
    parser.add_argument(
        "--network",
        metavar="rate=RATE[,burst=SIZE]",
        help="the links' rate, e.g. rate=1gbit; 'none' for unshaped links",
    )
    parser.add_argument("-np", "--np", dest="workers", type=int, default=2, help="workers; default %(default)s")
    parser.add_argument(
        "--cleanup", action="store_true", help="only remove namespaces left by launchers that were killed, then exit"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, after --")
    args = parser.parse_args(argv)
    try:
        if args.cleanup:
            check_privileges()
            removed = remove_stale()
            print(f"removed {len(removed)} namespace(s){': ' + ', '.join(removed) if removed else ''}")
            return 0
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("no command given; write e.g. -np 2 -- python train.py")
        if args.network is None:
            parser.error("--network is required (rate=RATE, or none for unshaped links)")
        spec = None if args.network.strip().lower() == "none" else parse_network(args.network)
        plan_topology(args.workers)
        return run_workers(spec, args.workers, command)
    except (ValueError, PermissionError, FileNotFoundError, RuntimeError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
