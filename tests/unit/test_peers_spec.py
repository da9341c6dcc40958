"""``bunsan bench peers``: the settings' syntax and checks, the bytes torch's hooks send, the table. Pure."""

from __future__ import annotations

import math

import pytest

from bunsan.bench import peers
from bunsan.bench.peers_spec import (
    expected_bytes_per_step,
    parse_seeds,
    parse_setting,
    powersgd_elements,
    powersgd_start,
)
from bunsan.bench.peers_table import summarize, table_cells


def test_settings_parse_with_bare_flags_and_read_back():
    s = parse_setting("powersgd:rank=2,batched")
    assert (s.kind, s.options, s.label) == ("powersgd", {"rank": 2, "batched": True}, "powersgd:rank=2,batched")
    assert parse_setting("exact").label == "exact"
    assert parse_setting(" bunsan-bmuf:period=8,block_momentum=0.5,nesterov=false ").options == {
        "period": 8,
        "block_momentum": 0.5,
        "nesterov": False,
    }
    assert parse_setting("postlocal:period=4").averages_models and not parse_setting("fp16").averages_models


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("powersgd", "needs rank=..."),
        ("topk:k=3", "unknown kind 'topk'"),
        ("powersgd:rank=0", "rank must be an integer >= 1"),
        ("powersgd:rank=1,start=1", "start must be an integer >= 2"),
        ("powersgd:rank=two", "rank must be an integer >= 1"),
        ("powersgd:rank=1,batched=3", "batched is a flag"),
        ("bunsan:bits=3.5", "bits must be 1..16"),
        ("bunsan:bits=17", "bits must be 1..16"),
        ("exact:bits=1", "exact takes no option 'bits' (its options: none)"),
        ("fp16:", "nothing after ':'"),
        ("postlocal:period=4,period=8", "sets 'period' twice"),
        ("postlocal:period=", "is not KEY=VALUE"),
        ("bunsan-bmuf:period=4,block_lr=-1", "block_lr must be a number >= 0"),
    ],
)
def test_bad_settings_are_refused_in_one_sentence(text, message):
    with pytest.raises(ValueError, match=r"setting|option") as info:
        parse_setting(text)
    assert message in str(info.value) and repr(text) in str(info.value)


def test_seeds():
    assert parse_seeds("0,1,2") == [0, 1, 2]
    for bad in ("", "1,,2", "-1", "1,1", "a"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


def test_powersgd_sends_p_and_q_of_the_matrices_worth_compressing():
    # [32, 96] at rank 1: 128 < 3072/2, compressed; [32] and [10, 2] stay (1-D, or not worth it)
    assert powersgd_elements([(32, 32, 3), (32,), (10, 2)], 1, batched=False) == 128 + 32 + 20
    assert powersgd_elements([(32, 32, 3)], 64, batched=False) == 32 * 96  # rank caps at 32; not worth it
    assert powersgd_elements([(32, 32, 3), (32,)], 2, batched=True) == 2 * math.ceil(math.sqrt(3104)) * 2
    assert powersgd_start(parse_setting("powersgd:rank=1"), 100) == 10
    assert powersgd_start(parse_setting("powersgd:rank=1"), 5) == 2
    assert powersgd_start(parse_setting("powersgd:rank=1,start=7"), 100) == 7


def test_expected_bytes_per_step():
    shapes = [(10, 160), (10,)]
    exact = 2 * 3 / 4 * 4 * 1610
    assert expected_bytes_per_step(parse_setting("exact"), shapes, 4, 30) == exact
    assert expected_bytes_per_step(parse_setting("fp16"), shapes, 4, 30) == exact / 2
    post = expected_bytes_per_step(parse_setting("postlocal:period=4,warmup=2"), shapes, 4, 30)
    assert post == pytest.approx((2 + 7) * exact / 30)  # averagings at steps 2, 6, ..., 26
    powersgd = expected_bytes_per_step(parse_setting("powersgd:rank=1"), shapes, 4, 30)
    assert powersgd == pytest.approx((3 * exact + 27 * 2 * 3 / 4 * 4 * (170 + 10)) / 30)
    assert expected_bytes_per_step(parse_setting("bunsan:bits=1"), shapes, 4, 30) is None


def _run(label, network, error, curve, ends, status="ok", seed=0):
    return {
        "label": label,
        "network": network,
        "seed": seed,
        "status": status,
        "test_error": error,
        "test_error_curve": curve,
        "epoch_end_s": ends,
        "bytes_sent_per_step": 100.0,
        "step_ms_median": 5.0,
    }


def test_summary_target_time_and_ratio_to_powersgd_best():
    records = [
        _run("exact", "loopback", 0.10, [0.3, 0.1], [1, 2]),
        _run("powersgd:rank=1", "loopback", 0.12, [0.3, 0.105], [2, 4]),
        _run("powersgd:rank=2", "loopback", 0.12, [0.3, 0.2], [1, 2]),
        _run("bunsan:bits=1", "loopback", 0.10, [0.11, 0.1], [1, 2]),
        _run("bunsan:bits=1", "loopback", 0.10, [0.11, 0.1], [3, 4], seed=1),
        _run("fp16", "loopback", None, None, None, status="failed"),
    ]
    rows = {r["label"]: r for r in summarize(records, 1.0)}
    assert rows["exact"]["target"] == pytest.approx(0.11)
    assert rows["powersgd:rank=1"]["tta_s"] == 4 and rows["powersgd:rank=2"]["tta_s"] is None
    assert rows["bunsan:bits=1"]["tta_s"] == 2 and rows["bunsan:bits=1"]["vs_powersgd"] == 0.5
    cells = {c[1]: c for c in table_cells(list(rows.values()))}
    assert cells["fp16"][2:] == ["0/1", "-", "-", "-", "not reached", "-"]
    assert cells["bunsan:bits=1"][2:] == ["2/2", "100", "5.0", "10.00", "2.0", "0.50"]


def test_bad_input_refused_before_any_job(tmp_path, capsys):
    args = ["--out", str(tmp_path), "--dry-run"]
    assert peers.main([*args, "--settings", "powersgd"]) == 2
    assert "needs rank=" in capsys.readouterr().err
    assert peers.main([*args, "-np", "3", "--batch", "128"]) == 2
    assert "does not split evenly" in capsys.readouterr().err
    assert peers.main([*args, "--settings", "exact", "exact"]) == 2
    assert "twice" in capsys.readouterr().err
