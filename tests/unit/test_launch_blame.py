"""Issue 15, items 5, 6 and 9 in one process: who is blamed, what is bound, which processes are ended."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from bunsan.comm import group, rendezvous
from bunsan.launch import plan, treewatch
from bunsan.launch.blame import FailureReport, attribute_failure

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and pidfds: Linux only")


def _report(rank, event, peer=None, t=0.0, what="", code=1):
    return FailureReport(rank, event, peer, code, what, t)


# --------------------------------------------------------------------------- item 9: the launcher's blame


def test_the_rank_that_raised_is_blamed_not_the_first_to_exit():
    reports = [_report(0, "raised", t=1.0, what="RuntimeError: boom"), _report(1, "stopped", peer=0, t=1.5)]
    # Rank 1 exited first; rank 0 still lingers in its exception hook: wait for it.
    ask = attribute_failure(1, {0: None, 1: 1}, reports)
    assert (ask.rank, ask.wait_for) == (0, 0)
    done = attribute_failure(1, {0: 1, 1: 1}, reports)
    assert (done.rank, done.code, done.origin) == (0, 1, True)
    assert done.cause == "rank 0 exited with code 1 (it failed first: RuntimeError: boom)"
    # Still running after the wait (the launcher stops it now): the code it reported.
    late = attribute_failure(1, {0: None, 1: 1}, reports, final=True)
    assert (late.rank, late.code) == (0, 1) and late.cause.startswith("rank 0 failed first (RuntimeError: boom)")


def test_the_earliest_of_two_raised_reports_wins():
    reports = [_report(2, "raised", t=2.0, what="B"), _report(1, "raised", t=1.0, what="A")]
    assert attribute_failure(2, {0: None, 1: 3, 2: 1}, reports).rank == 1
    assert attribute_failure(2, {0: None, 1: 3, 2: 1}, reports).code == 3  # its real exit code


def test_every_rank_that_raised_is_named_the_earliest_first():
    same = [_report(1, "raised", t=1.0, what="E: x"), _report(0, "raised", t=1.1, what="E: x")]
    assert attribute_failure(0, {0: 1, 1: 1}, same).cause == (
        "rank 1 exited with code 1 (it failed first: E: x); rank 0 raised too (the same error)"
    )
    other = [*same, _report(2, "raised", t=1.2, what="F: y"), _report(3, "stopped", peer=1, t=1.3)]
    cause = attribute_failure(3, {0: 1, 1: 1, 2: 1, 3: 1}, other).cause
    assert cause.endswith("; ranks 0, 2 raised too (E: x; F: y)"), cause


def test_a_silent_death_is_blamed_even_when_a_survivor_raised():
    reports = [_report(0, "raised", t=1.0, what="CommunicationError: connection closed")]
    blame = attribute_failure(0, {0: 1, 1: -9}, reports)
    assert (blame.rank, blame.code) == (1, 137)
    assert blame.cause == "rank 1 was killed by SIGKILL (exit code 137)"


def test_a_worker_that_stopped_because_of_a_peer_names_the_peer():
    reports = [_report(0, "stopped", peer=1, what="rank 1 failed")]
    assert attribute_failure(0, {0: 1, 1: None}, reports).wait_for == 1
    blame = attribute_failure(0, {0: 1, 1: 4}, reports)
    assert (blame.rank, blame.code) == (1, 4) and blame.cause.startswith("rank 1 exited with code 4 first")
    elsewhere = attribute_failure(0, {0: 1}, [_report(0, "stopped", peer=5)])  # rank 5 runs on another host
    assert (elsewhere.rank, elsewhere.origin) == (5, False)
    assert elsewhere.cause == "rank 0 stopped because rank 5 on another host failed"


def test_without_reports_the_first_to_exit_is_blamed_as_before():
    blame = attribute_failure(1, {0: None, 1: 3}, [])
    assert (blame.rank, blame.code, blame.cause) == (1, 3, "rank 1 exited with code 3")


def test_report_lines_parse_and_junk_is_ignored():
    line = json.dumps({"rank": 1, "event": "stopped", "peer": 0, "code": 1, "what": "x" * 1000, "time": 5.0})
    report = FailureReport.from_line(line.encode())
    assert report == FailureReport(1, "stopped", 0, 1, "x" * 300, 5.0)
    for junk in (b"", b"{", b"[]", b'{"event": "raised"}', b"\xff\xfe"):
        assert FailureReport.from_line(junk) is None
    assert plan.REPORT_FD_VARIABLE == group.REPORT_FD_VARIABLE


# --------------------------------------------------------------------------- item 5: what the store binds


def test_the_store_binds_the_master_address_itself():
    assert group.bind_address("127.0.0.1") == (socket.AF_INET, "127.0.0.1")
    assert group.bind_address("localhost")[1] in ("127.0.0.1", "::1")
    assert rendezvous._is_loopback("127.0.0.1") and not rendezvous._is_loopback("192.0.2.1")
    fd = rendezvous._listening_socket("127.0.0.1", 0)
    with socket.socket(fileno=fd) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"


def test_an_address_of_another_host_falls_back_to_every_interface_with_a_warning(capsys):
    fd = rendezvous._listening_socket("192.0.2.123", 0)  # TEST-NET-1: never an address of this machine
    with socket.socket(fileno=fd) as sock:
        assert sock.getsockname()[0] == "0.0.0.0"
    assert "is not an address of this host" in capsys.readouterr().err


# --------------------------------------------------------------------------- item 6: the process trees


@linux_only
def test_descendants_and_marks_and_ending_them(tmp_path):
    tag = f"t{os.getpid()}.{time.time_ns()}"
    child = subprocess.Popen(["sleep", "1000"], env={**os.environ, treewatch.TREE_VARIABLE: tag})
    detached = subprocess.Popen(
        ["sleep", "1000"], start_new_session=True, env={**os.environ, treewatch.TREE_VARIABLE: tag}
    )
    unmarked = subprocess.Popen(["sleep", "1000"])
    try:
        assert {child.pid, detached.pid, unmarked.pid} <= set(treewatch.descendants(os.getpid()))
        assert set(treewatch.marked(tag)) == {child.pid, detached.pid}
        start = treewatch.start_time(child.pid)
        assert treewatch.is_alive(child.pid, start) and not treewatch.is_alive(child.pid, str(int(start) + 1))
        survivors = treewatch.end_processes(treewatch.marked(tag), grace_s=1.0)
        assert survivors == []
        assert child.wait(5) == -signal.SIGTERM and detached.wait(5) == -signal.SIGTERM
        assert unmarked.poll() is None  # not marked, not in the list: untouched
    finally:
        for p in (child, detached, unmarked):
            p.kill()
            p.wait()


@linux_only
@pytest.mark.timeout(60)
def test_the_janitor_ends_a_sigkilled_workers_children_and_its_forks_die_with_it(tmp_path):
    """A stand-in worker (no torch): marks itself, starts the janitor, forks, starts children, dies by SIGKILL."""
    out = tmp_path / "pids"
    worker = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys, time
        from bunsan.launch import treewatch
        os.environ[treewatch.TREE_VARIABLE] = "w{os.getpid()}"
        treewatch.kill_forks_with_parent()
        janitor = treewatch.start_janitor(os.getpid(), "w{os.getpid()}", grace_s=0.5)
        pid = os.fork()
        if pid == 0:
            time.sleep(1000)
            os._exit(0)
        kids = [subprocess.Popen(["sleep", "1000"]), subprocess.Popen(["sleep", "1000"], start_new_session=True),
                subprocess.Popen(["sleep", "1000"], start_new_session=True, env={{"PATH": os.environ["PATH"]}})]
        time.sleep(2.5)  # the janitor notes the unmarked one by its parent pid
        open({str(out)!r}, "w").write(" ".join(map(str, [janitor.pid, pid] + [k.pid for k in kids])))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_repo()), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", worker], env=env, timeout=30)
    assert proc.returncode == -signal.SIGKILL
    janitor, *pids = map(int, out.read_text().split())
    deadline = time.monotonic() + 10
    while any(map(treewatch.is_alive, [janitor, *pids])) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in [janitor, *pids] if treewatch.is_alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


def _repo():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- a peer's note of a silent death


@pytest.mark.parametrize(
    ("reason", "said"),
    [
        (
            f"{group.SILENT_DEATH} (process 123 on h is gone: killed by a signal or out of memory?)",
            "rank 1 died without",
        ),
        ("RuntimeError: boom", "rank 1 failed (RuntimeError: boom)"),
    ],
    ids=["silent-death", "raised"],
)
def test_the_launchers_sigterm_names_the_peer_as_its_note_says(monkeypatch, capsys, reason, said):
    # torchrun SIGTERMs the survivors of a SIGKILLed rank; the survivor's watch may have written the
    # silent death's note a moment before: the line still says the rank died, not that it failed
    from types import SimpleNamespace

    from bunsan import runtime

    monkeypatch.setattr(runtime._state, "info", SimpleNamespace(rank=0, world_size=2))
    monkeypatch.setattr(group, "abort_reason", lambda: (1, reason))
    monkeypatch.setattr(group, "mark_finished", lambda: None)
    monkeypatch.setattr(group, "end_children", lambda: None)
    kills: list[int] = []
    monkeypatch.setattr(runtime.os, "kill", lambda pid, sig: kills.append(sig))
    monkeypatch.setattr(runtime.signal, "signal", lambda *args: None)
    runtime._on_sigterm(signal.SIGTERM, None)
    err = capsys.readouterr().err
    assert f"[bunsan] rank 0 of 2: stopped by the launcher (SIGTERM) because {said}" in err, err
    assert kills == [signal.SIGTERM]  # then dies of SIGTERM, as without the hook


def test_a_peer_failure_reads_as_a_silent_death_or_a_failure_with_its_traceback():
    assert group.peer_failure(f"{group.SILENT_DEATH} (process 9 is gone)") == "died without a word (process 9 is gone)"
    assert group.peer_failure("ValueError: x") == "failed (ValueError: x); see its traceback above"
    assert group.peer_failure("ValueError: x", traceback=False) == "failed (ValueError: x)"
