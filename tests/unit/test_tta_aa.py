"""docs/experiments/tta_aa.py: a fixed setting run twice, its copy scored as Auto is, on hand-made records."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.records import compare_config

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "tta_aa.py"
MA, COPY = "model_averaging:block_size=1024", "model_averaging:block_size=1024,warm_start=0"


def _config(label, curve, ends, run_dir):
    return compare_config(label, curve, ends, run_dir, workers=4)


def _record(tmp_path, seed, ma_s, copy_s, auto_s, exact=(1.0, 2.0, 3.0)):
    """exact ends at 5%: the target is 6%; every other setting crosses it at the end of its second epoch."""
    record = tmp_path / f"mnist1d_cnn-rate_1gbit-s{seed}"
    record.mkdir(parents=True)
    configs = [
        _config("data_parallel", [0.20, 0.10, 0.05], list(exact), record / "np4-data_parallel"),
        _config(MA, [0.20, 0.06, 0.05], [ma_s / 2, ma_s, 1.5 * ma_s], record / "np4-ma"),
        _config(COPY, [0.20, 0.06, 0.05], [copy_s / 2, copy_s, 1.5 * copy_s], record / "np4-ma-copy"),
        _config("auto:risk=high", [0.20, 0.06, 0.05], [auto_s / 2, auto_s, 1.5 * auto_s], record / "np4-auto"),
    ]
    arguments = {"model": "mnist1d_cnn", "dataset": "mnist1d", "network": "rate=1gbit", "seed": seed}
    (record / "compare.json").write_text(json.dumps({"arguments": arguments, "configs": configs}))
    return record / "compare.json"


def _run(*arguments):
    command = [sys.executable, str(SCRIPT), "--of", MA, "--copy", COPY, *map(str, arguments)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_the_copy_is_scored_against_the_other_settings_as_auto_is(tmp_path):
    # seed 0: the copy 10% over its twin, Auto 20% over; seed 1: the copy 30% under its twin (then the best)
    records = [_record(tmp_path, 0, 1.0, 1.1, 1.2), _record(tmp_path, 1, 1.0, 0.7, 0.9)]
    done = _run(*records)
    assert done.returncode == 0, done.stderr
    row = done.stdout.splitlines()[1].split()
    assert row[:4] == ["rate=1gbit", "4", "2", MA]
    # medians over seeds: Auto 1.05 / MA 1.0; the copy 0.9 / 1.0 (the copy never counts among the fixed)
    assert row[4] == "1.05" and row[6] == "0.90"
    # held out: each seed's best picked on the other (MA at both): Auto 1.2 and 0.9, the copy 1.1 and 0.7
    assert row[5] == "1.05" and row[7] == "0.90"
    assert done.stdout.rstrip().endswith("0.70, 1.10 (0.90)")


def test_a_record_without_the_copy_is_refused(tmp_path):
    record = _record(tmp_path, 0, 1.0, 1.1, 1.2)
    document = json.loads(record.read_text())
    document["configs"] = [c for c in document["configs"] if c["label"] != COPY]
    record.write_text(json.dumps(document))
    done = _run(record)
    assert done.returncode == 2 and f"no {COPY!r} run" in done.stderr and "Traceback" not in done.stderr
