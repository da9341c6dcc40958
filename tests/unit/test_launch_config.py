"""``bunsan run`` options into a LaunchConfig, and the config into worker plans. No processes."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from bunsan.launch.cleanup import JobRecord, check_job_id, jobs_dir, list_job_records, write_job_record
from bunsan.launch.config import (
    ArgumentParser,
    LaunchConfig,
    UsageError,
    parse_env_file,
    parse_run_args,
    resolve_exports,
)
from bunsan.launch.hosts import Host, assign_slots
from bunsan.launch.local import run_attempts
from bunsan.launch.options import RUN_OPTIONS, SSH_OPTIONS, add_run_arguments
from bunsan.launch.plan import (
    JobOutcome,
    exit_code_of,
    first_failure,
    format_plan,
    plan_workers,
    worker_command,
    worker_environment,
)
from bunsan.launch.proctree import is_job_environ

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
    config = parse_run_args(["-H", "a:2,b:2", "--master-addr", "a", "--dry-run", "t.py"], environ={})
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
    with pytest.raises(UsageError, match=r"fix or unset it|pass the number") as info:
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
        "BUNSAN_RESTART": "0",
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
    with pytest.raises(ValueError, match=r"script .*missing.py' does not exist"):
        worker_command([str(tmp_path / "missing.py")])
    with pytest.raises(ValueError, match=r"'no-such-program-xyz' is neither a .py script nor an executable on PATH"):
        worker_command(["no-such-program-xyz"])


def test_a_missing_scripts_long_path_is_named_whole(tmp_path):
    """A path longer than the 80 characters other input is cut to keeps its last part: the name."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    missing = deep / "missing_train.py"
    with pytest.raises(ValueError) as raised:
        worker_command([str(missing)])
    assert repr(str(missing)) in str(raised.value)


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


# ---------------------------------------------------------------------------
# Multi-host options: ssh, environment, restarts, cleanup


def test_multihost_options():
    config = parse_run_args(
        [
            "--hostfile",
            "hosts",
            "--ssh-port",
            "2222",
            "--ssh-identity",
            "/k/id",
            "--ssh-host-key-checking",
            "no",
            "--ssh-option",
            "ConnectionAttempts=3",
            "-x",
            "NCCL_DEBUG=INFO",
            "-x",
            "HOME",
            "--env-file",
            "vars",
            "--remote-python",
            "/opt/venv/bin/python",
            "--remote-cwd",
            "/work",
            "--max-restarts",
            "2",
            "--job-id",
            "exp-7",
            "train.py",
            "-x",
            "1",
        ],
        environ={},
    )
    assert (config.ssh_port, config.ssh_identity, config.ssh_host_key_checking) == (2222, "/k/id", "no")
    assert config.ssh_options == ("ConnectionAttempts=3",)
    assert config.exports == ("NCCL_DEBUG=INFO", "HOME") and config.env_file == "vars"
    assert (config.remote_python, config.remote_cwd) == ("/opt/venv/bin/python", "/work")
    assert (config.max_restarts, config.job_id, config.cleanup) == (2, "exp-7", False)
    assert config.command == ("train.py", "-x", "1")


def test_multihost_environment_fallbacks_and_none_for_job_id_or_cleanup():
    environ = {
        "BUNSAN_SSH_PORT": "2200",
        "BUNSAN_REMOTE_PYTHON": "/p/python",
        "BUNSAN_MAX_RESTARTS": "1",
        "BUNSAN_JOB_ID": "the-workers-own",
        "BUNSAN_CLEANUP": "1",
    }
    config = parse_run_args(["t.py"], environ=environ)
    assert (config.ssh_port, config.remote_python, config.max_restarts) == (2200, "/p/python", 1)
    assert config.job_id is None and not config.cleanup


def test_cleanup_needs_no_command():
    config = parse_run_args(["--cleanup", "--job-id", "abc", "-H", "a,b"], environ={})
    assert config.cleanup and config.job_id == "abc" and config.command == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ssh-port", "0", "t.py"], "--ssh-port must be in 1..65535, got 0"),
        (["--ssh-host-key-checking", "ask", "t.py"], "must be one of yes, accept-new, no, got 'ask'"),
        (["--ssh-option", "Verbose", "t.py"], "--ssh-option 'Verbose' is not KEY=VALUE"),
        (["--remote-python", "python3", "t.py"], "--remote-python must be an absolute path"),
        (["--remote-cwd", "work", "t.py"], "--remote-cwd must be an absolute path"),
        (["--max-restarts", "-1", "t.py"], "--max-restarts must be >= 0, got -1"),
        (["-x", "1BAD", "t.py"], "'1BAD' is not a variable name"),
        (["--job-id", "a b", "t.py"], "--job-id 'a b' is not valid"),
        (["--cleanup", "--job-id", "../x"], "--job-id '../x' is not valid"),
    ],
)
def test_bad_multihost_arguments(argv, message):
    with pytest.raises(UsageError) as info:
        parse_run_args(argv, environ={})
    assert message in str(info.value)


def test_env_file_and_exports():
    text = "# for the workers\nA=1\nexport B = two words \nC='quoted # not a comment'\n\nD=\n"
    file_env = parse_env_file(text, "vars")
    assert file_env == {"A": "1", "B": "two words", "C": "quoted # not a comment", "D": ""}
    env = resolve_exports(["A=override", "HOME", "E=x=y"], {"HOME": "/root"}, file_env)
    assert env == {
        "A": "override",
        "B": "two words",
        "C": "quoted # not a comment",
        "D": "",
        "HOME": "/root",
        "E": "x=y",
    }
    with pytest.raises(ValueError, match=r"^vars:2: cannot read 'oops'; expected VAR=value$"):
        parse_env_file("A=1\noops\n", "vars")
    with pytest.raises(UsageError, match="-x MISSING: MISSING is not set in this environment"):
        resolve_exports(["MISSING"], {})


def test_worker_environment_counts_restarts():
    slot = assign_slots([Host("a", 1)], 1)[0]
    env = worker_environment(slot, {}, "a", 1, "job", restart=2)
    assert (env["BUNSAN_JOB_ID"], env["BUNSAN_RESTART"]) == ("job", "2")  # the job id stays, for --cleanup


def test_run_attempts_restarts_failures_only_and_logs_each_cause():
    def attempts(*outcomes):
        seen, log = [], []

        def attempt(restart):
            seen.append(restart)
            return outcomes[restart]

        return seen, log, attempt

    failed = JobOutcome(1, "failed", 3, "rank 3 exited with code 1 on host b")
    seen, log, attempt = attempts(failed, JobOutcome(255, "lost", cause="lost host b"), JobOutcome(0, "ok"))
    assert run_attempts(attempt, 2, log.append).code == 0
    assert seen == [0, 1, 2]
    assert log[0] == (
        "restart 1 of 2 after: rank 3 exited with code 1 on host b; starting every worker again (BUNSAN_RESTART=1)"
    )
    assert log[1].startswith("restart 2 of 2 after: lost host b;")
    assert log[2] == "the job succeeded after 2 restart(s)"

    seen, log, attempt = attempts(failed, failed)
    assert run_attempts(attempt, 1, log.append).code == 1
    assert seen == [0, 1] and log[-1] == "giving up after 1 restart(s) (--max-restarts 1)"

    for final in (JobOutcome(130, "signal"), JobOutcome(2, "start")):  # not worth a restart
        seen, log, attempt = attempts(final)
        assert run_attempts(attempt, 5, log.append) == final
        assert seen == [0] and log == []


def test_job_records_and_job_ids(tmp_path):
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    assert jobs_dir(environ) == tmp_path / "bunsan" / "jobs"
    assert jobs_dir({"HOME": "/home/me"}) == Path("/home/me/.cache/bunsan/jobs")
    record = JobRecord("j1", ["a", "b"], [], {"port": 2222}, "/py", launcher_pid=2**22 + 1, launcher_start="1")
    write_job_record(record, environ)
    (jobs_dir(environ) / "broken.json").write_text("{")
    assert list_job_records(environ) == [record]
    assert not record.launcher_running()  # no such process
    assert check_job_id("3f2a91c0.r1_x-y") == "3f2a91c0.r1_x-y"
    for bad in ("", "-x", "a/b", "a b", "x" * 65):
        with pytest.raises(ValueError, match="is not valid"):
            check_job_id(bad)


# One declaration per option (bunsan.launch.options): the parser, the help and the
# BUNSAN_* fallback all come from it.
_ENV_SAMPLES = {
    "nproc": "3",
    "hosts": "a:2,b:2",
    "hostfile": "hosts.txt",
    "master_addr": "10.0.0.2",
    "master_port": "29600",
    "tag_output": "yes",
    "env_file": "vars.env",
    "max_restarts": "2",
    "oversubscribe": "on",
    "ssh_port": "2222",
    "ssh_identity": "/keys/id",
    "ssh_host_key_checking": "accept-new",
    "remote_python": "/opt/venv/bin/python",
    "remote_cwd": "/work",
}


@pytest.mark.parametrize("option", [o for o in (*RUN_OPTIONS, *SSH_OPTIONS) if o.env], ids=lambda o: o.name)
def test_every_declared_fallback_is_read_and_named_in_the_help(option):
    config = parse_run_args(["t.py"], environ={option.env_name: _ENV_SAMPLES[option.name]})
    assert getattr(config, option.name) == option.parse(_ENV_SAMPLES[option.name])
    assert getattr(parse_run_args(["t.py"], environ={}), option.name) != getattr(config, option.name)
    parser = ArgumentParser(prog="bunsan run")
    add_run_arguments(parser)
    assert f"env {option.env_name}" in " ".join(parser.format_help().split())


@pytest.mark.parametrize("option", [o for o in (*RUN_OPTIONS, *SSH_OPTIONS) if not o.env], ids=lambda o: o.name)
def test_options_declared_without_fallback_ignore_the_environment(option):
    value = "/work" if option.name == "job_id" else "1"
    config = parse_run_args(["t.py"], environ={option.env_name: value})
    assert config == parse_run_args(["t.py"], environ={})
