"""``bunsan run`` and ``bunsan doctor`` across real hosts: network namespaces with their own sshd.

The hosts (tests/helpers/hosts.py) are network namespaces on this machine,
joined by a bridge, each with an sshd on a key made for the test; the
launcher runs in a namespace of its own and reaches them over ssh, exactly
as it would reach other machines. The hosts share this machine's file system
and process table, so the remote Python and the script are at the same
paths, and the test checks for leftovers in ``/proc``: every process that
carries the job's ``BUNSAN_JOB_ID``, and every process in the hosts'
namespaces other than their sshd.

Each test starts at most two jobs; the ones that train import torch in 4
workers (3-6 s here). Kill-to-clean times are printed.
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

from tests.helpers.environment import without_bunsan_settings
from tests.helpers.hosts import HostsUnavailable, SshHosts, start_hosts

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="namespaces and /proc: Linux only")

CLEAN_WITHIN_S = 15.0


# ---------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    """Two hosts with sshd; host 2 sees an empty directory where host 1 sees ``<base>/data``."""
    base = tmp_path_factory.mktemp("hosts")
    data, empty = base / "data", base / "empty"
    data.mkdir()
    empty.mkdir()
    try:
        started = start_hosts(base / "ssh", count=2, views={1: [(empty, data)]})
    except HostsUnavailable as err:
        pytest.skip(f"no test hosts: {err}")
    started.data_dir = data  # type: ignore[attr-defined]
    try:
        yield started
    finally:
        namespaces = list(started.namespaces) + ([started.client_ns] if started.client_ns else [])
        started.close()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if namespaces else ""
        assert not [ns for ns in namespaces if ns in left.split()], f"namespaces left behind: {left}"


def _env(tmp_path: Path) -> dict[str, str]:
    env = without_bunsan_settings()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # the launcher's job records stay in the test
    return env


def _bunsan(hosts: SshHosts, tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """``bunsan ARGS`` started where the hosts can be reached, with their ssh options."""
    subcommand, rest = args[0], args[1:]
    argv = hosts.launcher([sys.executable, "-m", "bunsan", subcommand, *hosts.ssh_args(), *rest])
    return subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def _job_processes(job_id: str) -> list[int]:
    """Live processes whose environment has BUNSAN_JOB_ID=<job_id> (the test's own scan)."""
    marker = f"BUNSAN_JOB_ID={job_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if marker in Path("/proc", entry, "environ").read_bytes().split(b"\0"):
                stat = Path("/proc", entry, "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _strays(hosts: SshHosts, sshd: set[int]) -> list[int]:
    """Processes in the hosts' namespaces other than their sshd listeners."""
    return [pid for pid in hosts.processes() if pid not in sshd]


def _wait_clean(hosts: SshHosts, job_id: str, sshd: set[int], since: float) -> float:
    """Seconds from ``since`` until no process of the job and no stray process in the hosts is left."""
    deadline = since + 30.0
    while _job_processes(job_id) or _strays(hosts, sshd):
        assert time.monotonic() < deadline, (
            f"left after 30 s: job {_job_processes(job_id)}, in the hosts {_strays(hosts, sshd)}"
        )
        time.sleep(0.05)
    return time.monotonic() - since


def _wait_for(paths: list[Path], process: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the launcher exited {process.returncode} early:\n{out}\n{err}")
        assert time.monotonic() < deadline, f"workers did not write {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.05)


def _stop(process: subprocess.Popen[str], job_id: str | None) -> None:
    """After a failed assertion: leave nothing running."""
    if process.poll() is None:
        process.kill()
        process.communicate()
    if job_id:
        for pid in _job_processes(job_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _report(capsys: pytest.CaptureFixture[str], what: str, seconds: float) -> None:
    with capsys.disabled():
        print(f"\n[multihost] {what}: {seconds:.2f} s", file=sys.stderr)


# Every rank writes {pid, job, host} and sleeps; rank 0 also starts a grandchild in a
# session of its own (it leaves the worker's process group, not the job).
_SLEEPER = """
    import json, os, socket, subprocess, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    pids = [os.getpid()]
    if rank == 0:
        pids.append(subprocess.Popen(["sleep", "1000"], start_new_session=True).pid)
    record = {"pids": pids, "job": os.environ["BUNSAN_JOB_ID"], "restart": os.environ["BUNSAN_RESTART"]}
    (out / f"rank{rank}.tmp").write_text(json.dumps(record))
    os.rename(out / f"rank{rank}.tmp", out / f"rank{rank}")
    time.sleep(1000)
"""


# ---------------------------------------------------------------------------
# Training across hosts equals training on one machine


_TRAIN = """
    import os, sys
    import torch
    import bunsan

    info = bunsan.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = bunsan.distribute(model, optimizer, algorithm=bunsan.DataParallelSGD())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(80, 8, generator=g), torch.randn(80, 2, generator=g)
    rank, world = bunsan.rank(), bunsan.size()
    for step in range(5):
        xb, yb = x[step * 16:(step + 1) * 16], y[step * 16:(step + 1) * 16]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(xb[rank::world]), yb[rank::world]).backward()
        optimizer.step()
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.save(dict(model.state_dict()), os.path.join(out, f"rank{rank}.pt"))
    print("trained", info.launcher, os.environ["MASTER_ADDR"], flush=True)
    bunsan.finalize()
"""


@pytest.mark.timeout(120)
def test_two_hosts_train_like_four_local_workers(hosts, tmp_path):
    import torch

    script = _write(tmp_path, "train.py", _TRAIN)
    hostfile = hosts.hostfile(tmp_path / "hostfile", slots=2)
    remote = _bunsan(
        hosts, tmp_path, "run", "--hostfile", str(hostfile), "--tag-output", str(script), str(tmp_path / "hosts")
    )
    single = subprocess.Popen(  # the reference: 4 workers on one machine
        [sys.executable, "-m", "bunsan", "run", "-np", "4", str(script), str(tmp_path / "local")],
        cwd=tmp_path,
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = remote.communicate(timeout=100)
        local_out, local_err = single.communicate(timeout=100)
    finally:
        _stop(remote, None)
        _stop(single, None)
    assert remote.returncode == 0, out + err
    assert single.returncode == 0, local_out + local_err
    # Ranks fill the hosts in order: 0 and 1 on the first, 2 and 3 on the second.
    rank0_host = hosts.names[0].rsplit("@", 1)[-1]
    expected = {f"[{hosts.names[r // 2]}:{r}] trained bunsan {rank0_host}" for r in range(4)}
    assert expected <= set(out.splitlines()), out
    reference = torch.load(tmp_path / "local" / "rank0.pt", weights_only=True)
    for rank in range(4):
        for where in ("hosts", "local"):
            params = torch.load(tmp_path / where / f"rank{rank}.pt", weights_only=True)
            for name, value in reference.items():
                assert torch.equal(params[name], value), (where, rank, name)


# ---------------------------------------------------------------------------
# Hygiene: a worker killed on one host, the launcher killed


@pytest.mark.timeout(120)
def test_kill_9_of_a_remote_worker_ends_the_job_on_every_host(hosts, tmp_path, capsys):
    sshd = set(hosts.processes())
    script = _write(tmp_path, "sleeper.py", _SLEEPER)
    hostfile = hosts.hostfile(tmp_path / "hostfile", slots=2)
    launcher = _bunsan(hosts, tmp_path, "run", "--hostfile", str(hostfile), str(script), str(tmp_path))
    job_id = None
    try:
        _wait_for([tmp_path / f"rank{r}" for r in range(4)], launcher)
        records = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(4)]
        job_id = records[0]["job"]
        assert len(_job_processes(job_id)) >= 4 + 1 + 2  # workers, rank 0's grandchild, two agents
        killed = time.monotonic()
        os.kill(records[3]["pids"][0], signal.SIGKILL)  # rank 3 runs on the second host
        _, err = launcher.communicate(timeout=30)
        exited = time.monotonic() - killed
        clean = _wait_clean(hosts, job_id, sshd, killed)
        _report(capsys, "kill -9 of a remote worker -> launcher exits", exited)
        _report(capsys, "kill -9 of a remote worker -> nothing left on any host", clean)
        assert launcher.returncode == 137, err
        assert f"rank 3 was killed by SIGKILL (exit code 137) on host {hosts.names[1]}" in err, err
        assert clean < CLEAN_WITHIN_S
        assert list((tmp_path / "cache" / "bunsan" / "jobs").glob("*.json")) == []  # the job ended cleanly
    finally:
        _stop(launcher, job_id)


@pytest.mark.timeout(120)
def test_sigkill_of_the_launcher_leaves_no_remote_worker(hosts, tmp_path, capsys):
    sshd = set(hosts.processes())
    script = _write(tmp_path, "sleeper.py", _SLEEPER)
    launcher = _bunsan(
        hosts, tmp_path, "run", "-H", ",".join(f"{h}:2" for h in hosts.names), str(script), str(tmp_path)
    )
    job_id = None
    try:
        _wait_for([tmp_path / f"rank{r}" for r in range(4)], launcher)
        job_id = json.loads((tmp_path / "rank0").read_text())["job"]
        killed = time.monotonic()
        launcher.kill()  # SIGKILL: no handler runs; only the ssh connections' end tells the hosts
        launcher.communicate(timeout=10)
        clean = _wait_clean(hosts, job_id, sshd, killed)
        _report(capsys, "SIGKILL of the launcher -> nothing left on any host", clean)
        assert clean < CLEAN_WITHIN_S
        # The launcher had no chance to remove its job record: --cleanup finds it, finds nothing left.
        records = list((tmp_path / "cache" / "bunsan" / "jobs").glob("*.json"))
        assert [r.stem for r in records] == [job_id]
        cleanup = _bunsan(hosts, tmp_path, "run", "--cleanup")
        out, err = cleanup.communicate(timeout=60)
        assert cleanup.returncode == 0, out + err
        lines = [line for line in out.splitlines() if line.startswith(f"job {job_id}")]
        assert len(lines) == 2 and all(line.endswith("nothing left") for line in lines), out
        assert list((tmp_path / "cache" / "bunsan" / "jobs").glob("*.json")) == []
    finally:
        _stop(launcher, job_id)


@pytest.mark.timeout(120)
def test_cleanup_ends_only_the_given_jobs_processes_on_every_host(hosts, tmp_path):
    # Processes that escaped a job (e.g. a host that was unreachable while the job stopped),
    # and one of another job that must survive.
    def start(host: str, job: str) -> None:
        command = f"BUNSAN_JOB_ID={job} setsid sleep 1000 </dev/null >/dev/null 2>&1 &"
        argv = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            "-p",
            str(hosts.ssh_port),
            "-i",
            str(hosts.identity),
            host,
            command,
        ]
        subprocess.run(hosts.launcher(argv), check=True, timeout=30, stdin=subprocess.DEVNULL)

    for host in hosts.names:
        start(host, "stray-job")
    start(hosts.names[0], "other-job")
    try:
        deadline = time.monotonic() + 10
        while (len(_job_processes("stray-job")) < 2 or not _job_processes("other-job")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_job_processes("stray-job")) == 2
        cleanup = _bunsan(hosts, tmp_path, "run", "--cleanup", "--job-id", "stray-job", "-H", ",".join(hosts.names))
        out, err = cleanup.communicate(timeout=60)
        assert cleanup.returncode == 0, out + err
        lines = [line for line in out.splitlines() if line.startswith("job stray-job")]
        assert [line.split()[2] for line in lines] == hosts.names, out
        # The test hosts share one process table, so whichever host looks first may end both,
        # and two hosts that look at the same moment both list a pid: count distinct pids.
        ended = {pid for line in lines if "ended " in line for pid in line.split(": ", 1)[1].split()}
        assert len(ended) == 2, out
        assert _job_processes("stray-job") == []
        assert len(_job_processes("other-job")) == 1
    finally:
        for job in ("stray-job", "other-job"):
            for pid in _job_processes(job):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------
# Restarts: every host starts again, and the session continues from its checkpoint


_RESUMABLE = """
    import os, signal, sys

    import torch
    import torch.nn.functional as F
    from torch import nn

    import bunsan
    from bunsan.train import Callback, Checkpoint, TrainingSession

    bunsan.init()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)


    class KillAfter(Callback):
        def on_epoch_end(self, session, epoch):
            if epoch.epoch + 1 == 2 and bunsan.rank() == 1:
                print("rank 1 crashes after epoch 2", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


    def train(out, kill=False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        session = TrainingSession(
            model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0), "data_parallel", (x, y),
            minibatch_size=16, max_epochs=4, learning_rate_per_sample=0.02,
            checkpoint=Checkpoint(os.path.join(out, "ckpt", "run.pt"), restore=True),
            callbacks=[KillAfter()] if kill else [], progress=False,
        )
        summary = session.train()
        if bunsan.is_main():
            torch.save({"params": dict(model.state_dict()), "restored_from": summary.restored_from},
                       os.path.join(out, "final.pt"))


    attempt = int(os.environ["BUNSAN_RESTART"])
    print("attempt", attempt, "job", os.environ["BUNSAN_JOB_ID"], flush=True)
    if attempt == 0:
        train("straight")  # the reference: never stops
        train("interrupted", kill=True)  # rank 1 dies after its epoch-2 checkpoint
    else:
        train("interrupted")  # the restarted job restores and finishes
    bunsan.finalize()
"""


@pytest.mark.timeout(120)
def test_max_restarts_restarts_every_host_and_the_session_resumes(hosts, tmp_path):
    import torch

    script = _write(tmp_path, "resumable.py", _RESUMABLE)
    launcher = _bunsan(
        hosts,
        tmp_path,
        "run",
        "-H",
        ",".join(f"{h}:1" for h in hosts.names),
        "--max-restarts",
        "2",
        "--tag-output",
        str(script),
    )
    try:
        out, err = launcher.communicate(timeout=110)
    finally:
        _stop(launcher, None)
    assert launcher.returncode == 0, out + err
    restarts = [line for line in err.splitlines() if "restart 1 of 2 after:" in line]
    assert len(restarts) == 1, err
    assert f"rank 1 was killed by SIGKILL (exit code 137) on host {hosts.names[1]}" in restarts[0]
    assert "restart 2" not in err
    attempts = sorted(line.split("] ", 1)[1] for line in out.splitlines() if " attempt " in f" {line}")
    job = attempts[0].split()[-1]
    assert attempts == [f"attempt 0 job {job}"] * 2 + [f"attempt 1 job {job}"] * 2  # same job id, both hosts
    a = torch.load(tmp_path / "interrupted" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)
    assert a["restored_from"] is not None and b["restored_from"] is None
    for name in b["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name


# ---------------------------------------------------------------------------
# Bad input and the doctor


@pytest.mark.timeout(120)
def test_bad_hostfile_line_is_reported_with_its_line_number(hosts, tmp_path):
    script = _write(tmp_path, "never.py", "raise SystemExit('never started')\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"# two hosts\n{hosts.names[0]} slots=2\n\n{hosts.names[1]} slots=lots\n")
    launcher = _bunsan(hosts, tmp_path, "run", "--hostfile", str(hostfile), str(script))
    _out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 2
    assert (
        err == f"bunsan run: error: {hostfile}:4: cannot read '{hosts.names[1]} slots=lots'; "
        "expected 'HOST slots=N', e.g. 'node1 slots=4'\n"
    )


@pytest.mark.timeout(120)
def test_doctor_finds_data_missing_on_one_host(hosts, tmp_path):
    if hosts.mode != "netns":
        pytest.skip("per-host views of a directory need the hosts' own mount namespaces (netns mode)")
    data = hosts.data_dir / "train.bin"
    data.write_bytes(bytes(range(256)) * 40)
    hostfile = hosts.hostfile(tmp_path / "hostfile", slots=2)
    try:
        doctor = _bunsan(hosts, tmp_path, "doctor", "--hostfile", str(hostfile), "--data", str(data))
        out, err = doctor.communicate(timeout=100)
    finally:
        data.unlink()
    assert doctor.returncode == 1, out + err
    table = out.splitlines()
    header, first, second = table[0].split(), table[1], table[2]
    assert header == ["host", "ssh", "python", "torch", "bunsan", "data", "port", "29500", "all-reduce"]
    assert first.startswith(hosts.names[0]) and "10.0 KB sha256" in first and "!" not in first, out
    assert second.startswith(hosts.names[1]) and "MISSING!" in second, out
    assert " ok " in first and " ok " in second, out  # the all-reduce across both hosts worked
    assert f"{hosts.names[1]}: data path {data} is missing" in out
    assert "1 problem(s)" in out

    # Where everything is in order, the doctor says so and exits 0.
    doctor = _bunsan(
        hosts, tmp_path, "doctor", "--hostfile", str(hostfile), "--data", str(hostfile), "--skip-allreduce"
    )
    out, err = doctor.communicate(timeout=60)
    assert doctor.returncode == 0, out + err
    assert "all 2 host(s) ok" in out
