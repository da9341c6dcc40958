"""``bunsan bench compare`` with real jobs: one tiny comparison, and failing or hanging jobs.

The real comparison starts four ``bunsan run`` jobs (1 and 2 workers x two
algorithms), a few seconds each on a 2-core machine: the interpreter, ``import
torch`` and the rendezvous dominate one epoch of digits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bunsan.bench import compare
from bunsan.cli import main


@pytest.mark.timeout(180)
def test_one_invocation_runs_every_setting_at_every_count(tmp_path, capsys):
    out = tmp_path / "compare"
    code = main(
        [
            "bench",
            "compare",
            "--model",
            "digits_cnn",
            "--dataset",
            "digits",
            "--epochs",
            "1",
            "--batch",
            "32",
            "--lr",
            "0.05",
            "-np",
            "1,2",
            "--out",
            str(out),
            "--algorithms",
            "data_parallel",
            "model_averaging:block_size=64",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    record = json.loads((out / "compare.json").read_text())
    configs = {(c["label"], c["workers"]): c for c in record["configs"]}
    assert sorted(configs) == [
        ("data_parallel", 1),
        ("data_parallel", 2),
        ("model_averaging:block_size=64", 1),
        ("model_averaging:block_size=64", 2),
    ]
    for (label, workers), c in configs.items():
        assert c["status"] == "ok" and c["replicas_equal"], (label, workers, c.get("stderr_tail"))
        assert c["per_worker_batch"] == 32 // workers
        assert 0.0 <= c["test_error"] < 0.9  # one epoch of digits: well above chance
        assert len(c["train_loss"]) == len(c["test_error_curve"]) == 1
        assert c["samples"] >= 1437  # the whole training split, padded to a multiple of the workers
        assert 0 < c["wall_s"] < c["total_s"]
        if workers == 1:
            assert c["speed_ratio"] == 1.0 and c["bytes_sent_per_sample"] == 0
        else:
            assert c["speed_ratio"] == pytest.approx(configs[(label, 1)]["wall_s"] / c["wall_s"])
            assert c["bytes_sent_per_sample"] > 0
    # Averaging once every 64 samples per worker sends far less than every 16-sample step.
    assert (
        configs[("model_averaging:block_size=64", 2)]["bytes_sent_per_sample"]
        < configs[("data_parallel", 2)]["bytes_sent_per_sample"]
    )
    assert record["machine"]["threads_per_worker"] == 1
    assert all(c["threads"] == 1 for c in record["configs"])
    table = printed[printed.index("workers  algorithm") :]
    assert len([line for line in table.splitlines() if line.lstrip().startswith(("1  ", "2  "))]) == 4
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["curves.png", "scaling.png"]


_FAKE_JOB = textwrap.dedent("""
    import json, sys
    spec, workers = json.loads(sys.argv[1]), int(sys.argv[2])
    if workers == 2:
        print("worker blew up: out of llamas", file=sys.stderr)
        sys.exit(3)
    json.dump({"wall_s": 2.0, "test_error": 0.25, "replicas_equal": True, "samples": 100,
               "samples_per_s": 50.0, "bytes_sent_per_sample": 0.0}, open(spec["out"], "w"))
""")


def test_a_failed_job_is_a_row_and_the_rest_go_on(tmp_path, capsys, monkeypatch):
    # The jobs are stand-ins (no torch): this checks the orchestration, not training.
    monkeypatch.setattr(
        compare,
        "_command",
        lambda workers, spec, network=None: [sys.executable, "-c", _FAKE_JOB, json.dumps(spec), str(workers)],
    )
    out = tmp_path / "compare"
    code = main(
        [
            "bench",
            "compare",
            "--model",
            "digits_cnn",
            "--dataset",
            "digits",
            "-np",
            "1,2,4",
            "--batch",
            "4",
            "--out",
            str(out),
            "--no-plots",
            "--algorithms",
            "data_parallel",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 1
    configs = json.loads((out / "compare.json").read_text())["configs"]
    assert [c["status"] for c in configs] == ["ok", "failed", "ok"]
    assert configs[1]["exit_code"] == 3 and "out of llamas" in configs[1]["stderr_tail"]
    assert [c["speed_ratio"] for c in configs] == [1.0, None, 1.0]
    assert "FAILED" in printed and "out of llamas" in printed
    assert (out / "np2-data_parallel" / "stderr.txt").read_text().strip() == "worker blew up: out of llamas"


def test_a_job_past_its_timeout_is_stopped(tmp_path):
    env = dict(os.environ)
    status, code, seconds = compare.run_job(
        [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, timeout_s=0.5, env=env
    )
    assert (status, code) == ("timeout", None)
    assert seconds < 15


def _alive(pid: int, mark: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return mark.encode() in f.read()  # not another process that got the pid since
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_benchmark_killed_mid_job_leaves_no_job_behind(tmp_path, sig):
    # A benchmark ended by kill, a scheduler's SIGTERM or SIGKILL: its running job gets SIGTERM too.
    pidfile = tmp_path / "job.pid"
    job = "import os, pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(120)"
    driver = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from bunsan.bench._common import run_job
        run_job([sys.executable, "-c", {job!r}, {str(pidfile)!r}], Path({str(tmp_path / "job")!r}), 120.0, dict(os.environ))
        """
    )
    bench = subprocess.Popen([sys.executable, "-c", driver])
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()):
            assert bench.poll() is None and time.monotonic() < deadline, "the job never started"
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        assert _alive(pid, str(pidfile))
        bench.send_signal(sig)
        bench.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(pid, str(pidfile)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid, str(pidfile)), "the job outlived its benchmark"
    finally:
        bench.kill()
        bench.wait()
        if pidfile.exists() and pidfile.read_text() and _alive(int(pidfile.read_text()), str(pidfile)):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
