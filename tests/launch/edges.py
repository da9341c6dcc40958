"""Issue 15 scenarios in real processes, for the tests and for repeated acceptance runs.

Each scenario starts a 2-rank job of :data:`SCRIPT` (torch, gloo, ``bunsan.init()``)
under ``bunsan run``, torchrun or by hand, and reports what an outside observer
sees: exit codes, the launcher's last line, which processes of the job are left,
which addresses the job listens on. Every process of a scenario carries
``EDGE_TAG=<uuid>`` in its environment (children inherit it), so "the job's
trees" are found in ``/proc`` without trusting bunsan's own bookkeeping.

Repeated runs (the figures of the issue's closing note)::

    python -m tests.launch.edges --runs 20 raise0      # bunsan run names rank 0 when rank 0 raises
    python -m tests.launch.edges --runs 20 torchrun-kill9   # 0 processes left, the dead rank named
    python -m tests.launch.edges --runs 5 listeners    # a local job listens on 127.0.0.1 only

They take 5-20 s per run on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.environment import without_bunsan_settings

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

SCRIPT = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from pathlib import Path

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import bunsan
    from bunsan.comm import all_reduce

    mode, target, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    bunsan.init(timeout_s=60)
    rank = bunsan.rank()
    # The trees the job must not leave behind: a DataLoader worker (forked), a child
    # in the worker's process group, and one in a session of its own.
    loader = iter(DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=1, num_workers=1))
    next(loader)
    kids = [subprocess.Popen(["sleep", "1000"]), subprocess.Popen(["sleep", "1000"], start_new_session=True)]
    all_reduce(torch.ones(1))
    (out / f"ready.{rank}").write_text(" ".join(str(p) for p in [os.getpid()] + [k.pid for k in kids]))
    if mode == "listen":
        while not (out / "go").exists():
            time.sleep(0.05)
    elif mode == "attack" and rank == 0:
        # Anyone who can reach the store knows the job id and bunsan's old key names.
        from datetime import timedelta
        import torch.distributed as dist

        job = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'env')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        intruder = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                                 timedelta(seconds=10))
        for key in (f"bunsan/{job}/abort", "bunsan/env.0/abort", "abort"):
            intruder.set(key, "1:forged by an intruder")
        time.sleep(3.0)  # six polls of the watch
        print(f"rank {rank} survived the intruder", flush=True)
    elif mode == "raise_all":  # the same bug on every rank, at the same step (a port of nanoGPT's train.py met it)
        raise RuntimeError("the same bug on every rank")
    elif rank == target and mode == "raise":
        time.sleep(0.2)
        raise RuntimeError(f"boom on rank {rank}")
    elif rank == target and mode == "kill9":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    all_reduce(torch.ones(1))  # the survivors wait here for the failed rank
    if mode in ("raise", "kill9"):
        time.sleep(60)
    bunsan.finalize()
    """
)


@dataclass
class Outcome:
    code: int
    output: str
    elapsed_s: float
    left: list[str] = field(default_factory=list)  # "pid cmdline" of the job's processes still alive
    listeners: list[str] = field(default_factory=list)

    @property
    def launcher_line(self) -> str:
        lines = [line for line in self.output.splitlines() if line.startswith("bunsan run: ")]
        return lines[-1] if lines else ""


def _env(tag: str, **extra: str) -> dict[str, str]:
    env = without_bunsan_settings("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GLOO_", "TORCHELASTIC")
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", EDGE_TAG=tag, **extra)
    return env


def tagged(tag: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries ``EDGE_TAG=<tag>``."""
    marker = f"EDGE_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if marker not in Path("/proc", entry, "environ").read_bytes().split(b"\0"):
                continue
            if Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def _describe(pid: int) -> str:
    try:
        return f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return str(pid)


def left_behind(tag: str, wait_s: float) -> list[str]:
    """The tagged processes still alive after waiting up to ``wait_s`` for them to go."""
    deadline = time.monotonic() + wait_s
    while (pids := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [_describe(pid) for pid in pids]


def kill_tagged(tag: str) -> None:
    for pid in tagged(tag):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    return inodes


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # /proc/net/tcp6: four 32-bit words, each in host (little-endian) order.
    return str(ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))))


def listening_addresses(pids: list[int]) -> list[str]:
    """``address:port`` of every TCP socket in LISTEN state held by ``pids`` (like ``ss -ltnp``)."""
    inodes = set().union(*(_socket_inodes(pid) for pid in pids)) if pids else set()
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                    address, port = fields[1].split(":")
                    found.append(f"{_address(address)}:{int(port, 16)}")
    return sorted(found)


def _script(directory: Path) -> Path:
    path = directory / "edge_job.py"
    path.write_text(SCRIPT)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _finish(process: subprocess.Popen[str], tag: str, started: float, timeout_s: float) -> Outcome:
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    elapsed = time.monotonic() - started
    left = left_behind(tag, wait_s=8.0)  # the janitors take a grace period to end what they find
    kill_tagged(tag)
    return Outcome(process.returncode, out + err, elapsed, left)


def bunsan_run(directory: Path, mode: str, target: int, timeout_s: float = 90.0) -> Outcome:
    """``bunsan run -np 2`` of the script; ``mode`` is ``raise``, ``kill9`` or ``listen``."""
    tag = uuid.uuid4().hex
    script = _script(directory)
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "bunsan", "run", "-np", "2", str(script), mode, str(target), str(directory)],
        cwd=directory,
        env=_env(tag),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    listeners: list[str] = []
    if mode == "listen":
        deadline = time.monotonic() + timeout_s
        while not all((directory / f"ready.{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            if process.poll() is not None:
                break
            time.sleep(0.1)
        listeners = listening_addresses(tagged(tag))
        (directory / "go").write_text("")
    outcome = _finish(process, tag, started, timeout_s)
    outcome.listeners = listeners
    return outcome


def torchrun(directory: Path, mode: str, target: int, timeout_s: float = 90.0) -> Outcome:
    """The script under ``torchrun --nproc-per-node 2`` (its agent hosts the store)."""
    tag = uuid.uuid4().hex
    script = _script(directory)
    started = time.monotonic()
    process = subprocess.Popen(
        [
            *TORCHRUN,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            str(script),
            mode,
            str(target),
            str(directory),
        ],
        cwd=directory,
        env=_env(tag),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return _finish(process, tag, started, timeout_s)


def by_hand(directory: Path, mode: str, target: int, timeout_s: float = 90.0) -> list[Outcome]:
    """Two ranks started directly, as a launcher that never kills anyone would (one Outcome per rank)."""
    tag = uuid.uuid4().hex
    script = _script(directory)
    port = str(_free_port())
    started = time.monotonic()
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), mode, str(target), str(directory)],
            cwd=directory,
            env=_env(
                tag,
                RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        outputs.append(out + err)
    elapsed = time.monotonic() - started
    left = left_behind(tag, wait_s=8.0)
    kill_tagged(tag)
    return [Outcome(p.returncode, o, elapsed, left) for p, o in zip(processes, outputs, strict=True)]


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(
        prog="python -m tests.launch.edges", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scenario", choices=["raise0", "raise1", "torchrun-kill9", "plain-kill9", "listeners"])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    good = 0
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            if args.scenario in ("raise0", "raise1"):
                target = int(args.scenario[-1])
                o = bunsan_run(directory, "raise", target)
                ok = o.code == 1 and o.launcher_line.startswith(f"bunsan run: rank {target} ") and not o.left
                detail = f"exit {o.code}, {o.elapsed_s:.1f} s, {o.launcher_line!r}, left {len(o.left)}"
            elif args.scenario == "torchrun-kill9":
                o = torchrun(directory, "kill9", 1)
                named = "because rank 1 died without a word" in o.output
                ok = o.code != 0 and named and not o.left
                detail = f"exit {o.code}, {o.elapsed_s:.1f} s, rank 1 named: {named}, left {len(o.left)} {o.left}"
            elif args.scenario == "plain-kill9":
                outcomes = by_hand(directory, "kill9", 1)
                named = "because rank 1 died without a word" in outcomes[0].output
                ok = outcomes[1].code == -9 and outcomes[0].code == 1 and named and not outcomes[0].left
                detail = f"codes {[x.code for x in outcomes]}, rank 1 named: {named}, left {len(outcomes[0].left)}"
            else:
                o = bunsan_run(directory, "listen", -1)
                hosts = {address.rsplit(":", 1)[0] for address in o.listeners}
                ok = o.code == 0 and bool(o.listeners) and hosts <= {"127.0.0.1", "::1"}
                detail = f"exit {o.code}, listeners {o.listeners}"
        good += ok
        print(f"run {run + 1}: {'ok' if ok else 'FAILED'}: {detail}", flush=True)
    print(f"{args.scenario}: {good} of {args.runs} runs as required", flush=True)
    return 0 if good == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
