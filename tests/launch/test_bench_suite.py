"""``bunsan bench throughput`` and ``bunsan bench comm`` with real jobs, and the shaped network (root only).

Each job starts interpreters and imports torch: 2-4 s on a 2-core machine,
so every test here runs as few and as small jobs as its claim needs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from bunsan.bench import netns
from bunsan.cli import main

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces and tc need root and iproute2",
)


def _ours(namespaces):
    return {n for n in namespaces if n.startswith(f"{netns.PREFIX}-")}


def _left_behind(before):
    """bunsan namespaces that appeared since ``before`` and whose launcher is gone.

    Another bunsan job running beside the suite (a benchmark campaign) may
    create namespaces while a test runs, and a launcher's start removes those
    that killed launchers left (``remove_stale``): neither is this test's
    leftover. What this test leaves is a namespace that was not there before
    and outlives the launcher that made it.
    """
    left = set()
    for name in _ours(netns.list_namespaces()) - before:
        pid = int(name.split("-")[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            left.add(name)
    return left


@pytest.mark.timeout(120)
def test_throughput_at_one_and_two_workers(tmp_path, capsys):
    out = tmp_path / "throughput"
    code = main(
        [
            "bench",
            "throughput",
            "--model",
            "mlp",
            "--image-size",
            "8",
            "-np",
            "1,2",
            "--batch",
            "8",
            "--warmup",
            "1",
            "--iters",
            "3",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    record = json.loads((out / "throughput.json").read_text())
    one, two = record["configs"]
    assert (one["workers"], two["workers"]) == (1, 2) and one["status"] == two["status"] == "ok"
    assert len(two["times_s"]) == 2 and all(len(t) == 3 for t in two["times_s"])
    assert one["efficiency"] == 1.0
    assert two["efficiency"] == pytest.approx(two["total_mean"] / (2 * one["total_mean"]))
    assert two["total_mean"] == pytest.approx(2 * two["per_worker_mean"])
    # exact data parallel all-reduces every gradient each step: 2 (n-1)/n x 4 bytes x parameters,
    # plus a few bytes of metadata (sample counts) that ride along
    assert one["bytes_sent_per_step"] == 0
    assert 4 * two["parameters"] <= two["bytes_sent_per_step"] < 4 * two["parameters"] + 64
    assert "efficiency" in printed and (out / "plots" / "throughput.png").stat().st_size > 0


@needs_root
@pytest.mark.timeout(120)
def test_a_shaped_link_is_slower_than_loopback_and_nothing_is_left(tmp_path, capsys):
    before = _ours(netns.list_namespaces())
    results = {}
    for name, extra in (("loopback", []), ("shaped", ["--network", "rate=100mbit"])):
        out = tmp_path / name
        code = main(
            [
                "bench",
                "comm",
                "-np",
                "2",
                "--sizes",
                "1MB",
                "--ops",
                "all_reduce",
                "--iters",
                "3",
                "--warmup",
                "1",
                "--rounds",
                "1",
                "--no-plots",
                "--out",
                str(out),
                *extra,
            ]
        )
        assert code == 0, capsys.readouterr()
        (row,) = json.loads((out / "comm.json").read_text())["rows"]
        results[name] = row["torch_busbw"]
    # 100 Mbit/s is 0.0125 GB/s; loopback moved about 1 GB/s here
    assert results["shaped"] < 1.1 * 100e6 / 8
    assert results["loopback"] > 5 * results["shaped"]
    assert _left_behind(before) == set()


@needs_root
@pytest.mark.timeout(60)
def test_a_failing_worker_ends_the_shaped_job_with_its_code(tmp_path):
    before = _ours(netns.list_namespaces())
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n")
    assert netns.main(["--network", "rate=1gbit", "-np", "2", "--", sys.executable, str(script)]) == 3
    assert _left_behind(before) == set()
