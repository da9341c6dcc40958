"""Find and end what is left of a job, on every host: ``bunsan run --cleanup``.

``bunsan run`` leaves nothing behind when it can (see :mod:`bunsan.launch.local`
and :mod:`bunsan.launch.ssh`). When it cannot (the launcher's machine lost
power, a host was unreachable while the job stopped), ``bunsan run --cleanup``
finishes the job: on each host it ends exactly the processes whose
environment carries ``BUNSAN_JOB_ID=<id>``, read from ``/proc/<pid>/environ``,
never anything found by name (the advice "``pkill -9 python`` on every node"
kills other people's jobs too).

Which jobs: ``--job-id ID``, or every job this machine launched that is not
running any more. The launcher writes a small record per job to
``$XDG_CACHE_HOME/bunsan/jobs/<id>.json`` (default ``~/.cache/bunsan/jobs``)
and removes it once the job ended cleanly on every host; a record whose
launcher is gone is what ``--cleanup`` without ``--job-id`` acts on.

Records do not pile up: one whose launcher is gone expires
:data:`RECORD_TTL_S` (7 days) after the launch and is deleted the next time
records are listed (every ``bunsan run`` over ssh and every ``--cleanup``).
``--cleanup`` removes the hosts it reached from a record, names the ones it
could not reach, and keeps the record for those alone, so that a later
``--cleanup`` tries only them.

``python -m bunsan.launch.cleanup --job-id ID`` is what runs on each host
(over ssh): it ends the job's processes there and prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from bunsan.launch import proctree
from bunsan.launch.quoting import quoted
from bunsan.launch.ssh_plan import SshOptions, remote_command, ssh_command

__all__ = [
    "RECORD_TTL_S",
    "JobRecord",
    "check_job_id",
    "cleanup_hosts",
    "jobs_dir",
    "list_job_records",
    "main",
    "remove_job_record",
    "write_job_record",
]

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
CLEANUP_TIMEOUT_S = 30.0
RECORD_TTL_S = 7 * 24 * 3600.0  # a record of a stopped launcher is deleted this long after the launch


def check_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is a valid job id, else raise ``ValueError`` naming the rule."""
    if not _JOB_ID_RE.match(job_id):
        raise ValueError(
            f"job id {quoted(job_id)} is not valid; use 1 to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return job_id


@dataclass(frozen=True)
class JobRecord:
    """What ``--cleanup`` needs to find a job's processes again.

    Attributes:
        job_id: The job's ``BUNSAN_JOB_ID``.
        hosts: The hosts that ran workers, as written by the user.
        local_hosts: Those of ``hosts`` that are the launcher's machine.
        ssh: :class:`SshOptions` as a dict.
        remote_python: The interpreter on the remote hosts.
        launcher_pid: The launcher's pid on this machine.
        launcher_start: The launcher's start time (``/proc/<pid>/stat`` field 22),
            so a reused pid is not taken for the launcher.
        started: Wall-clock time of the launch.
        command: The worker command, for the listing.
    """

    job_id: str
    hosts: list[str]
    local_hosts: list[str]
    ssh: dict[str, Any]
    remote_python: str
    launcher_pid: int
    launcher_start: str = ""
    started: float = field(default_factory=time.time)
    command: list[str] = field(default_factory=list)

    def launcher_running(self, proc: str = "/proc") -> bool:
        return _process_start(self.launcher_pid, proc) == self.launcher_start != ""

    def expired(self, now: float, proc: str = "/proc") -> bool:
        """Older than :data:`RECORD_TTL_S` and its launcher is gone."""
        return now - self.started > RECORD_TTL_S and not self.launcher_running(proc)


def _process_start(pid: int, proc: str = "/proc") -> str:
    try:
        stat = Path(proc, str(pid), "stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def jobs_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the launcher keeps its job records: ``$XDG_CACHE_HOME/bunsan/jobs`` or ``~/.cache/bunsan/jobs``."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(base, "bunsan", "jobs")


def write_job_record(record: JobRecord, environ: Mapping[str, str] | None = None) -> Path | None:
    """Write ``record`` (atomically), deleting expired ones; None if the directory cannot be written."""
    list_job_records(environ)  # prunes the expired records
    directory = jobs_dir(environ)
    path = directory / f"{record.job_id}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def remove_job_record(job_id: str, environ: Mapping[str, str] | None = None) -> None:
    with contextlib.suppress(OSError):
        (jobs_dir(environ) / f"{job_id}.json").unlink()


def list_job_records(environ: Mapping[str, str] | None = None, now: float | None = None) -> list[JobRecord]:
    """The job records on this machine, oldest first.

    Expired records (:meth:`JobRecord.expired`) are deleted, and so are
    unreadable files last written more than :data:`RECORD_TTL_S` ago; younger
    unreadable files are skipped (another launcher may be writing them).
    """
    now = time.time() if now is None else now
    records = []
    directory = jobs_dir(environ)
    if not directory.is_dir():
        return []
    for path in directory.glob("*.json"):
        try:
            record = JobRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > RECORD_TTL_S:
                    path.unlink()
            continue
        if record.expired(now):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        records.append(record)
    return sorted(records, key=lambda r: r.started)


def launcher_record(
    job_id: str,
    hosts: Sequence[str],
    local_hosts: Sequence[str],
    ssh: SshOptions,
    remote_python: str,
    command: Sequence[str],
) -> JobRecord:
    """The record for a job launched by this process."""
    return JobRecord(
        job_id,
        list(hosts),
        list(local_hosts),
        ssh.to_dict(),
        remote_python,
        os.getpid(),
        _process_start(os.getpid()),
        time.time(),
        list(command),
    )


# ---------------------------------------------------------------------------
# Ending a job's processes.


@dataclass(frozen=True)
class HostCleanup:
    """What ``--cleanup`` did on one host: the pids it ended, or why it could not."""

    host: str
    pids: tuple[int, ...] = ()
    error: str | None = None


def _cleanup_here(job_id: str, grace_s: float) -> list[int]:
    return proctree.sweep_job(job_id, grace_s)


def cleanup_hosts(
    hosts: Sequence[str],
    job_id: str,
    *,
    is_local: Any,
    ssh: SshOptions,
    remote_python: str,
    grace_s: float = proctree.GRACE_S,
) -> list[HostCleanup]:
    """End every process of job ``job_id`` on ``hosts``, in parallel; one result per host, in order."""
    check_job_id(job_id)
    results: dict[str, HostCleanup] = {}
    running: dict[str, subprocess.Popen[str]] = {}
    module_args = ["--job-id", job_id, "--grace", str(grace_s)]
    for host in hosts:
        if is_local(host):
            continue
        command = remote_command(remote_python, "bunsan.launch.cleanup", module_args)
        try:
            running[host] = subprocess.Popen(
                ssh_command(host, command, ssh),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        except OSError as err:
            results[host] = HostCleanup(host, error=f"cannot run {ssh.executable!r}: {err}")
    local_hosts = [h for h in hosts if is_local(h)]
    if local_hosts:
        pids = tuple(_cleanup_here(job_id, grace_s))
        for i, host in enumerate(local_hosts):
            results[host] = HostCleanup(host, pids if i == 0 else ())
    for host, process in running.items():
        try:
            out, errors = process.communicate(timeout=CLEANUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            results[host] = HostCleanup(host, error=f"no answer within {CLEANUP_TIMEOUT_S:.0f} s")
            continue
        try:
            answer = json.loads(out.strip().splitlines()[-1])
            results[host] = HostCleanup(host, tuple(answer["pids"]))
        except (ValueError, IndexError, KeyError):
            reason = (errors.strip().splitlines() or [f"exit code {process.returncode}"])[-1]
            results[host] = HostCleanup(host, error=reason)
    return [results[h] for h in hosts]


def format_cleanup(job_id: str, results: Sequence[HostCleanup]) -> str:
    """One line per host: what was ended, or the error."""
    width = max(len(r.host) for r in results)
    lines = []
    for r in results:
        if r.error is not None:
            what = f"FAILED: {r.error}"
        elif r.pids:
            what = f"ended {len(r.pids)} process(es): {' '.join(map(str, r.pids))}"
        else:
            what = "nothing left"
        lines.append(f"job {job_id}  {r.host.ljust(width)}  {what}")
    return "\n".join(lines)


def run_cleanup(
    job_id: str | None,
    hosts: Sequence[str] | None,
    *,
    is_local: Any,
    ssh: SshOptions | None,
    remote_python: str | None,
    stdout: IO[str],
    stderr: IO[str],
    environ: Mapping[str, str] | None = None,
) -> int:
    """``bunsan run --cleanup``: end what is left of one job, or of every job whose launcher is gone.

    Returns:
        0 when every host answered, 1 when a host could not be reached, 2 for bad input.
    """
    records = {r.job_id: r for r in list_job_records(environ)}
    if job_id is not None:
        try:
            check_job_id(job_id)
        except ValueError as err:
            print(f"bunsan run: error: {err}", file=stderr)
            return 2
        record = records.get(job_id)
        if hosts is None and record is None:
            hosts = ["localhost"]
            print(
                f"bunsan run: no record of job {job_id} here and no -H/--hostfile: cleaning up this machine only",
                file=stderr,
            )
        jobs = [(job_id, record, hosts)]
    else:
        jobs = [(r.job_id, r, hosts) for r in records.values() if not r.launcher_running()]
        if not jobs:
            print(
                f"bunsan run: no job to clean up: no record of a stopped launcher in {jobs_dir(environ)}; "
                "give --job-id ID with -H or --hostfile",
                file=stdout,
            )
            return 0
    status = 0
    for jid, record, job_hosts in jobs:
        names = list(job_hosts) if job_hosts is not None else list(record.hosts) if record else ["localhost"]
        options = ssh or (SshOptions.from_dict(record.ssh) if record else SshOptions())
        python = remote_python or (record.remote_python if record else sys.executable)
        local_names = set(record.local_hosts) if record and job_hosts is None else set()
        results = cleanup_hosts(
            names, jid, is_local=lambda h, here=local_names: h in here or is_local(h), ssh=options, remote_python=python
        )
        print(format_cleanup(jid, results), file=stdout, flush=True)
        unreachable = [r.host for r in results if r.error is not None]
        if not unreachable:
            remove_job_record(jid, environ)
            continue
        status = 1
        kept = ""
        if record is not None:
            # Only the hosts not reached stay in the record: the next --cleanup tries them alone.
            narrowed = replace(
                record,
                hosts=[h for h in record.hosts if h in unreachable] or unreachable,
                local_hosts=[h for h in record.local_hosts if h in unreachable],
            )
            if write_job_record(narrowed, environ) is not None:
                until = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.started + RECORD_TTL_S))
                kept = f"; the record of job {jid} now lists only them and is kept until {until}"
        print(
            f"bunsan run: could not reach {len(unreachable)} host(s) of job {jid}: {', '.join(unreachable)}; "
            f"processes of the job may still run there{kept}: run bunsan run --cleanup --job-id {jid} again "
            "once they are reachable",
            file=stderr,
            flush=True,
        )
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """On one host: end the processes of ``--job-id`` and print ``{"host", "pids"}`` as JSON."""
    parser = argparse.ArgumentParser(prog="python -m bunsan.launch.cleanup")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--grace", type=float, default=proctree.GRACE_S)
    args = parser.parse_args(argv)
    try:
        check_job_id(args.job_id)
    except ValueError as err:
        parser.error(str(err))
    pids = _cleanup_here(args.job_id, min(max(args.grace, 0.0), proctree.GRACE_S))
    print(json.dumps({"host": socket.gethostname(), "pids": pids}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
