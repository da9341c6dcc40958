"""``bunsan run`` end to end: real launches of small worker scripts (no torch in them).

Each launch costs about a second (the launcher's interpreter plus two
workers), so every test starts at most one job. Leftover processes are
found the way the launcher promises to find them, by ``BUNSAN_JOB_ID`` in
``/proc/<pid>/environ``, but with the test's own scan, not the launcher's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bunsan.cli import main
from tests.helpers.environment import without_bunsan_settings

REPO = Path(__file__).resolve().parents[2]
IS_LINUX = sys.platform.startswith("linux")
needs_proc = pytest.mark.skipif(not IS_LINUX, reason="the launcher's hygiene relies on Linux /proc and prctl")


# ---------------------------------------------------------------------------
# Helpers


def _launcher_env() -> dict[str, str]:
    """The test process's environment, minus what would change the launch."""
    env = without_bunsan_settings()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _launch(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "bunsan", "run", *args],
        cwd=tmp_path,
        env=_launcher_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(*paths: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"workers did not write {[str(p) for p in paths]}"
        time.sleep(0.05)


def _job_processes(job_id: str) -> list[int]:
    """Live processes whose environment carries BUNSAN_JOB_ID=<job_id> (the test's own scan)."""
    marker = f"BUNSAN_JOB_ID={job_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path("/proc", entry, "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for its reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _assert_nothing_left(job_id: str, pids: list[int] = ()) -> None:
    # A SIGKILLed process may need a moment to be torn down by the kernel.
    deadline = time.monotonic() + 2.0
    while (_job_processes(job_id) or any(map(_alive, pids))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _job_processes(job_id) == [], f"processes of job {job_id} are still running"
    assert [pid for pid in pids if _alive(pid)] == []


def _cleanup(launcher: subprocess.Popen[str], job_id: str | None) -> None:
    """After a failed assertion, leave no stray `sleep 1000` on the machine."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.communicate()
    if job_id:
        for pid in _job_processes(job_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# Rank 0 starts three `sleep 1000` grandchildren: one in its process group, one
# in a session of its own, and one orphaned by `sh` in a session of its own
# (reparented away from the worker). Then it reports their pids and sleeps.
_GRANDCHILDREN = """
    import os, subprocess, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    if rank == 0:
        kids = [
            subprocess.Popen(["sleep", "1000"]),
            subprocess.Popen(["sleep", "1000"], start_new_session=True),
        ]
        orphan = subprocess.run(
            "setsid sleep 1000 >/dev/null 2>&1 </dev/null & echo $!",
            shell=True, capture_output=True, text=True, check=True,
        ).stdout
        pids = [os.getpid()] + [k.pid for k in kids] + [int(orphan)]
        (out / "job.tmp").write_text(json.dumps({"job": os.environ["BUNSAN_JOB_ID"], "pids": pids}))
        os.rename(out / "job.tmp", out / "job")
"""


# ---------------------------------------------------------------------------
# Real launches


@needs_proc
@pytest.mark.timeout(60)
def test_failing_rank_stops_whole_tree_and_returns_its_code(tmp_path):
    script = _write(
        tmp_path,
        "fail.py",
        "import json\n"
        + textwrap.dedent(_GRANDCHILDREN)
        + textwrap.dedent(
            """
            if rank == 0:
                time.sleep(1000)
            else:
                while not (out / "job").exists():
                    time.sleep(0.05)
                sys.exit(3)
            """
        ),
    )
    launcher = _launch(tmp_path, "-np", "2", str(script), str(tmp_path))
    job_id = None
    try:
        _wait_for(tmp_path / "job")
        started = time.monotonic()
        record = json.loads((tmp_path / "job").read_text())
        job_id = record["job"]
        _, stderr = launcher.communicate(timeout=20)
        elapsed = time.monotonic() - started
        assert launcher.returncode == 3, stderr
        assert elapsed < 10.0
        assert "rank 1 exited with code 3" in stderr
        _assert_nothing_left(job_id, record["pids"])
    finally:
        _cleanup(launcher, job_id)


@needs_proc
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("sig", "code", "rank1_ignores"),
    [(signal.SIGINT, 130, True), (signal.SIGTERM, 143, False)],
    ids=["sigint-escalates-to-sigkill", "sigterm"],
)
def test_signal_to_launcher_ends_the_job(tmp_path, sig, code, rank1_ignores):
    # With rank1_ignores, rank 1 ignores SIGINT and SIGTERM: only the SIGKILL
    # after the grace period ends it.
    script = _write(
        tmp_path,
        "wait.py",
        "import json, signal\n"
        + textwrap.dedent(_GRANDCHILDREN)
        + textwrap.dedent(
            f"""
            if rank == 1 and {rank1_ignores}:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            (out / f"ready{{rank}}").touch()
            time.sleep(1000)
            """
        ),
    )
    launcher = _launch(tmp_path, "-np", "2", str(script), str(tmp_path))
    job_id = None
    try:
        _wait_for(tmp_path / "job", tmp_path / "ready0", tmp_path / "ready1")
        record = json.loads((tmp_path / "job").read_text())
        job_id = record["job"]
        started = time.monotonic()
        launcher.send_signal(sig)
        _, stderr = launcher.communicate(timeout=20)
        assert launcher.returncode == code, stderr
        assert time.monotonic() - started < 10.0
        _assert_nothing_left(job_id, record["pids"])
    finally:
        _cleanup(launcher, job_id)


@needs_proc
@pytest.mark.timeout(60)
def test_sigkilled_launcher_takes_the_job_with_it(tmp_path):
    # Workers die by PR_SET_PDEATHSIG; the janitor sweeps their descendants.
    script = _write(
        tmp_path,
        "orphaned.py",
        "import json\n"
        + textwrap.dedent(_GRANDCHILDREN)
        + textwrap.dedent(
            """
            (out / f"ready{rank}").touch()
            time.sleep(1000)
            """
        ),
    )
    launcher = _launch(tmp_path, "-np", "2", str(script), str(tmp_path))
    job_id = None
    try:
        _wait_for(tmp_path / "job", tmp_path / "ready0", tmp_path / "ready1")
        record = json.loads((tmp_path / "job").read_text())
        job_id = record["job"]
        launcher.kill()
        launcher.communicate(timeout=20)
        deadline = time.monotonic() + 10.0
        while _job_processes(job_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        _assert_nothing_left(job_id, record["pids"])
    finally:
        _cleanup(launcher, job_id)


@needs_proc
@pytest.mark.timeout(60)
def test_exception_on_rank_0_ends_job_with_traceback(tmp_path):
    script = _write(
        tmp_path,
        "boom.py",
        """
        import os, time
        if os.environ["RANK"] == "0":
            time.sleep(0.2)
            raise RuntimeError("boom on rank 0")
        time.sleep(1000)
        """,
    )
    started = time.monotonic()
    launcher = _launch(tmp_path, "-np", "2", str(script))
    try:
        _, stderr = launcher.communicate(timeout=30)
        assert launcher.returncode == 1
        assert time.monotonic() - started < 15.0  # ~1 s to start, the rest is the stop
        assert "Traceback (most recent call last)" in stderr
        assert "RuntimeError: boom on rank 0" in stderr
        assert "rank 0 exited with code 1" in stderr
    finally:
        _cleanup(launcher, None)


@pytest.mark.timeout(60)
def test_workers_get_torchrun_environment_and_tagged_output(tmp_path):
    script = _write(
        tmp_path,
        "env.py",
        """
        import json, os, sys
        names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "BUNSAN_JOB_ID", "BUNSAN_LAUNCHER", "OMP_NUM_THREADS"]
        print(json.dumps({name: os.environ.get(name) for name in names}))
        print("second line")
        print("to stderr", file=sys.stderr)
        """,
    )
    launcher = _launch(tmp_path, "-np", "2", "--tag-output", str(script))
    try:
        stdout, stderr = launcher.communicate(timeout=30)
    finally:
        _cleanup(launcher, None)
    assert launcher.returncode == 0, stderr
    lines = stdout.splitlines()
    assert sorted(lines[i] for i, line in enumerate(lines) if "second line" in line) == [
        "[0] second line",
        "[1] second line",
    ]
    assert sorted(line for line in stderr.splitlines() if "to stderr" in line) == ["[0] to stderr", "[1] to stderr"]
    seen = {}
    for line in lines:
        if "{" in line:
            tag, _, payload = line.partition(" ")
            seen[tag] = json.loads(payload)
    assert sorted(seen) == ["[0]", "[1]"]
    for rank in (0, 1):
        env = seen[f"[{rank}]"]
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["BUNSAN_LAUNCHER"] == "bunsan"
        assert env["OMP_NUM_THREADS"] == "1"  # not set for the launcher: one thread per worker
        assert 1 <= int(env["MASTER_PORT"]) <= 65535
    assert seen["[0]"]["MASTER_PORT"] == seen["[1]"]["MASTER_PORT"]
    assert seen["[0]"]["BUNSAN_JOB_ID"] == seen["[1]"]["BUNSAN_JOB_ID"] != ""


@pytest.mark.timeout(60)
def test_any_executable_runs_and_untagged_output_passes_through(tmp_path):
    launcher = _launch(tmp_path, "-np", "2", "--", "sh", "-c", 'echo "rank $RANK of $WORLD_SIZE"')
    try:
        stdout, stderr = launcher.communicate(timeout=30)
    finally:
        _cleanup(launcher, None)
    assert launcher.returncode == 0, stderr
    assert sorted(stdout.splitlines()) == ["rank 0 of 2", "rank 1 of 2"]


@needs_proc
@pytest.mark.timeout(60)
def test_success_sweeps_processes_left_in_the_background(tmp_path):
    script = _write(
        tmp_path,
        "leave.py",
        "import json\n" + textwrap.dedent(_GRANDCHILDREN),  # rank 0 leaves 3 sleeps and exits 0
    )
    launcher = _launch(tmp_path, "-np", "2", str(script), str(tmp_path))
    job_id = None
    try:
        _, stderr = launcher.communicate(timeout=30)
        record = json.loads((tmp_path / "job").read_text())
        job_id = record["job"]
        assert launcher.returncode == 0, stderr
        _assert_nothing_left(job_id, record["pids"][1:])
    finally:
        _cleanup(launcher, job_id)


@pytest.mark.timeout(60)
def test_console_command_reports_bad_input_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bunsan", "run", "-np", "2", "missing.py"],
        cwd=tmp_path,
        env=_launcher_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("bunsan run: error: script 'missing.py' does not exist")


# ---------------------------------------------------------------------------
# In-process: bad input and --dry-run start no worker, so main() runs in pytest.


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "train.py"
    path.write_text("print('never run')\n")
    return path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "-np", "0", "train.py"], "-np must be >= 1, got 0"),
        (["run", "-np", "-3", "train.py"], "-np must be >= 1, got -3"),
        (["run", "-np", "two", "train.py"], "expected a whole number, got 'two'"),
        (["run", "-np", "2", "nope.py"], "script 'nope.py' does not exist"),
        (["run", "-np", "2", "no-such-program-xyz"], "neither a .py script nor an executable"),
        (["run", "--frobnicate", "train.py"], "unrecognized option '--frobnicate'"),
        (["run", "-np", "2"], "no command given"),
        (["run", "-np", "2", "--"], "no command given"),
        (["run", "-H", "localhost:1", "-np", "2", "train.py"], "-np 2 is more than the 1 slot(s)"),
        (["run", "-H", "node-a:2", "--remote-python", "venv/bin/python", "train.py"], "must be an absolute path"),
        (["run", "-H", "localhost:1,127.0.0.1:1", "train.py"], "are both this machine"),
        (["run", "-H", "a:2", "--hostfile", "hosts", "train.py"], "use one of them"),
        (["run", "--hostfile", "no-such-hostfile", "train.py"], "cannot read hostfile 'no-such-hostfile'"),
        (["run", "--master-port", "70000", "train.py"], "--master-port must be in 1..65535"),
    ],
)
def test_bad_input_exits_2_with_one_sentence(script, capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("bunsan run: error: ")
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_bad_hostfile_line_names_file_and_line(script, capsys):
    (script.parent / "hosts").write_text("# cluster\nlocalhost slots=2\nnode-b slots=two\n")
    assert main(["run", "--hostfile", "hosts", "train.py"]) == 2
    assert "bunsan run: error: hosts:3: cannot read 'node-b slots=two'" in capsys.readouterr().err


def test_no_subcommand_exits_2(capsys):
    assert main([]) == 2
    assert capsys.readouterr().err.startswith("bunsan: error: no command given")


def test_help_exits_0(capsys):
    assert main(["run", "--help"]) == 0
    assert "--tag-output" in capsys.readouterr().out


def test_dry_run_prints_plan_and_starts_nothing(script, capsys):
    argv = ["run", "-np", "3", "--master-addr", "10.1.2.3", "--master-port", "29517", "--dry-run"]
    argv += ["train.py", "--lr", "0.1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "MASTER_ADDR=10.1.2.3 MASTER_PORT=29517" in out
    rows = [line.split(None, 3) for line in out.splitlines()[1:]]
    assert rows[0] == ["rank", "local_rank", "host", "command"]
    assert [row[:3] for row in rows[1:]] == [["0", "0", "localhost"], ["1", "1", "localhost"], ["2", "2", "localhost"]]
    assert rows[1][3] == f"{sys.executable} -u train.py --lr 0.1"


def test_dry_run_shows_remote_hosts_from_hostfile(script, capsys):
    (script.parent / "hosts").write_text("node-a slots=2  # first\n\nnode-b slots=2\n")
    assert main(["run", "--hostfile", "hosts", "-np", "3", "--dry-run", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "MASTER_ADDR=node-a" in out
    rows = [line.split(None, 3)[:3] for line in out.splitlines()[2:]]
    assert rows == [["0", "0", "node-a"], ["1", "1", "node-a"], ["2", "0", "node-b"]]
