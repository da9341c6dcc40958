"""Which rank to blame when a job fails: the workers' last words and a pure rule over them.

"First" is the rank whose failure ended the job, not the first process to exit: a
rank whose exception ends the job may take a second to exit while the others, told
to stop, are already gone. Every worker gets the write end of a pipe
(``BUNSAN_REPORT_FD``); ``bunsan.init()`` writes one line there before its rank exits
on purpose: "I raised", or "I stop because rank k failed or died"
(:class:`FailureReport`); :func:`attribute_failure` decides.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from bunsan.launch.plan import exit_code_of

__all__ = ["Attribution", "FailureReport", "attribute_failure", "describe_exit"]


@dataclass(frozen=True)
class FailureReport:
    """What a worker told the launcher just before it exited on purpose.

    Attributes:
        rank: The worker's rank.
        event: ``"raised"``: it failed on its own (an uncaught exception);
            ``"stopped"``: it stops because rank ``peer`` failed or died.
        peer: For ``"stopped"``, the rank it blames (None when unknown).
        code: The exit code it is about to exit with.
        what: One line: the exception, or why it stops.
        time: Wall-clock time of the report.
    """

    rank: int
    event: str
    peer: int | None = None
    code: int = 1
    what: str = ""
    time: float = 0.0

    def to_line(self) -> bytes:
        """The report as the worker writes it: one JSON line (``bunsan.comm.group.report``)."""
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> FailureReport | None:
        """Parse one line of the report pipe; None for anything malformed."""
        try:
            data = json.loads(line)
            peer = data.get("peer")
            return cls(
                int(data["rank"]),
                str(data["event"]),
                None if peer is None else int(peer),
                int(data.get("code", 1)),
                str(data.get("what", ""))[:300],
                float(data.get("time", 0.0)),
            )
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


@dataclass(frozen=True)
class Attribution:
    """Which rank to blame for a failed job, with the code and the sentence (see :func:`attribute_failure`).

    Attributes:
        rank: The rank to name.
        code: The exit status for the launcher.
        cause: One sentence for the log.
        origin: False when the failure came from a rank that is not ours (another host).
        wait_for: A rank of ours, still running, whose exit would make the
            answer exact: the caller may wait for it a little and ask again.
    """

    rank: int
    code: int
    cause: str
    origin: bool = True
    wait_for: int | None = None


def attribute_failure(
    first: int, returncodes: Mapping[int, int | None], reports: Sequence[FailureReport], final: bool = False
) -> Attribution:
    """Name the rank whose failure ended the job. Pure.

    Args:
        first: The rank of the first worker seen to fail (non-zero exit).
        returncodes: ``Popen.returncode`` of every worker here, by rank (None: running).
        reports: What the workers reported so far.
        final: Do not ask to wait (the caller has waited already).

    Rules, in order: a worker killed by a signal without a word (SIGKILL, the
    OOM killer; bunsan's own exits always report first) names itself; else the
    earliest ``"raised"`` report names the rank (an exception ended the job;
    the others' exits are its consequences); else, if the first to fail said
    it stopped because of rank k, rank k (here, or on another host); else the
    first to fail itself (a crash, ``sys.exit(3)``).
    """
    reported = {r.rank for r in reports}
    silent = [rank for rank, code in returncodes.items() if code is not None and code < 0 and rank not in reported]
    if silent:
        rank = first if first in silent else min(silent)
        code = returncodes[rank]
        assert code is not None
        return Attribution(rank, exit_code_of(code), f"rank {rank} {describe_exit(code)}")
    origins = sorted((r for r in reports if r.event == "raised"), key=lambda r: r.time)
    if origins:
        origin = origins[0]
        code = returncodes.get(origin.rank)
        if code is None and origin.rank in returncodes and not final:
            return Attribution(origin.rank, origin.code, "", wait_for=origin.rank)
        also = _also_raised(origin, origins[1:])
        if code not in (None, 0):
            assert code is not None
            return Attribution(
                origin.rank,
                exit_code_of(code),
                f"rank {origin.rank} {describe_exit(code)} (it failed first: {origin.what}){also}",
            )
        return Attribution(
            origin.rank, origin.code, f"rank {origin.rank} failed first ({origin.what}); exit code {origin.code}{also}"
        )
    first_code = returncodes.get(first)
    first_status = exit_code_of(first_code) if first_code is not None else 1
    blamed = next((r.peer for r in reports if r.rank == first and r.event == "stopped" and r.peer is not None), None)
    if blamed is not None and blamed != first:
        if blamed not in returncodes:
            return Attribution(
                blamed, first_status, f"rank {first} stopped because rank {blamed} on another host failed", origin=False
            )
        code = returncodes[blamed]
        if code is None and not final:
            return Attribution(blamed, first_status, "", wait_for=blamed)
        if code not in (None, 0):
            assert code is not None
            return Attribution(
                blamed,
                exit_code_of(code),
                f"rank {blamed} {describe_exit(code)} first; the others stopped because of it",
            )
    if first_code is None:
        return Attribution(first, first_status, f"rank {first} failed")
    return Attribution(first, first_status, f"rank {first} {describe_exit(first_code)}")


def _also_raised(origin: FailureReport, others: Sequence[FailureReport]) -> str:
    """``"; rank 1 raised too (the same error)"``: the other ranks whose own exception ended them. Pure."""
    ranks = sorted({r.rank for r in others if r.rank != origin.rank})
    if not ranks:
        return ""
    names = "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    whats = {r.what for r in others if r.rank in ranks}
    said = "the same error" if whats == {origin.what} else "; ".join(sorted(whats))
    return f"; {names} raised too ({said})"


def describe_exit(returncode: int) -> str:
    """Say how a process ended, for the log: ``"exited with code 3"``, ``"was killed by SIGKILL (exit code 137)"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {exit_code_of(returncode)})"
    return f"exited with code {returncode}"
