"""What the benchmarks share (bunsan.bench._common, specs, synthetic): the job loop, option checks, tables, records."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

import pytest

from bunsan.bench import _common, synthetic
from bunsan.bench.job import JobSpec

# A stand-in job (no torch): argv[1] is the result path; "fail" in argv[2] makes it exit 3 after a stderr line.
_FAKE_JOB = textwrap.dedent("""
    import json, sys
    if sys.argv[2] == "fail":
        print("worker blew up", file=sys.stderr)
        sys.exit(3)
    json.dump({"value": int(sys.argv[2])}, open(sys.argv[1], "w"))
""")


def _job(tmp_path: Path, label: str, argument: str) -> tuple[dict, object]:
    record = {"label": label, "workers": 2, "dir": str(_common.job_directory(tmp_path, 2, label))}
    return record, lambda result: [sys.executable, "-c", _FAKE_JOB, str(result), argument]


def test_run_jobs_runs_every_job_and_a_failure_is_a_record(tmp_path):
    jobs = [_job(tmp_path, "a:x=1", "7"), _job(tmp_path, "b", "fail"), _job(tmp_path, "c", "9")]
    said: list[str] = []
    records, interrupted = _common.run_jobs(
        jobs,
        30.0,
        _common.job_environment(1),
        on_result=lambda record, result: record.update(value=result["value"]),
        progress=lambda record: record["status"],
        say=said.append,
    )
    assert not interrupted
    assert [(r["label"], r["status"], r.get("value")) for r in records] == [
        ("a:x=1", "ok", 7),
        ("b", "failed", None),
        ("c", "ok", 9),
    ]
    assert records[1]["exit_code"] == 3 and "worker blew up" in records[1]["stderr_tail"]
    assert said == ["[1/3] a:x=1 -np 2: ok", "[2/3] b -np 2: failed", "[3/3] c -np 2: ok"]
    assert Path(records[0]["dir"]) == tmp_path / "np2-a_x_1"  # job_directory: OUT/npN-SLUG


def test_run_jobs_stops_at_ctrl_c_and_keeps_what_finished(tmp_path, monkeypatch):
    calls = []

    def fake(command, directory, result_path, record, timeout_s, env):
        calls.append(record["label"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        record.update(status="ok")
        return {"value": 1}

    monkeypatch.setattr(_common, "run_recorded_job", fake)
    said: list[str] = []
    jobs = [_job(tmp_path, name, "1") for name in ("a", "b", "c")]
    records, interrupted = _common.run_jobs(
        jobs, 30.0, {}, on_result=lambda record, result: None, progress=lambda record: "", say=said.append
    )
    assert interrupted and calls == ["a", "b"] and [r["label"] for r in records] == ["a"]
    assert said[-1] == "interrupted during job 2 of 3; the table holds the jobs that finished"


def test_run_jobs_never_reports_a_previous_runs_result(tmp_path):
    record, command = _job(tmp_path, "a", "fail")
    stale = Path(record["dir"]) / "result.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"value": 5}')
    records, _ = _common.run_jobs(
        [(record, command)], 30.0, {}, on_result=lambda r, res: r.update(value=5), progress=str, say=lambda s: None
    )
    assert records[0]["status"] == "failed" and "value" not in records[0] and not stale.exists()


def test_say_jobs_prints_each_command_with_its_result_path(tmp_path):
    said: list[str] = []
    assert _common.say_jobs([_job(tmp_path, "a", "1")], said.append) == 0
    assert len(said) == 1 and str(tmp_path / "np2-a" / "result.json") in said[0]


def test_job_command_runs_this_python_under_bunsan_run():
    command = _common.job_command("bunsan.bench.job", "--spec", {"epochs": 1}, 4)
    assert command[:6] == [sys.executable, "-m", "bunsan", "run", "-np", "4"]
    assert command[6:] == ["--", sys.executable, "-u", "-m", "bunsan.bench.job", "--spec", '{"epochs": 1}']


def test_job_environment_sets_threads_and_drops_our_worker_count(monkeypatch):
    monkeypatch.setenv("BUNSAN_NPROC", "8")
    env = _common.job_environment(2)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2" and "BUNSAN_NPROC" not in env


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "--iters must be an int >= 1, got 0"),
        (1.5, TypeError, "--iters must be an int >= 1, got 1.5"),
        (True, TypeError, "--iters must be an int >= 1, got True"),
    ],
)
def test_check_at_least_follows_the_one_rule(value, error, message):
    with pytest.raises(error, match=f"^{message}$"):
        _common.check_at_least(("--warmup", 0, 0), ("--iters", value, 1))


def test_check_positive_refuses_zero_and_non_numbers():
    _common.check_positive("--lr", 0.1)
    with pytest.raises(ValueError, match="--lr must be a number > 0"):
        _common.check_positive("--lr", 0.0)
    with pytest.raises(TypeError, match="--timeout-s"):
        _common.check_positive("--timeout-s", "10")


def test_format_records_takes_templates_and_functions():
    records = [{"name": "a", "ms": 1.25, "bytes": 2048}, {"name": "longer", "ms": 10.0, "bytes": 0}]
    text = _common.format_records(
        records, [("name", "{name}"), ("ms", "{ms:.1f}"), ("KiB", lambda r: f"{r['bytes'] / 1024:.1f}")]
    )
    assert text.splitlines() == [
        "name      ms  KiB",
        "------  ----  ---",
        "a        1.2  2.0",
        "longer  10.0  0.0",
    ]
    assert _common.format_records(records[:1], [("ms", "{ms:.2f}")], left=0).splitlines()[2] == "1.25"


def test_write_record_goes_to_json_or_out(tmp_path):
    said: list[str] = []
    document = {"benchmark": "comm", "rows": [1]}
    default = _common.write_record(argparse.Namespace(json=None), tmp_path / "out", document, said.append)
    assert default == tmp_path / "out" / "comm.json" and json.loads(default.read_text()) == document
    chosen = _common.write_record(argparse.Namespace(json=str(tmp_path / "x.json")), tmp_path, document, said.append)
    assert chosen == tmp_path / "x.json" and said == [f"JSON: {default}", f"JSON: {chosen}"]


def test_time_steps_runs_one_optimizer_step_per_batch():
    import torch

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    steps = []
    optimizer.register_step_post_hook(lambda *args: steps.append(1))
    batch = (torch.ones(4, 3), torch.zeros(4, dtype=torch.long))
    seconds = synthetic.time_steps(model, optimizer, [batch] * 3)
    assert seconds > 0 and len(steps) == 3 and not torch.equal(model.weight, before)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [("epochs", 0, ValueError), ("epochs", 1.5, TypeError), ("lr", 0.0, ValueError), ("options", [], TypeError)],
)
def test_job_spec_checks_by_the_one_rule(field, value, error):
    with pytest.raises(error, match=field):
        JobSpec(**{field: value})


def test_recomputed_batch_norm_statistics_are_the_training_sets_on_a_copy():
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from bunsan.bench.job import spec_from_args, with_recomputed_bn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    with torch.no_grad():  # running statistics far from the data's, as after a lagging average
        model[1].running_mean.fill_(5.0)
        model[1].running_var.fill_(9.0)
    model.eval()
    data = TensorDataset(torch.randn(64, 3), torch.zeros(64, dtype=torch.long))
    state = torch.random.get_rng_state()
    copied = with_recomputed_bn(model, data, batch=32)
    assert torch.equal(torch.random.get_rng_state(), state)  # the dropout's draws were undone
    assert copied is not model and not model.training and model[1].running_mean.eq(5.0).all()
    # two equal batches: the cumulative average of their means and unbiased variances
    with torch.no_grad():
        h = model[0](data.tensors[0])
    halves = h[:32], h[32:]
    torch.testing.assert_close(copied[1].running_mean, sum(x.mean(0) for x in halves) / 2)
    torch.testing.assert_close(copied[1].running_var, sum(x.var(0) for x in halves) / 2)
    torch.testing.assert_close(copied[0].weight, model[0].weight)  # only the statistics change
    # no batch norm: the model itself, nothing copied
    plain = nn.Linear(3, 2)
    assert with_recomputed_bn(plain, data, batch=32) is plain
    assert spec_from_args(["--recompute-bn"]).recompute_bn and not spec_from_args([]).recompute_bn


def test_compare_passes_recompute_bn_to_every_job(tmp_path):
    from bunsan.bench.compare import _job_spec
    from bunsan.bench.specs import parse_algorithm_spec

    args = argparse.Namespace(
        model="resnet20",
        dataset="digits32",
        epochs=1,
        batch=64,
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,
        seed=0,
        no_curves=False,
        recompute_bn=True,
    )
    spec = _job_spec(args, parse_algorithm_spec("data_parallel"), tmp_path / "r.json", 2)
    assert spec["recompute_bn"] is True and JobSpec(**{k: v for k, v in spec.items()}).recompute_bn
