"""``bunsan doctor``: check every host of a hostfile before a multi-host job.

On every host, in parallel, over the same ssh as ``bunsan run``
(``python -m bunsan.launch.doctor --probe``):

* ssh reaches it (key authentication, ``BatchMode``: no prompt) and the
  remote Python starts;
* Python, torch and bunsan versions equal those of the first host;
* ``--data PATH`` (a file or a directory) is there, with the same size and
  SHA-256 as on the first host that has it;
* ``--port`` is free (rank 0's rendezvous port, bound on the wildcard address);

then a tiny all-reduce, one worker per host, started through ``bunsan run``
itself, so that rendezvous, the hosts' network and gloo are checked as a job
would use them. The result is one table and a sentence per problem; the exit
status is 0 when everything is right, 1 otherwise, 2 for bad input.

Versions are read from the installed packages' metadata: the probe does not
import torch, so it takes a fraction of a second per host.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bunsan._table import format_table
from bunsan.launch.ssh_plan import SshOptions, remote_command, ssh_command

__all__ = [
    "HostReport",
    "add_arguments",
    "check_hosts",
    "digest_path",
    "format_report",
    "main",
    "probe",
    "problems_of",
    "run",
]

DEFAULT_PORT = 29500  # torch's default MASTER_PORT
PROBE_TIMEOUT_S = 60.0
ALLREDUCE_TIMEOUT_S = 120.0
_CHUNK = 1 << 20

DESCRIPTION = """\
Check every host of a hostfile (or -H list) before a multi-host job: ssh
reachable, Python, torch and bunsan versions equal, --data present with
equal size and checksum, --port free, and a tiny all-reduce across all
hosts through bunsan run (one worker per host). Prints one table; the exit
status is 0 when all is well, 1 when something is wrong."""


# ---------------------------------------------------------------------------
# On each host.


def digest_path(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Size and SHA-256 of a file, or of a directory's files (names and contents, in sorted order).

    Returns:
        ``{"path", "exists", "kind", "size", "sha256"}``; ``kind`` is ``"file"``,
        ``"dir"`` or ``None`` when the path is missing.
    """
    root = Path(path)
    if root.is_file():
        files = [(root.name, root)]
        kind = "file"
    elif root.is_dir():
        files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*") if p.is_file())
        kind = "dir"
    else:
        return {"path": str(path), "exists": False, "kind": None, "size": None, "sha256": None}
    digest = hashlib.sha256()
    size = 0
    for name, file in files:
        if kind == "dir":
            digest.update(name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    return {"path": str(path), "exists": True, "kind": kind, "size": size, "sha256": digest.hexdigest()}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _port_state(port: int) -> dict[str, Any]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as err:
            return {"port": port, "free": False, "error": err.strerror or str(err)}
    return {"port": port, "free": True, "error": None}


def probe(data: str | None, port: int | None) -> dict[str, Any]:
    """What this host has: versions, the data path's digest, the port's state. No torch import."""
    return {
        "hostname": socket.gethostname(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "torch": _version("torch"),
        "bunsan": _version("bunsan"),
        "data": digest_path(data) if data else None,
        "port": _port_state(port) if port else None,
    }


# ---------------------------------------------------------------------------
# On the launcher's machine.


@dataclass
class HostReport:
    """What the doctor learned about one host."""

    host: str
    reachable: bool = False
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    allreduce: str | None = None  # "ok 1.2 ms", "FAILED ...", or None when not run


def check_hosts(
    hosts: Sequence[str],
    *,
    is_local: Callable[[str], bool],
    ssh: SshOptions,
    remote_python: str,
    data: str | None,
    port: int | None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> list[HostReport]:
    """Probe every host in parallel; one report per host, in order."""
    args = ["--probe"] + (["--data", data] if data else []) + (["--port", str(port)] if port else [])
    running: list[tuple[HostReport, subprocess.Popen[str] | None]] = []
    for host in hosts:
        report = HostReport(host)
        if is_local(host):
            argv = [sys.executable, "-m", "bunsan.launch.doctor", *args]
        else:
            argv = ssh_command(host, remote_command(remote_python, "bunsan.launch.doctor", args), ssh)
        try:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        except OSError as err:
            report.error = f"cannot run {argv[0]!r}: {err}"
            process = None
        running.append((report, process))
    deadline = time.monotonic() + timeout_s
    for report, process in running:
        if process is None:
            continue
        try:
            out, errors = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            report.error = f"no answer within {timeout_s:.0f} s"
            continue
        lines = out.strip().splitlines()
        try:
            report.info = json.loads(lines[-1])
            report.reachable = True
        except (ValueError, IndexError):
            reason = (errors.strip().splitlines() or [f"exit code {process.returncode}"])[-1]
            if process.returncode == 255:
                report.error = f"ssh failed: {reason}"
            elif process.returncode in (126, 127):
                report.error = f"cannot start {remote_python} there: {reason}"
            else:
                report.error = reason
    return [report for report, _ in running]


def _first(reports: Sequence[HostReport], key: Callable[[HostReport], Any]) -> Any:
    return next((key(r) for r in reports if r.reachable and key(r) is not None), None)


def _reference(reports: Sequence[HostReport], item: str) -> Any:
    """The value of ``item`` (python, torch, bunsan) on the first reachable host that has it."""
    return _first(reports, lambda r: r.info.get(item))


def problems_of(reports: Sequence[HostReport]) -> list[str]:
    """One sentence per problem, comparing every host with the first one that has the item. Pure."""
    problems: list[str] = []
    for r in reports:
        if not r.reachable:
            problems.append(f"{r.host}: {r.error}")
    for item in ("python", "torch", "bunsan"):
        reference = _reference(reports, item)
        owner = next((r.host for r in reports if r.reachable and r.info.get(item) == reference), None)
        for r in reports:
            if not r.reachable:
                continue
            value = r.info.get(item)
            if value is None:
                problems.append(f"{r.host}: {item} is not installed for {r.info.get('executable')}")
            elif value != reference:
                problems.append(f"{r.host}: {item} {value} differs from {item} {reference} on {owner}")
    data_ref = _first(reports, lambda r: (r.info.get("data") or {}).get("sha256"))
    data_owner = next(
        (r for r in reports if r.reachable and (r.info.get("data") or {}).get("sha256") == data_ref), None
    )
    for r in reports:
        data = r.info.get("data")
        if not r.reachable or data is None:
            continue
        if not data["exists"]:
            problems.append(f"{r.host}: data path {data['path']} is missing")
        elif data_owner is not None and data["sha256"] != data_ref:
            problems.append(
                f"{r.host}: data path {data['path']} differs from {data_owner.host}'s "
                f"({data['size']} vs {data_owner.info['data']['size']} bytes, different SHA-256)"
            )
    for r in reports:
        port = r.info.get("port") if r.reachable else None
        if port is not None and not port["free"]:
            problems.append(f"{r.host}: port {port['port']} is not free ({port['error']}); choose another --port")
    for r in reports:
        if r.allreduce is not None and r.allreduce.startswith("FAILED"):
            problems.append(f"{r.host}: all-reduce {r.allreduce}")
    return problems


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def format_report(reports: Sequence[HostReport], data: str | None, port: int | None) -> str:
    """The doctor's table: a row per host. A cell is marked ``!`` where the host differs or fails."""
    columns = ["host", "ssh", "python", "torch", "bunsan"]
    if data:
        columns.append("data")
    if port:
        columns.append(f"port {port}")
    columns.append("all-reduce")
    refs = {item: _reference(reports, item) for item in ("python", "torch", "bunsan")}
    data_ref = _first(reports, lambda r: (r.info.get("data") or {}).get("sha256"))
    rows = []
    for r in reports:
        row = [r.host, "ok" if r.reachable else "FAILED!"]
        for item in ("python", "torch", "bunsan"):
            value = r.info.get(item) if r.reachable else None
            row.append(
                "-"
                if not r.reachable
                else "missing!"
                if value is None
                else f"{value}!"
                if value != refs[item]
                else value
            )
        if data:
            d = r.info.get("data") if r.reachable else None
            if d is None:
                row.append("-")
            elif not d["exists"]:
                row.append("MISSING!")
            else:
                mark = "" if d["sha256"] == data_ref else " DIFFERS!"
                row.append(f"{_size(d['size'])} sha256 {d['sha256'][:12]}{mark}")
        if port:
            p = r.info.get("port") if r.reachable else None
            row.append("-" if p is None else "free" if p["free"] else "IN USE!")
        row.append(r.allreduce if r.allreduce is not None else "not run")
        rows.append(row)
    return format_table(columns, [[str(cell) for cell in row] for row in rows], rule=False)


def _run_allreduce(
    hosts: Sequence[str], ssh_args: Sequence[str], reports: Sequence[HostReport], timeout_s: float
) -> None:
    """One worker per host through ``bunsan run``; fills ``report.allreduce``."""
    spec = ",".join(f"{h}:1" for h in hosts)
    argv = [
        sys.executable,
        "-m",
        "bunsan",
        "run",
        "-H",
        spec,
        "--tag-output",
        *ssh_args,
        "--",
        "python",
        "-m",
        "bunsan.bench.probe",
    ]  # the training side stays out of launch/
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUNSAN_") or k == "BUNSAN_TIMEOUT"}
    try:
        result = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        for r in reports:
            r.allreduce = f"FAILED: no result within {timeout_s:.0f} s"
        return
    results: dict[int, dict[str, Any]] = {}
    for line in result.stdout.splitlines():
        _tag, _, payload = line.partition(" ")
        with contextlib.suppress(ValueError):
            answer = json.loads(payload)
            results[int(answer["rank"])] = answer
    reason = next(
        (line for line in reversed(result.stderr.splitlines()) if line.startswith("bunsan run:")),
        (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1],
    )
    for rank, r in enumerate(reports):
        answer = results.get(rank)
        if answer is not None and answer["sum"] == answer["expected"] and result.returncode == 0:
            r.allreduce = f"ok {answer['ms']:.1f} ms"
        elif answer is not None:
            r.allreduce = f"FAILED: sum {answer['sum']} != {answer['expected']}"
        else:
            r.allreduce = f"FAILED (exit code {result.returncode}): {reason}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bunsan doctor``."""
    from bunsan.launch.options import add_ssh_arguments, whole_number

    parser.add_argument("-H", "--hosts", metavar="HOST[:SLOTS],...", help="hosts to check, e.g. node1,node2")
    parser.add_argument("--hostfile", metavar="PATH", help="file of 'HOST slots=N' lines to check")
    parser.add_argument("--data", metavar="PATH", help="a file or directory that must be equal on every host")
    parser.add_argument(
        "--port",
        type=whole_number,
        default=DEFAULT_PORT,
        metavar="PORT",
        help=f"rendezvous port that must be free on every host (default {DEFAULT_PORT}; 0 skips)",
    )
    parser.add_argument("--skip-allreduce", action="store_true", help="do not run the all-reduce job")
    add_ssh_arguments(parser)


def run(args: argparse.Namespace, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """``bunsan doctor``: probe the hosts, run the all-reduce, print the table. Returns the exit status."""
    from bunsan.launch import hosts as hostlib
    from bunsan.launch.config import UsageError, remote_settings

    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    try:
        if (args.hosts is None) == (args.hostfile is None):
            raise UsageError(
                "give the hosts to check with --hostfile PATH or -H node1,node2 (one of them)", prog="bunsan doctor"
            )
        hosts = hostlib.read_hostfile(args.hostfile) if args.hostfile else hostlib.parse_hosts(args.hosts)
        if args.port is not None and not 0 <= args.port <= 65535:
            raise UsageError(f"--port must be in 0..65535, got {args.port}", prog="bunsan doctor")
        remote = remote_settings(args)
    except ValueError as err:
        print(f"bunsan doctor: error: {err}", file=stderr)
        return 2
    names = [h.name for h in hosts]
    hostname = socket.gethostname()
    ssh = SshOptions(remote.ssh_port, remote.ssh_identity, remote.ssh_host_key_checking, remote.ssh_options)
    python = remote.remote_python or sys.executable
    data = os.path.abspath(args.data) if args.data else None
    port = args.port or None
    reports = check_hosts(
        names,
        is_local=lambda h: hostlib.is_local_host(h, hostname),
        ssh=ssh,
        remote_python=python,
        data=data,
        port=port,
    )
    if not args.skip_allreduce:
        if all(r.reachable for r in reports):
            # The worker needs no files: "/" exists on every host, the launcher's directory may not.
            ssh_args = ["--remote-cwd", remote.remote_cwd or "/"]
            for flag, value in (
                ("--ssh-port", remote.ssh_port),
                ("--ssh-identity", remote.ssh_identity),
                ("--ssh-host-key-checking", remote.ssh_host_key_checking),
                ("--remote-python", remote.remote_python),
            ):
                if value is not None:
                    ssh_args += [flag, str(value)]
            for option in remote.ssh_options:
                ssh_args += ["--ssh-option", option]
            _run_allreduce(names, ssh_args, reports, ALLREDUCE_TIMEOUT_S)
        else:
            for r in reports:
                r.allreduce = "not run (a host is unreachable)"
    print(format_report(reports, data, port), file=stdout)
    problems = problems_of(reports)
    if problems:
        print(f"\n{len(problems)} problem(s):", file=stdout)
        for problem in problems:
            print(f"  {problem}", file=stdout)
    else:
        print(f"\nall {len(reports)} host(s) ok", file=stdout)
    stdout.flush()
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bunsan.launch.doctor --probe``: this host's report as JSON (run on each host)."""
    parser = argparse.ArgumentParser(prog="python -m bunsan.launch.doctor")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--data")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.data, args.port)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
