"""``bunsan bench peers`` with real jobs: one tiny run of five settings on loopback, bytes checked.

Five ``bunsan run`` jobs of 2 workers, one epoch of MNIST-1D each, a few seconds apiece on a 2-core
machine (the interpreter, ``import torch`` and the rendezvous dominate). Each setting's counted bytes
per step are checked against what torch's hooks send by their formulas
(:func:`bunsan.bench.peers_spec.expected_bytes_per_step`); bunsan's 1-bit hook against its warm-up and
a 32nd of the exact bytes.
"""

from __future__ import annotations

import json

import pytest

from bunsan.bench.peers_spec import expected_bytes_per_step, parse_setting
from bunsan.cli import main

SETTINGS = ["exact", "fp16", "powersgd:rank=1", "postlocal:period=4", "bunsan:bits=1"]


@pytest.mark.timeout(240)
def test_five_settings_side_by_side_with_counted_bytes(tmp_path, capsys):
    out = tmp_path / "peers"
    argv = ["bench", "peers", "-np", "2", "--epochs", "1", "--batch", "128", "--out", str(out), "--settings"]
    code = main([*argv, *SETTINGS])
    printed = capsys.readouterr().out
    assert code == 0, printed
    document = json.loads((out / "peers.json").read_text())
    runs = {c["label"]: c for c in document["configs"]}
    assert list(runs) == SETTINGS
    assert [row[1] for row in document["table"]] == SETTINGS
    for label in SETTINGS:
        assert f"loopback  {label}" in printed
        assert (
            out / "loopback" / "seed0" / f"np2-{label.replace(':', '_').replace('=', '_')}" / "result.json"
        ).is_file()
    exact = runs["exact"]
    shapes = [tuple(s) for s in exact["parameter_shapes"]]
    steps = exact["steps"]
    for label in SETTINGS[:4]:
        expected = expected_bytes_per_step(parse_setting(label), shapes, 2, steps)
        assert runs[label]["bytes_sent_per_step"] == pytest.approx(expected, rel=1e-9), label
    assert runs["powersgd:rank=1"]["buckets"] == 1
    warm = runs["bunsan:bits=1"]["warmup_steps"]
    assert warm == steps // 3
    exact_bytes = exact["bytes_sent_per_step"]
    lower = (warm * exact_bytes + (steps - warm) * exact_bytes / 32) / steps
    assert lower < runs["bunsan:bits=1"]["bytes_sent_per_step"] < 1.5 * lower
    assert all(c["replicas_equal"] for label, c in runs.items() if label != "postlocal:period=4")
    assert document["summary"][0]["target"] == pytest.approx(exact["test_error"] + 0.01)
