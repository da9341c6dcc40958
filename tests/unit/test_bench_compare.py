"""``bunsan bench compare`` without jobs: spec parsing, sweeps, speed ratios, the table, plots."""

from __future__ import annotations

import pytest

from bunsan.bench import compare, plots
from bunsan.bench.compare import AlgorithmSetting, Sweep
from bunsan.cli import main


# -- values and specs -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1024", 1024),
        ("-3", -3),
        ("0.5", 0.5),
        ("1e-3", 1e-3),
        ("true", True),
        ("False", False),
        ("none", None),
        ("null", None),
        ("fp16", "fp16"),
        ("'32'", "32"),
        (" 7 ", 7),
    ],
)
def test_parse_value_reads_int_float_bool_none_and_str(text, value):
    parsed = compare.parse_value(text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("value", [1024, 0.25, True, False, None, "fp16", "32", "true"])
def test_format_value_reads_back(value):
    assert compare.parse_value(compare.format_value(value)) == value


def test_spec_without_options():
    assert compare.parse_algorithm_spec("data_parallel") == AlgorithmSetting("data_parallel", {})


def test_spec_with_options_keeps_their_order_and_types():
    setting = compare.parse_algorithm_spec("data_parallel:bits=1,warm_start=8000,compression=none")
    assert setting.name == "data_parallel"
    assert list(setting.options.items()) == [("bits", 1), ("warm_start", 8000), ("compression", None)]
    assert setting.label == "data_parallel:bits=1,warm_start=8000,compression=none"
    assert compare.parse_algorithm_spec(setting.label) == setting


def test_spec_with_float_and_bool():
    setting = compare.parse_algorithm_spec("block_momentum: block_size=256, block_learning_rate=0.5, nesterov=false")
    assert setting.options == {"block_size": 256, "block_learning_rate": 0.5, "nesterov": False}


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("", "does not start with an algorithm name"),
        (":bits=1", "does not start with an algorithm name"),
        ("data parallel", "does not start with an algorithm name"),
        ("data_parallel:", "nothing after ':'"),
        ("data_parallel:bits", "is not KEY=VALUE"),
        ("data_parallel:bits=", "is not KEY=VALUE"),
        ("data_parallel:bits=1,,warm_start=2", "is not KEY=VALUE"),
        ("data_parallel:bits=1,bits=2", "sets 'bits' twice"),
    ],
)
def test_bad_specs_are_one_sentence(spec, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        compare.parse_algorithm_spec(spec)
    assert "\n" not in str(info.value)


# -- sweeps -------------------------------------------------------------------------------
def test_parse_sweep_with_and_without_target():
    assert compare.parse_sweep("warm_start=0,2000,8000") == Sweep("warm_start", (0, 2000, 8000), None)
    assert compare.parse_sweep("block_momentum:block_size=256,1024") == Sweep(
        "block_size", (256, 1024), "block_momentum"
    )


@pytest.mark.parametrize("text", ["warm_start", "=1,2", "warm_start=1,,2", "warm_start=1,1", "a b:x=1"])
def test_bad_sweeps(text):
    with pytest.raises(ValueError, match="--sweep"):
        compare.parse_sweep(text)


def test_untargeted_sweep_expands_every_setting_in_order():
    settings = [AlgorithmSetting("data_parallel", {"bits": 1}), AlgorithmSetting("model_averaging", {"block_size": 64})]
    expanded = compare.apply_sweeps(settings, [compare.parse_sweep("warm_start=0,2000")])
    assert [s.label for s in expanded] == [
        "data_parallel:bits=1,warm_start=0",
        "data_parallel:bits=1,warm_start=2000",
        "model_averaging:block_size=64,warm_start=0",
        "model_averaging:block_size=64,warm_start=2000",
    ]


def test_targeted_sweeps_cross_and_leave_others_alone():
    settings = [AlgorithmSetting("data_parallel"), AlgorithmSetting("block_momentum", {"block_size": 256})]
    sweeps = [
        compare.parse_sweep("block_momentum:warm_start=0,100"),
        compare.parse_sweep("block_momentum:block_learning_rate=0.5,1.0"),
    ]
    labels = [s.label for s in compare.apply_sweeps(settings, sweeps)]
    assert labels == [
        "data_parallel",
        "block_momentum:block_size=256,warm_start=0,block_learning_rate=0.5",
        "block_momentum:block_size=256,warm_start=0,block_learning_rate=1.0",
        "block_momentum:block_size=256,warm_start=100,block_learning_rate=0.5",
        "block_momentum:block_size=256,warm_start=100,block_learning_rate=1.0",
    ]


def test_sweep_conflicts_and_unmatched_targets_are_refused():
    settings = [AlgorithmSetting("data_parallel", {"warm_start": 8000})]
    with pytest.raises(ValueError, match="both set 'warm_start'"):
        compare.apply_sweeps(settings, [compare.parse_sweep("warm_start=0,1")])
    with pytest.raises(ValueError, match="not in --algorithms"):
        compare.apply_sweeps(settings, [compare.parse_sweep("block_momentum:block_size=1,2")])


def test_equal_settings_run_once():
    settings = [AlgorithmSetting("data_parallel"), AlgorithmSetting("data_parallel")]
    assert compare.apply_sweeps(settings, []) == [AlgorithmSetting("data_parallel")]


# -- workers, batch, ratios -----------------------------------------------------------------
def test_parse_workers_keeps_order_once():
    assert compare.parse_workers("1,2,4") == [1, 2, 4]
    assert compare.parse_workers("4, 2,4") == [4, 2]


@pytest.mark.parametrize("text", ["0", "1,x", "", "1,-2", "2.5"])
def test_bad_worker_counts(text):
    with pytest.raises(ValueError, match="-np"):
        compare.parse_workers(text)


def test_per_worker_batch_splits_the_global_batch():
    assert [compare.per_worker_batch(128, n) for n in (1, 2, 4)] == [128, 64, 32]
    with pytest.raises(ValueError, match="does not split evenly over 3 workers"):
        compare.per_worker_batch(64, 3)


def test_reference_is_one_worker_or_the_first_given():
    assert compare.reference_workers([4, 1, 2]) == 1
    assert compare.reference_workers([4, 2]) == 4


def test_speed_ratio_is_reference_time_over_time_of_the_same_setting():
    rows = [("a", 1, 100.0), ("b", 1, 50.0), ("a", 2, 40.0), ("b", 2, 100.0), ("a", 4, 25.0), ("b", 4, None)]
    assert compare.speed_ratios(rows, reference=1) == [1.0, 1.0, 2.5, 0.5, 4.0, None]


def test_speed_ratio_without_a_reference_time_is_unknown():
    rows = [("a", 2, None), ("a", 4, 10.0), ("b", 2, 30.0), ("b", 4, 10.0)]
    assert compare.speed_ratios(rows, reference=2) == [None, None, 1.0, 3.0]


def test_speedup_vs_first_compares_settings_at_the_same_count():
    rows = [("a", 1, 10.0), ("b", 1, 5.0), ("a", 4, 8.0), ("b", 4, 2.0), ("c", 4, None)]
    assert compare.speedups_vs_first(rows, "a") == [1.0, 2.0, 1.0, 4.0, None]
    assert compare.speedups_vs_first([("a", 2, None), ("b", 2, 3.0)], "a") == [None, None]


# -- the table ----------------------------------------------------------------------------
def _record(label="data_parallel", workers=1, wall_s=10.0, **extra):
    record = {
        "label": label,
        "algorithm": label.split(":")[0],
        "options": {},
        "workers": workers,
        "epochs": 3,
        "status": "ok",
        "wall_s": wall_s,
        "speed_ratio": 1.0,
        "test_error": 0.1234,
        "bits": 32,
        "compression": None,
        "warm_start": 0,
        "block_size": None,
        "bytes_sent_per_sample": 12.5,
        "samples_per_s": 1234.4,
        "speedup_vs_first": 1.5,
    }
    record.update(extra)
    return record


def test_table_rows_format_numbers_and_failures():
    ok = _record(workers=2, wall_s=12.345, speed_ratio=0.8123)
    fp16 = _record(label="data_parallel:compression=fp16", compression="fp16")
    blocks = _record(label="block_momentum:block_size=256", bits=None, block_size=256)
    failed = _record(workers=4, status="timeout", wall_s=None, speed_ratio=None, test_error=None)
    rows = compare.table_rows([ok, fp16, blocks, failed])
    assert rows[0] == ["2", "data_parallel", "32", "0", "-", "3", "12.3", "0.81", "1.50", "12.34", "12.5", "1234"]
    assert rows[1][2] == "fp16"
    assert rows[2][2:5] == ["-", "0", "256"]
    assert rows[3][6:] == ["timeout", "-", "-", "-", "-", "-"]


def test_format_table_aligns_columns():
    text = compare.format_table(["name", "n"], [["a", "1"], ["longer", "100"]], right=["n"])
    assert text.splitlines() == ["name      n", "------  ---", "a         1", "longer  100"]


def test_transposed_table_has_one_column_per_run():
    rows = compare.table_rows([_record(), _record(workers=2, wall_s=5.0, speed_ratio=2.0)])
    lines = compare.format_transposed(compare.COLUMNS, rows).splitlines()
    assert lines[0].split() == ["workers", "1", "2"]
    assert len(lines) == len(compare.COLUMNS) + 1  # the header line, the rule, one line per other quantity
    speed = next(line for line in lines if line.startswith("speed"))
    assert speed.split()[-2:] == ["1.00", "2.00"]


# -- checking settings before any job -----------------------------------------------------
def test_check_setting_describes_the_columns():
    described = compare.check_setting(AlgorithmSetting("block_momentum", {"block_size": 1024}))
    assert described["block_size"] == 1024 and described["warm_start"] == 0 and described["bits"] is None
    described = compare.check_setting(AlgorithmSetting("data_parallel", {"compression": "fp16"}))
    assert described["bits"] == 32 and described["compression"] == "fp16" and described["block_size"] is None


@pytest.mark.parametrize(
    ("setting", "fragment"),
    [
        (AlgorithmSetting("sgd_of_dreams"), "unknown algorithm 'sgd_of_dreams'; choose one of"),
        (AlgorithmSetting("model_averaging", {"block_size": 64, "period": 2}), "has no option 'period'"),
        (AlgorithmSetting("model_averaging", {"block_size": 64, "group": 2}), "has no option 'group'"),
        (AlgorithmSetting("block_momentum", {"block_size": 0}), "block_size must be an int >= 1"),
        (AlgorithmSetting("data_parallel", {"bits": 0}), "bits"),
    ],
)
def test_check_setting_refuses_with_one_sentence(setting, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        compare.check_setting(setting)
    assert str(info.value).startswith(f"algorithm spec {setting.label!r}")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--algorithms", "nope"], "unknown algorithm 'nope'"),
        (["--algorithms", "data_parallel:bits"], "is not KEY=VALUE"),
        (["-np", "1,3", "--batch", "64"], "does not split evenly over 3 workers; choose a multiple of 3"),
        (["--model", "resnet9000"], "unknown model 'resnet9000'"),
        (["--dataset", "imagenet"], "unknown data set 'imagenet'"),
        (["--epochs", "0"], "--epochs must be an int >= 1"),
    ],
)
def test_bad_input_fails_before_any_job(argv, fragment, tmp_path, capsys):
    assert main(["bench", "compare", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bunsan bench compare: error: ") and fragment in err and "\n" not in err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_bench_needs_a_benchmark(capsys):
    assert main(["bench"]) == 2
    assert "bunsan bench: error:" in capsys.readouterr().err


def test_dry_run_prints_one_job_per_setting_and_count(tmp_path, capsys):
    code = main(
        [
            "bench",
            "compare",
            "--dry-run",
            "--dataset",
            "digits",
            "--model",
            "digits_cnn",
            "-np",
            "1,2",
            "--algorithms",
            "data_parallel",
            "model_averaging:block_size=64",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    assert "-np 1 --" in lines[0] and "-np 2 --" in lines[-1] and "bunsan.bench.job" in lines[0]


# -- plots --------------------------------------------------------------------------------
def test_sweep_groups_hold_records_that_differ_only_in_the_key():
    records = [
        _record("block_momentum:block_size=256", 4, options={"block_size": 256}, block_size=256),
        _record("block_momentum:block_size=1024", 4, options={"block_size": 1024}, block_size=1024),
        _record(
            "block_momentum:block_size=1024,nesterov=false",
            4,
            options={"block_size": 1024, "nesterov": False},
            block_size=1024,
        ),
        _record("data_parallel", 4),
    ]
    for r in records[:3]:
        r["algorithm"] = "block_momentum"
    groups = plots.sweep_groups(records, "block_size")
    assert list(groups) == ["block_momentum -np 4"]
    assert [r["block_size"] for r in groups["block_momentum -np 4"]] == [256, 1024]
    assert plots.sweep_groups(records, "warm_start") == {}


def test_plot_compare_writes_what_the_records_support(tmp_path):
    records = [_record(workers=n, wall_s=10.0 / n, test_error_curve=[0.5, 0.3]) for n in (1, 2)]
    records += [
        _record(f"data_parallel:warm_start={w}", 2, options={"warm_start": w}, warm_start=w) for w in (0, 100, 1000)
    ]
    written = plots.plot_compare(records, tmp_path)
    assert sorted(p.name for p in written) == ["curves.png", "scaling.png", "sweep_warm_start.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)


# -- the job's own command line ----------------------------------------------------------
def test_job_spec_from_json_and_flags():
    from bunsan.bench import job

    spec = job.spec_from_args(
        [
            "--spec",
            '{"model": "mlp", "dataset": "digits", "epochs": 3, "batch": 32}',
            "--algorithm",
            "block_momentum:block_size=64,nesterov=false",
            "--epochs",
            "5",
        ]
    )
    assert (spec.model, spec.dataset, spec.epochs, spec.batch) == ("mlp", "digits", 5, 32)
    assert (spec.algorithm, spec.options) == ("block_momentum", {"block_size": 64, "nesterov": False})


@pytest.mark.parametrize(
    "argv", [["--spec", "[1]"], ["--spec", '{"epochz": 1}'], ["--epochs", "0"], ["--algorithm", "x:y"]]
)
def test_job_refuses_bad_specs(argv):
    from bunsan.bench import job

    with pytest.raises(SystemExit):
        job.spec_from_args(argv)


@pytest.mark.parametrize(
    ("name", "dataset", "shape", "arguments"),
    [
        ("mlp", "digits", (2, 1, 8, 8), {"in_features": 64, "out_features": 10}),
        ("digits_cnn", "digits", (2, 1, 8, 8), {"num_classes": 10}),
        ("mnist1d_cnn", "mnist1d", (2, 1, 40), {"num_classes": 10, "length": 40}),
        ("mlp", "mnist1d", (2, 1, 40), {"in_features": 40, "out_features": 10}),
    ],
)
def test_build_model_sizes_the_model_for_its_data(name, dataset, shape, arguments):
    import torch

    from bunsan import datasets, models
    from bunsan.bench import job

    torch.manual_seed(0)
    model = job.build_model(name, datasets.info(dataset))
    assert model(torch.zeros(shape)).shape == (2, 10)
    torch.manual_seed(0)
    direct = models.create(name, **arguments)
    # The same weights as a direct build from the same seed: finding the arguments used no randomness.
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), direct.parameters()))
