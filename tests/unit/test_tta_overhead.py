"""docs/experiments/tta_overhead.py: the figures docs/experiments/plan.md quotes for run 8, on a hand-made record."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.records import compare_config as _config

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "tta_overhead.py"


def _run(tmp_path, *options):
    command = [sys.executable, str(SCRIPT), str(tmp_path / "*" / "compare.json"), *options]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout


def test_ratio_first_epoch_excess_and_ratio_without_it(tmp_path):
    record = tmp_path / "digits_cnn-loopback"
    auto_dir = record / "np2-auto_risk_high"
    auto_dir.mkdir(parents=True)
    (auto_dir / "stdout.txt").write_text("[bunsan] Auto at step 4, 2 workers: ...; measured and decided in 0.30 s\n")
    configs = [
        # exact ends at 5%: the target is 6%
        _config("data_parallel", [0.20, 0.10, 0.05], [1.0, 2.0, 3.0], record / "np2-data_parallel"),
        # the best fixed setting: 6% in epoch 2, at 1.0 s
        _config("model_averaging:block_size=1024", [0.20, 0.06, 0.05], [0.5, 1.0, 1.5], record / "np2-ma"),
        # auto: first epoch 0.4 s longer; the target in epoch 2, at 1.5 s
        _config("auto:risk=high", [0.30, 0.06, 0.05], [0.9, 1.5, 2.1], auto_dir),
        # auto's twin: the same curve, each epoch 0.2 s sooner
        _config("model_averaging:warm_start=1", [0.30, 0.06, 0.05], [0.7, 1.3, 1.9], record / "np2-twin"),
    ]
    (record / "compare.json").write_text(json.dumps({"arguments": {"model": "digits_cnn"}, "configs": configs}))
    out = _run(tmp_path)
    row = next(line for line in out.splitlines() if line.startswith("digits_cnn-loopback"))
    # auto 1.50 s, best 1.00 s, ratio 1.50, decided in 0.30 s, excess 0.9 - 0.5 = 0.40 s, (1.5 - 0.4) / 1.0
    assert row.split()[1:] == ["2", "1.50", "1.00", "1.50", "0.30", "0.40", "1.10", "2/2", "no"]
    median = next(line for line in out.splitlines() if line.startswith("digits_cnn ") and "loopback" in line)
    assert median.split() == ["digits_cnn", "loopback", "2", "1", "1.50", "0.40", "1.10"]
    # against exact instead: the target in its epoch 3, at 3.0 s; excess 0.9 - 1.0; (1.5 + 0.1) / 3.0
    out = _run(tmp_path, "--against", "data_parallel")
    row = next(line for line in out.splitlines() if line.startswith("digits_cnn-loopback"))
    assert row.split()[1:] == ["2", "1.50", "3.00", "0.50", "0.30", "-0.10", "0.53", "2/3", "no"]
    # against the twin: the same curve; 1.5 / 1.3, excess 0.2, (1.5 - 0.2) / 1.3
    row = next(
        line for line in _run(tmp_path, "--against", "model_averaging:warm_start=1").splitlines() if "loopback" in line
    )
    assert row.split()[1:] == ["2", "1.50", "1.30", "1.15", "0.30", "0.20", "1.00", "2/2", "yes"]
    # a setting the record does not have: one sentence, not an empty table
    failed = subprocess.run(
        [sys.executable, str(SCRIPT), str(record / "compare.json"), "--against", "exact"],
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 2 and "has no setting 'exact'" in failed.stderr
