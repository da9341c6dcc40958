"""Issue 15, items 8, 14 and 15, in one process: oversubscription, cut quotes, expiring job records."""

from __future__ import annotations

import io
import json
import os
import time

import pytest

from bunsan.launch.cleanup import RECORD_TTL_S, JobRecord, jobs_dir, list_job_records, run_cleanup, write_job_record
from bunsan.launch.config import UsageError, parse_env_file, parse_run_args
from bunsan.launch.hosts import (
    MAX_HOST_NAME,
    OVERSUBSCRIBE_LIMIT,
    check_oversubscription,
    parse_hostfile,
    parse_hosts,
    usable_cores,
)
from bunsan.launch.quoting import MAX_QUOTED, quoted

# --------------------------------------------------------------------------- item 14: cut quotes


def test_quoted_keeps_short_input_and_cuts_long_input():
    assert quoted("node1 slot=4") == "'node1 slot=4'"
    long = quoted("x" * 5_000_133)
    assert long == repr("x" * MAX_QUOTED) + "... (5,000,133 characters)"
    with pytest.raises(ValueError, match="limit must be an int >= 1"):
        quoted("x", limit=0)


@pytest.mark.parametrize("junk", ["%" * 5_000_000, "node1 slots=" + "z" * 5_000_000])
def test_a_5mb_hostfile_line_is_not_echoed_whole(junk):
    with pytest.raises(ValueError) as caught:
        parse_hostfile(f"good slots=1\n{junk}\n", source="hosts")
    message = str(caught.value)
    assert message.startswith("hosts:2: cannot read ") and "characters)" in message
    assert len(message) < 300


def test_long_host_names_and_other_inputs_are_cut():
    with pytest.raises(ValueError, match=f"longer than any valid host name \\({MAX_HOST_NAME} characters\\)") as caught:
        parse_hostfile("a" * 1_000_000 + " slots=2\n", source="hosts")
    assert len(str(caught.value)) < 300
    for spec in ("b" * 1_000_000, "ok:1,%" + "c" * 1_000_000):
        with pytest.raises(ValueError) as caught:
            parse_hosts(spec)
        assert len(str(caught.value)) < 400
    with pytest.raises(ValueError) as caught:
        parse_env_file("NOT VALID " * 100_000)
    assert len(str(caught.value)) < 300
    for argv in (
        ["-np", "9" * 10 + "x" * 1_000_000, "t.py"],
        ["--job-id", "/" * 1_000_000, "t.py"],
        ["--ssh-option", "y" * 1_000_000, "t.py"],
        ["-x", "1" * 1_000_000, "t.py"],
    ):
        with pytest.raises(UsageError) as caught:
            parse_run_args(argv, environ={})
        assert len(str(caught.value)) < 400, argv[0]


# --------------------------------------------------------------------------- item 8: oversubscription


def test_oversubscription_warns_then_refuses_unless_allowed():
    assert check_oversubscription(2, 2, "localhost", allowed=False) is None
    warning = check_oversubscription(3, 2, "localhost", allowed=False)
    assert warning is not None and "3 workers on 'localhost', which has 2 CPU core(s), oversubscribe it" in warning
    assert "--oversubscribe" in warning and "\n" not in warning
    assert check_oversubscription(OVERSUBSCRIBE_LIMIT * 2, 2, "localhost", allowed=False) is not None  # still a warning
    for workers in (OVERSUBSCRIBE_LIMIT * 2 + 1, 100_000):
        with pytest.raises(
            ValueError,
            match=f"{workers} workers on 'n1', which has 2 CPU core\\(s\\), is more than "
            f"{OVERSUBSCRIBE_LIMIT} per core; .* --oversubscribe",
        ):
            check_oversubscription(workers, 2, "n1", allowed=False)
    assert check_oversubscription(100_000, 2, "n1", allowed=True) is None
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def test_oversubscribe_flag_and_environment():
    assert parse_run_args(["t.py"], environ={}).oversubscribe is False
    assert parse_run_args(["--oversubscribe", "t.py"], environ={}).oversubscribe is True
    assert parse_run_args(["t.py"], environ={"BUNSAN_OVERSUBSCRIBE": "1"}).oversubscribe is True


def test_bunsan_run_refuses_an_absurd_local_count_before_starting_anything(tmp_path, capsys):
    from bunsan.cli import main

    script = tmp_path / "t.py"
    script.write_text("raise SystemExit('must not run')\n")
    workers = OVERSUBSCRIBE_LIMIT * usable_cores() + 1
    assert main(["run", "-np", str(workers), str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bunsan run: error: {workers} workers on 'localhost', which has {usable_cores()} CPU core")
    assert err.count("\n") == 1
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=100000\n")
    assert main(["run", "--hostfile", str(hostfile), str(script)]) == 2
    assert "100000 workers on 'localhost'" in capsys.readouterr().err


def test_bunsan_run_warns_about_oversubscription_in_one_line(tmp_path, capfd):
    from bunsan.cli import main

    script = tmp_path / "t.py"
    script.write_text("pass\n")
    workers = usable_cores() + 1
    assert main(["run", "-np", str(workers), str(script)]) == 0
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "warning" in line]
    assert lines == [
        f"bunsan run: warning: {workers} workers on 'localhost', which has {usable_cores()} CPU core(s), "
        "oversubscribe it and each will run slower; lower -np or the slots to the core count, "
        "or pass --oversubscribe to silence this"
    ]
    assert main(["run", "--oversubscribe", "-np", str(workers), str(script)]) == 0
    assert "warning" not in capfd.readouterr().err


# --------------------------------------------------------------------------- item 15: job records


def _record(job_id: str, started: float, hosts=("a", "b")) -> JobRecord:
    # pid 2**22 + 1 is above the kernel's pid_max: its launcher is gone.
    return JobRecord(job_id, list(hosts), [], {}, "/py", launcher_pid=2**22 + 1, launcher_start="1", started=started)


def test_records_of_stopped_launchers_expire(tmp_path):
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    now = time.time()
    fresh, old = _record("fresh", now - 60), _record("old", now - RECORD_TTL_S - 60)
    write_job_record(fresh, environ)
    write_job_record(old, environ)
    directory = jobs_dir(environ)
    (directory / "garbage.json").write_text("{")
    os.utime(directory / "garbage.json", (now - RECORD_TTL_S - 60,) * 2)
    (directory / "young-garbage.json").write_text("{")  # may be half-written by another launcher: kept
    assert list_job_records(environ) == [fresh]
    assert sorted(p.name for p in directory.iterdir()) == ["fresh.json", "young-garbage.json"]
    running = JobRecord("mine", ["a"], [], {}, "/py", os.getpid(), "", now - RECORD_TTL_S - 60)
    running = JobRecord(**{**running.__dict__, "launcher_start": _own_start()})
    assert running.launcher_running() and not running.expired(now)  # a live launcher's record never expires


def _own_start() -> str:
    from bunsan.launch.cleanup import _process_start

    return _process_start(os.getpid())


def test_cleanup_names_unreachable_hosts_and_keeps_only_them(tmp_path):
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    record = JobRecord(
        "j7",
        ["here", "nowhere.invalid"],
        ["here"],
        {"connect_timeout_s": 3},
        "/py",
        launcher_pid=2**22 + 1,
        launcher_start="1",
        started=time.time() - 60,
    )
    write_job_record(record, environ)
    out, err = io.StringIO(), io.StringIO()
    status = run_cleanup(
        None,
        None,
        is_local=lambda h: h == "here",
        ssh=None,
        remote_python=None,
        stdout=out,
        stderr=err,
        environ=environ,
    )
    assert status == 1
    assert "job j7  here             nothing left" in out.getvalue()
    assert "nowhere.invalid  FAILED:" in out.getvalue()
    message = err.getvalue().strip()
    assert message.startswith("bunsan run: could not reach 1 host(s) of job j7: nowhere.invalid; ")
    assert "now lists only them" in message and "\n" not in message
    kept = json.loads((jobs_dir(environ) / "j7.json").read_text())
    assert kept["hosts"] == ["nowhere.invalid"] and kept["local_hosts"] == []
