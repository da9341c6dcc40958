"""``bunsan run`` options into a LaunchConfig, and the config into worker plans. No processes."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from bunsan.launch.config import LaunchConfig, UsageError, parse_run_args
from bunsan.launch.hosts import Host, assign_slots
from bunsan.launch.local import (
    exit_code_of,
    first_failure,
    format_plan,
    is_job_environ,
    plan_workers,
    worker_command,
    worker_environment,
)

# ---------------------------------------------------------------------------
# Parsing


def test_defaults():
    config = parse_run_args(["train.py"], environ={})
    assert config == LaunchConfig(command=("train.py",))
    assert config.nproc is None and config.master_port is None and not config.tag_output


def test_options_then_command_with_its_own_options():
    config = parse_run_args(
        ["-np", "4", "--tag-output", "--master-port", "29501", "train.py", "-np", "9", "--tag-output"], environ={}
    )
    assert config.nproc == 4
    assert config.tag_output
    assert config.master_port == 29501
    assert config.command == ("train.py", "-np", "9", "--tag-output")  # the script's, untouched


def test_double_dash_separates_the_command():
    assert parse_run_args(["-n", "2", "--", "python", "-u", "t.py"], environ={}).command == ("python", "-u", "t.py")


def test_hosts_hostfile_and_master_options():
    config = parse_run_args(
        ["-H", "a:2,b:2", "--master-addr", "a", "--dry-run", "t.py"], environ={}
    )
    assert (config.hosts, config.master_addr, config.dry_run) == ("a:2,b:2", "a", True)
    assert parse_run_args(["--hostfile", "hosts", "t.py"], environ={}).hostfile == "hosts"


def test_environment_fallbacks():
    environ = {
        "BUNSAN_NPROC": "3",
        "BUNSAN_MASTER_ADDR": "10.0.0.2",
        "BUNSAN_MASTER_PORT": "29600",
        "BUNSAN_TAG_OUTPUT": "true",
        "BUNSAN_HOSTS": "localhost:8",
    }
    config = parse_run_args(["t.py"], environ=environ)
    assert (config.nproc, config.master_addr, config.master_port, config.tag_output, config.hosts) == (
        3,
        "10.0.0.2",
        29600,
        True,
        "localhost:8",
    )


def test_flags_win_over_environment():
    environ = {"BUNSAN_NPROC": "5", "BUNSAN_MASTER_PORT": "1"}
    config = parse_run_args(["-np", "2", "--master-port", "29700", "t.py"], environ=environ)
    assert (config.nproc, config.master_port) == (2, 29700)


def test_dry_run_has_no_environment_fallback():
    assert not parse_run_args(["t.py"], environ={"BUNSAN_DRY_RUN": "1"}).dry_run


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"BUNSAN_NPROC": "many"}, "BUNSAN_NPROC='many' is not a whole number"),
        ({"BUNSAN_MASTER_PORT": ""}, "BUNSAN_MASTER_PORT='' is not a port number"),
        ({"BUNSAN_TAG_OUTPUT": "maybe"}, "BUNSAN_TAG_OUTPUT='maybe' is not a boolean"),
        ({"BUNSAN_NPROC": "0"}, "-np must be >= 1, got 0"),
    ],
)
def test_bad_environment_is_named(environ, message):
    with pytest.raises(UsageError, match="fix or unset it|pass the number") as info:
        parse_run_args(["t.py"], environ=environ)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no command given; put the training script after the options"),
        (["-np", "2"], "no command given"),
        (["-np", "0", "t.py"], "-np must be >= 1, got 0; pass the number of worker processes, e.g. -np 2"),
        (["-np", "-1", "t.py"], "-np must be >= 1, got -1"),
        (["-np", "1.5", "t.py"], "expected a whole number, got '1.5'"),
        (["-np"], "expected one argument"),
        (["--bogus", "t.py"], "unrecognized arguments: --bogus"),
        (["--tag", "t.py"], "unrecognized arguments: --tag"),  # no abbreviations
        (["-H", "a:2", "--hostfile", "h", "t.py"], "use one of them"),
        (["-H", "a:x", "t.py"], "cannot read 'a:x'"),
        (["--master-port", "0", "t.py"], "--master-port must be in 1..65535, got 0"),
        (["--master-addr", " ", "t.py"], "--master-addr is empty"),
    ],
)
def test_bad_arguments_raise_usage_error(argv, message):
    with pytest.raises(UsageError) as info:
        parse_run_args(argv, environ={})
    assert message in str(info.value)
    assert info.value.prog == "bunsan run"
    assert isinstance(info.value, ValueError)


def test_config_is_frozen():
    config = parse_run_args(["t.py"], environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.nproc = 3  # type: ignore[misc]


# ---------------------------------------------------------------------------
# From the config to what each worker runs


def test_worker_environment_follows_torchrun_convention():
    slot = assign_slots([Host("a", 2), Host("b", 2)], 4)[3]
    env = worker_environment(slot, {"PATH": "/bin", "RANK": "stale"}, "a", 29500, "job42")
    assert env == {
        "PATH": "/bin",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "a",
        "MASTER_PORT": "29500",
        "BUNSAN_JOB_ID": "job42",
        "BUNSAN_LAUNCHER": "bunsan",
        "OMP_NUM_THREADS": "1",
    }


def test_worker_environment_keeps_the_users_thread_count():
    slot = assign_slots([Host("localhost", 1)], 1)[0]
    assert worker_environment(slot, {"OMP_NUM_THREADS": "4"}, "127.0.0.1", 1, "j")["OMP_NUM_THREADS"] == "4"


def test_plan_workers_and_format_plan():
    slots = assign_slots([Host("localhost", 2)], 2)
    specs = plan_workers(slots, ["/usr/bin/python3", "-u", "my train.py"], {}, "127.0.0.1", 29500, "j")
    assert [(s.rank, s.local_rank, s.host) for s in specs] == [(0, 0, "localhost"), (1, 1, "localhost")]
    assert [s.env["RANK"] for s in specs] == ["0", "1"]
    assert format_plan(specs).splitlines() == [
        "rank  local_rank  host       command",
        "0     0           localhost  /usr/bin/python3 -u 'my train.py'",
        "1     1           localhost  /usr/bin/python3 -u 'my train.py'",
    ]


def test_worker_command_runs_scripts_with_this_python(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    assert worker_command([str(script), "--lr", "0.1"]) == [sys.executable, "-u", str(script), "--lr", "0.1"]
    assert worker_command(["sh", "-c", "true"]) == ["sh", "-c", "true"]
    with pytest.raises(ValueError, match="script .*missing.py' does not exist"):
        worker_command([str(tmp_path / "missing.py")])
    with pytest.raises(ValueError, match="'no-such-program-xyz' is neither a .py script nor an executable on PATH"):
        worker_command(["no-such-program-xyz"])


def test_exit_codes_and_first_failure():
    assert [exit_code_of(code) for code in (0, 3, -9, -15)] == [0, 3, 137, 143]
    assert first_failure([None, None]) is None
    assert first_failure([0, None]) is None
    assert first_failure([None, 3]) == 1
    assert first_failure([-9, 3]) == 0  # a tie within one poll: the lowest rank is reported


def test_is_job_environ_matches_whole_entries():
    environ = b"PATH=/bin\0BUNSAN_JOB_ID=abc\0HOME=/root\0"
    assert is_job_environ(environ, "abc")
    assert not is_job_environ(environ, "ab")
    assert not is_job_environ(b"X=BUNSAN_JOB_ID=abc\0", "abc")
