"""``tools/predict.py``, the cost model's validation harness: its parsing, its table and plot, its refusals, and one
tiny real run; and the lab notebook's scripts that price its records again."""

import importlib.util
import json
import math
import statistics
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest

from bunsan.cli import main
from bunsan.launch.hosts import usable_cores

# campaign tooling, not in the installed package: loaded from the checkout as its users run it
_spec = importlib.util.spec_from_file_location(
    "tools_predict", Path(__file__).resolve().parents[2] / "tools" / "predict.py"
)
assert _spec and _spec.loader
predict = sys.modules.setdefault("tools_predict", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(predict)
_spec = importlib.util.spec_from_file_location(
    "tools_tta_campaign", Path(__file__).resolve().parents[2] / "tools" / "tta_campaign.py"
)
assert _spec and _spec.loader
campaign = sys.modules.setdefault("tools_tta_campaign", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(campaign)


def test_parse_networks():
    assert predict.parse_networks("loopback,rate=1gbit,loopback") == [None, "rate=1gbit"]
    with pytest.raises(ValueError, match="rate"):
        predict.parse_networks("rate=fast")


def _row(**changes):
    row = {
        "network": "loopback",
        "workers": 2,
        "model": "digits_cnn",
        "label": "exact",
        "predicted_s": 0.011,
        "measured_s": 0.010,
        "error": 0.1,
        "predicted_bytes": 605_224.0,
        "measured_bytes": 605_224.0,
    }
    row.update(changes)
    return row


def test_table_and_plot(tmp_path):
    cells = predict.table_rows([_row(), _row(label="1-bit", predicted_s=0.02, error=-0.2)])
    assert cells[0] == ["loopback", "2", "digits_cnn", "exact", "11.00", "0.00", "10.00", "+10%", "-", "0.605", "0.605"]
    assert cells[1][7] == "-20%"
    # the rounds' own spread: the slowest round's job step over the fastest's (a record without them: -)
    assert predict.table_rows([_row(rounds_s=[0.010, 0.013, 0.011])])[0][8] == "1.30"
    assert predict.rounds_spread(_row(rounds_s=[0.010])) is None and predict.rounds_spread(_row()) is None
    assert predict.table_rows([_row(fixed_s=0.0015)])[0][5] == "1.50"
    png = predict.plot_predict([_row(), _row(network="rate=1gbit", measured_s=0.03)], tmp_path / "p.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_round_steps_lengthen_short_rounds_by_whole_multiples():
    # 8 steps of 2 ms are 16 ms: 63 times 8 steps last 1.008 s, 62 times 0.992 s
    assert predict.round_steps(0.002, 8, 1.0) == 504
    # steps that already fill the round, a round of 0 s, or no guess: exactly --steps
    assert predict.round_steps(0.2, 8, 1.0) == 8 and predict.round_steps(0.125, 8, 1.0) == 8
    assert predict.round_steps(0.002, 8, 0.0) == 8 and predict.round_steps(0.0, 8, 1.0) == 8
    assert predict.round_steps(0.1, 3, 1.0) == 12  # 9 steps are 0.9 s: one more multiple
    with pytest.raises(ValueError, match="steps"):
        predict.round_steps(0.01, 0, 1.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models", "vgg"], "--models"),
        (["-np", "1"], "2 or more workers"),
        (["--steps", "0"], "--steps"),
        (["--round-s", "-1"], "--round-s"),
        (["--round-s", "nan"], "--round-s"),
        (["--round-s", "inf"], "--round-s"),
        (["--networks", "rate=1gbit,delay=5ms"], "netem"),
    ],
)
def test_bad_input_exit_2(argv, message, capsys):
    assert predict.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.slow
def test_tiny_run_predicts_and_measures_every_algorithm(tmp_path, capsys):
    code = predict.main(
        [
            "--models",
            "mnist1d_cnn",
            "-np",
            "2",
            "--steps",
            "2",
            "--rounds",
            "2",
            "--compute-steps",
            "3",
            "--block-size",
            "64",
            "--round-s",
            "0.05",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0, capsys.readouterr()
    rows = json.loads((tmp_path / "predict.json").read_text())["rows"]
    assert {r["label"] for r in rows} == {
        "exact",
        "fp16",
        "8-bit",
        "1-bit",
        "block_momentum:64",
        "model_averaging:64",
        "async",
    }
    for r in rows:
        assert r["predicted_s"] > 0 and r["measured_s"] > 0
        # what async's model read: the 2 ranks over this machine's usable cores, and the copy's cost
        assert r["ranks_per_core"] == max(1.0, 2 / usable_cores()) and r["copy_s_per_element"] > 0, r
        assert len(r["rounds_s"]) == 2 and predict.rounds_spread(r) >= 1.0
        # rounds of whole multiples of --steps (a block of 64 samples is 2 steps of 32), lengthened
        # toward 50 ms (2 of this model's 1-5 ms steps never last it; the guess is one warm step's);
        # the compute's of its share of --compute-steps (3 // 2 rounds = 1)
        assert r["round_steps"] % 2 == 0 and r["round_steps"] > 2 and r["compute_round_steps"] > 1, r
        # the fixed costs timed in every round; the profile takes their median (of 2: the mean)
        # the wait of steps run free, and the row priced with that of steps started together
        assert r["straggler_s"] >= 0 and r["synced_straggler_s"] >= 0 and r["predicted_synced_straggler_s"] > 0, r
        assert len(r["fixed_rounds_s"]) == 2 and r["fixed_s"] == pytest.approx(sum(r["fixed_rounds_s"]) / 2), r
        # and again after a step of the compute (this model's is short): the row priced with those beside it
        assert len(r["fixed_filled_rounds_s"]) == 2 and r["predicted_filled_s"] > 0, r
        assert ("fixed_filled_remote_rounds_s" in r) == (r["label"] == "async"), r
        # bytes: counted by the algorithm, predicted by the arithmetic; the gradients' or parameters' bytes
        # exactly, plus the few metadata elements every exchange carries and the model leaves out (the
        # step's counts and each tensor's flag: 10 float32 = 40 bytes a step for this 8-tensor model, in
        # float64 beside fp16 traffic; 3 float64 a block; async's message header), and for the quantized
        # stripes their padding (approximated)
        if r["label"] in ("exact", "fp16", "block_momentum:64", "model_averaging:64", "async"):
            assert 0 <= r["measured_bytes"] - r["predicted_bytes"] <= 80, r
        elif r["label"] in ("8-bit", "1-bit"):
            assert r["measured_bytes"] == pytest.approx(r["predicted_bytes"], rel=0.15), r
        # a quantized row also as the model priced it with every codec call at the mean: another figure
        assert ("predicted_mean_call_s" in r) == (r["label"] in ("8-bit", "1-bit")), r
        if "predicted_mean_call_s" in r:
            assert r["predicted_mean_call_s"] > 0 and r["predicted_mean_call_s"] != r["predicted_s"]
        # each rank's own median step, whose N / sum(1 / step) is the job's median step; the row's
        # measured step is the mean of the rounds' job steps
        assert len(r["rank_steps_s"]) == 2 and min(r["rank_steps_s"]) > 0, r
        assert r["measured_median_s"] == pytest.approx(2 / sum(1 / s for s in r["rank_steps_s"])), r
        assert r["measured_s"] == pytest.approx(sum(r["rounds_s"]) / 2), r
        # priced round by round with the compute slice run just before the row's steps: the mean
        # of the rounds' (and their median beside it); the job's pooled profile's beside it
        assert len(r["compute_rounds_s"]) == 2 and min(r["compute_rounds_s"]) > 0, r
        assert r["predicted_s"] == pytest.approx(sum(r["predicted_rounds_s"]) / 2), r
        assert r["predicted_median_s"] == pytest.approx(statistics.median(r["predicted_rounds_s"])), r
        assert r["predicted_pooled_s"] > 0 and r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        # async also over a common window of time in every round, every rank stepping through it (its
        # own count): each round's job step, their mean, each rank's mean step
        assert ("window_s" in r) == (r["label"] == "async"), r
        if "window_s" in r:
            ranks = r["window_rank_rounds_s"]
            assert len(ranks) == 2 and all(len(each) == 2 and min(each) > 0 for each in ranks), r
            assert r["window_rounds_s"] == pytest.approx([2 / sum(1 / s for s in each) for each in ranks]), r
            assert r["window_s"] == pytest.approx(sum(r["window_rounds_s"]) / 2), r
            assert r["window_rank_steps_s"] == pytest.approx([(a + b) / 2 for a, b in zip(*ranks)]), r
            assert r["window_length_s"] >= 0.05, r
            # and each rank's first step of a round apart from the rest: the rounds' steps are those two
            first, later, count = r["first_rank_steps_s"], r["later_rank_steps_s"], r["round_steps"]
            assert len(first) == len(later) == 2 and min(first) > 0 and min(later) > 0, r
            expected = [(a + (count - 1) * b) / count for a, b in zip(first, later)]
            assert r["rank_steps_s"] == pytest.approx(expected), r  # 2 rounds: the median is the mean
        else:
            assert "first_rank_steps_s" not in r, r
    # the whole profile of every job's model is recorded: the rows price again to what they were
    data = json.loads((tmp_path / "predict.json").read_text())
    job = data["profiles"]["loopback-np2"]
    assert set(job["models"]) == {"mnist1d_cnn"} and job["network"]["bandwidth"] > 0
    # the link probed in every round (each round priced on its own), the median with the job's first
    record = job["models"]["mnist1d_cnn"]
    assert len(record["network_rounds"]) == 2 and min(n["bandwidth"] for n in record["network_rounds"]) > 0
    latencies = [job["network"]["latency_s"], *(n["latency_s"] for n in record["network_rounds"])]
    assert record["network"]["latency_s"] == pytest.approx(statistics.median(latencies))
    script = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "predict_reprice.py"
    spec = importlib.util.spec_from_file_location("predict_reprice", script)
    reprice = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reprice)
    for r in rows:
        assert reprice.reprice(r, job, 64) == pytest.approx(r["predicted_s"], rel=1e-9), r
        assert reprice.reprice(r, job, 64, medians=True) == pytest.approx(r["predicted_median_s"], rel=1e-9), r
        assert reprice.measured_of(r) == r["measured_s"] and reprice.measured_of(r, medians=True) == pytest.approx(
            r["measured_median_s"]
        )
        assert reprice.reprice(r, job, 64, "pooled") == pytest.approx(r["predicted_pooled_s"], rel=1e-9), r
        assert reprice.reprice(r, job, 64, "filled") == pytest.approx(r["predicted_filled_s"], rel=1e-9), r
        if r["label"] == "exact":  # a variant moves the straggler it prices with
            assert reprice.reprice(r, job, 64, "synced") == pytest.approx(r["predicted_synced_straggler_s"]), r
    out = capsys.readouterr().out
    assert "quantized rows: " in out and "with the straggler of compute steps started together" in out
    assert "with each side's median over the rounds instead of their mean" in out
    assert "async measured over a common window of time, every rank stepping through it" in out
    assert "with the fixed costs timed after a step of the model's compute" in out
    assert (tmp_path / "predict.png").stat().st_size > 1000


def _load_reprice():
    script = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "predict_reprice.py"
    spec = importlib.util.spec_from_file_location("predict_reprice", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_core_copy_variant_prices_a_record_before_it_with_its_runs_one_rank_a_core_copy(capsys):
    reprice = _load_reprice()
    records = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "predict"

    def async_mlp(name, network="rate=100mbit", workers=4):
        data = json.loads((records / name).read_text())
        row = next(
            r
            for r in data["rows"]
            if (r["model"], r["label"], r["network"], r["workers"]) == ("mlp-10m", "async", network, workers)
        )
        slug = f"{network.replace('=', '_')}-np{workers}"
        return data, row, slug

    # predict-25 timed the copy per core: the variant takes it, and prices the row as recorded
    data, row, slug = async_mlp("predict-25.json")
    assert row["core_copy_s_per_element"] > 0
    job = data["profiles"][slug]
    timed = job["models"]["mlp-10m"]["core_copy_s_per_element"]
    # (the record's prediction is its rounds' median; the mean of the same rounds' prices is the price now)
    mean = statistics.fmean(row["predicted_rounds_s"])
    # (each round at the row's own compute slice, as the bench priced it then: own_compute)
    assert reprice.reprice(row, job, 256, "core-copy", timed, own_compute=True) == pytest.approx(mean, rel=1e-9)
    assert reprice.reprice(row, job, 256, "core-copy", timed, medians=True, own_compute=True) == pytest.approx(
        row["predicted_s"]
    )
    # predict-24 did not: priced at the 2-worker job's copy on the same link, rank 0's passes cost less
    data, row, slug = async_mlp("predict-24.json")
    job = data["profiles"][slug]
    two = data["profiles"]["rate_100mbit-np2"]["models"]["mlp-10m"]["copy_s_per_element"]
    assert "core_copy_s_per_element" not in job["models"]["mlp-10m"]
    assert two < job["models"]["mlp-10m"]["copy_s_per_element"]
    assert reprice.reprice(row, job, 256, "core-copy", two) < reprice.reprice(row, job, 256) < 1.35 * row["measured_s"]
    assert reprice.reprice(row, job, 256, "core-copy", two) == pytest.approx(row["measured_s"], rel=0.05)
    assert reprice.main([str(records / "predict-24.json"), "--variant", "core-copy"]) == 0
    assert "variant core-copy: " in capsys.readouterr().out


def _compare_config(label, curve, ends, workers=2):
    """One successful setting of a ``bunsan bench compare`` record, as ``bunsan bench tta`` reads it."""
    return {
        "status": "ok",
        "label": label,
        "workers": workers,
        "test_error": curve[-1],
        "test_error_curve": curve,
        "epoch_end_s": ends,
    }


def test_time_to_accuracy_and_auto_against_the_best(tmp_path, capsys):
    from bunsan.bench import tta

    assert tta.time_to_error([0.5, 0.2, 0.1], [1.0, 2.0, 3.0], 0.2) == 2.0
    assert tta.time_to_error([0.5, 0.3], [1.0, 2.0], 0.2) is None
    assert tta.epochs_to_error([0.5, 0.2, 0.1], 0.2) == 2 and tta.epochs_to_error([0.5, 0.3], 0.2) is None

    config = _compare_config
    configs = [
        config("data_parallel", [0.30, 0.15, 0.10], [2.0, 4.0, 6.0]),  # target 0.10 + 0.01
        config("data_parallel:bits=2", [0.30, 0.11, 0.10], [1.5, 3.0, 4.5]),
        config("auto:risk=high", [0.30, 0.12, 0.105], [1.6, 3.2, 4.8]),
    ]
    rows = {r["label"]: r for r in tta.tta_rows(configs, "data_parallel", 1.0)}
    assert rows["data_parallel"]["tta_s"] == 6.0 and rows["data_parallel:bits=2"]["tta_s"] == 3.0
    assert rows["auto:risk=high"]["tta_s"] == 4.8 and rows["auto:risk=high"]["vs_best"] == pytest.approx(1.6)
    record = tmp_path / "compare.json"
    record.write_text(json.dumps({"configs": configs}))
    assert main(["bench", "tta", str(record)]) == 0
    assert "1.60" in capsys.readouterr().out
    assert main(["bench", "tta", str(tmp_path / "missing.json")]) == 2
    # one record: a campaign of several is tools/tta_campaign.py's
    assert main(["bench", "tta", str(record), str(record)]) == 2


def test_a_worker_count_whose_reference_failed_has_no_target_and_the_others_keep_theirs(tmp_path, capsys):
    from bunsan.bench import tta

    config = _compare_config
    configs = [
        config("data_parallel", [0.30, 0.15, 0.10], [2.0, 4.0, 6.0]),
        config("auto:risk=high", [0.30, 0.12, 0.105], [1.6, 3.2, 4.8]),
        {"status": "timeout", "label": "data_parallel", "workers": 4},  # ran past the job timeout
        config("auto:risk=high", [0.30, 0.12, 0.105], [1.6, 3.2, 4.8], workers=4),
    ]
    rows = tta.tta_rows(configs, "data_parallel", 1.0)
    assert {r["workers"] for r in rows} == {2}
    assert tta.without_target(configs, "data_parallel") == [
        "no target at 4 workers: its data_parallel run ended timeout, so its settings are not compared"
    ]
    assert tta.without_target(configs[2:], "data_parallel")[0].endswith(
        "ended timeout, so its settings are not compared"
    )
    assert "at 2 workers: it has no data_parallel run" in tta.without_target(configs[1:2], "data_parallel")[0]
    with pytest.raises(ValueError, match="at any worker count"):
        tta.tta_rows(configs[2:], "data_parallel", 1.0)
    record = tmp_path / "compare.json"
    record.write_text(json.dumps({"configs": configs}))
    assert main(["bench", "tta", str(record)]) == 0
    out = capsys.readouterr().out
    assert "no target at 4 workers" in out and "1.00" in out


def test_tta_campaign_summary_reads_autos_choice_and_counts_the_rows_within(tmp_path, capsys):

    def config(label, curve, ends, run_dir):
        return {**_compare_config(label, curve, ends), "dir": str(run_dir)}

    paths = []
    for network, auto_ends in (("rate=1gbit", [1.6, 3.2, 4.8]), (None, [9.0, 10.0, 11.0])):
        out = tmp_path / f"campaign-{network}"
        (out / "np2-auto").mkdir(parents=True)
        chosen = "[bunsan]   model_averaging:512     4.72 ms/step predicted  <- chosen\n"
        (out / "np2-auto" / "stdout.txt").write_text("[bunsan] Auto at step 11\n" + chosen)
        configs = [
            config("data_parallel", [0.30, 0.15, 0.10], [2.0, 4.0, 6.0], out / "np2-dp"),
            config("data_parallel:bits=2", [0.30, 0.11, 0.10], [1.5, 3.0, 4.5], out / "np2-bits"),
            # recorded from another working directory: found beside the record by its name
            config("auto:risk=high", [0.30, 0.12, 0.105], auto_ends, "elsewhere/np2-auto"),
        ]
        record = out / "compare.json"
        record.write_text(json.dumps({"arguments": {"model": "digits_cnn", "network": network}, "configs": configs}))
        paths.append(record)
    rows = campaign.campaign_rows([(p, json.loads(p.read_text())) for p in paths], "data_parallel", 1.0)
    assert [(r["network"], r["chose"], r["best_s"]) for r in rows] == [
        ("rate=1gbit", "model_averaging:512", 3.0),
        ("loopback", "model_averaging:512", 3.0),
    ]
    assert rows[0]["ratio"] == pytest.approx(1.6) and rows[1]["ratio"] == pytest.approx(11.0 / 3.0)
    # auto reaches the target in epoch 3, the best (bits=2) in epoch 2; whole runs 4.8 or 11.0 s against 4.5 s
    assert [(r["auto_epoch"], r["best_epoch"]) for r in rows] == [(3, 2), (3, 2)]
    assert [r["run_ratio"] for r in rows] == [pytest.approx(4.8 / 4.5), pytest.approx(11.0 / 4.5)]
    assert campaign.main([*map(str, paths), "--within", "1.7"]) == 0
    out = capsys.readouterr().out
    assert "within 1.70x of the best fixed setting's time to target: 1 of 2" in out
    assert "whole run within 1.70x of that setting's whole run (the same epochs): 1 of 2" in out
    assert "3 / 2" in out and "1.07" in out
    (paths[1].parent / "np2-auto" / "stdout.txt").write_text(
        "[bunsan] Auto at step 11: the network measurement was inconclusive (times did not grow with size): exact kept\n"
    )
    assert campaign.campaign_rows([(paths[1], json.loads(paths[1].read_text()))], "data_parallel", 1.0)[0]["chose"] == (
        "exact (network inconclusive)"
    )


def test_tta_campaign_summary_takes_the_median_over_seeds(tmp_path):

    # three seeds of one model and network; exact's final error is 0.10 at every seed (target 0.11)
    exact = ([0.30, 0.15, 0.10], [2.0, 4.0, 6.0])
    bits = {0: [0.11, 0.20, 0.10], 1: [0.30, 0.20, 0.10], 2: [0.30, 0.11, 0.10]}  # epochs 1, 3, 2
    fast = {0: [0.50, 0.40, 0.30], 1: [0.50, 0.40, 0.11], 2: [0.50, 0.40, 0.30]}  # never, 3, never
    auto = {0: [0.30, 0.20, 0.11], 1: [0.11, 0.10, 0.10], 2: [0.30, 0.11, 0.10]}  # epochs 3, 1, 2
    records = []
    for seed in (0, 1, 2):
        out = tmp_path / f"s{seed}"
        (out / "np2-auto").mkdir(parents=True)
        choice = "block_momentum:256" if seed else "exact"
        (out / "np2-auto" / "stdout.txt").write_text(f"[bunsan]   {choice}   4.72 ms/step predicted  <- chosen\n")
        configs = [
            _compare_config("data_parallel", *exact),
            _compare_config("data_parallel:bits=2", bits[seed], [1.5, 3.0, 4.5]),
            _compare_config("model_averaging:block_size=1024", fast[seed], [0.5, 1.0, 1.5]),
            {**_compare_config("auto:risk=high", auto[seed], [1.0, 2.0, 3.0]), "dir": str(out / "np2-auto")},
        ]
        document = {"arguments": {"model": "digits_cnn", "network": None, "seed": seed}, "configs": configs}
        records.append((out / "compare.json", document))
    (row,) = campaign.campaign_rows(records, "data_parallel", 1.0)
    # bits=2: times 1.5, 4.5, 3.0 -> median 3.0, epochs 2; model averaging missed at 2 of 3 seeds: never
    assert row["seeds"] == 3 and row["best_label"] == "data_parallel:bits=2"
    assert row["best_s"] == pytest.approx(3.0) and row["best_epoch"] == 2
    # auto: 3.0, 1.0, 2.0 -> 2.0 in epoch 2; whole runs 3.0 against 4.5
    assert row["auto_s"] == pytest.approx(2.0) and row["auto_epoch"] == 2
    assert row["ratio"] == pytest.approx(2.0 / 3.0) and row["run_ratio"] == pytest.approx(3.0 / 4.5)
    assert row["chose"] == "exact / block_momentum:256"
    # by seed, against bits=2: 3.0/1.5, 1.0/4.5, 2.0/3.0; bits=2's own times spread 4.5/1.5
    assert row["seed_ratios"] == [pytest.approx(1.0 / 4.5), pytest.approx(2.0 / 3.0), pytest.approx(2.0)]
    assert row["best_spread"] == pytest.approx(3.0)
    # one seed alone is its own row, as before: seed 0's auto took 3.0 s, bits=2 1.5
    (alone,) = campaign.campaign_rows(records[:1], "data_parallel", 1.0)
    assert alone["seeds"] == 1 and alone["best_label"] == "data_parallel:bits=2" and alone["best_s"] == 1.5
    assert alone["ratio"] == pytest.approx(2.0) and alone["chose"] == "exact"
    assert alone["seed_ratios"] == [pytest.approx(2.0)] and alone["best_spread"] is None
    # a seed where auto missed the target has no ratio; the best's spread is over its seeds that reached it
    records[2][1]["configs"][3]["test_error_curve"] = [0.5, 0.5, 0.5]
    (missed,) = campaign.campaign_rows(records, "data_parallel", 1.0)
    assert len(missed["seed_ratios"]) == 2 and missed["best_spread"] == pytest.approx(3.0)


def test_tta_campaign_summary_keeps_a_models_data_sets_apart(tmp_path, capsys):

    exact = ([0.30, 0.15, 0.10], [2.0, 4.0, 6.0])  # target 0.11, reached in epoch 3 at 6.0 s
    records = []
    for dataset, auto_ends in (("mnist1d", [1.0, 2.0, 3.0]), ("mnist1d_20k", [4.0, 8.0, 12.0])):
        out = tmp_path / dataset
        configs = [
            _compare_config("data_parallel", *exact),
            {**_compare_config("auto:risk=high", [0.30, 0.11, 0.10], auto_ends), "dir": str(out / "np2-auto")},
        ]
        arguments = {"model": "mnist1d_cnn", "dataset": dataset, "network": None, "seed": 0}
        records.append((out / "compare.json", {"arguments": arguments, "configs": configs}))
    rows = campaign.campaign_rows(records, "data_parallel", 1.0)
    # one row per data set, each against its own best (exact: 6.0 s); not one row with a median over both
    assert [(r["dataset"], r["seeds"], r["ratio"]) for r in rows] == [
        ("mnist1d", 1, pytest.approx(2.0 / 6.0)),
        ("mnist1d_20k", 1, pytest.approx(8.0 / 6.0)),
    ]
    for path, document in records:
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(document))
    assert campaign.main([str(p) for p, _ in records]) == 0
    out = capsys.readouterr().out
    assert "mnist1d_cnn on mnist1d_20k" in out and "mnist1d_cnn on mnist1d " in out
    assert main(["bench", "tta", str(records[1][0])]) == 0  # one data set: the model's name alone
    assert " on mnist1d" not in capsys.readouterr().out


def test_held_out_ratio_picks_the_best_on_the_other_seeds(tmp_path, capsys):

    # setting A is fastest by its median only through two lucky seeds; B is steady; auto equals B
    times = {"data_parallel": [6.0, 6.0, 6.0], "A": [1.0, 1.0, 4.0], "B": [2.0, 2.0, 2.0], "auto:risk=high": [2.0] * 3}
    per_seed = [{label: t[i] for label, t in times.items()} for i in range(3)]
    # seed 0: seeds 1-2 pick B (A's median 2.5): 2/2; seed 1 the same; seed 2: seeds 0-1 pick A: 2/4
    assert campaign.held_out_ratios(per_seed, "auto:risk=high") == [pytest.approx(1.0), pytest.approx(1.0), 0.5]
    assert campaign.held_out_ratios(per_seed[:1], "auto:risk=high") == []
    # auto missed at seed 0: None there; the picked setting missed where auto did not: inf
    per_seed[0]["auto:risk=high"] = None
    per_seed[2]["A"] = None  # seeds 0-1 still pick A (median 1.0); at seed 2 it never got there
    assert campaign.held_out_ratios(per_seed, "auto:risk=high") == [None, pytest.approx(1.0), math.inf]

    # in a campaign: the in-sample best is A (median 1.0, auto 2.0 / 1.0), the held-out ratio 1.0
    def curve_to(t):  # reaches the target (0.11) at the end of epoch 1, at t seconds
        return [0.10, 0.10], [t, 2 * t]

    records = []
    for seed in range(3):
        out = tmp_path / f"s{seed}"
        (out / "np2-auto").mkdir(parents=True)
        (out / "np2-auto" / "stdout.txt").write_text("[bunsan]   exact   1.0 ms/step predicted  <- chosen\n")
        configs = [
            _compare_config("data_parallel", [0.30, 0.10], [3.0, 6.0]),
            _compare_config("model_averaging:block_size=1024", *curve_to([1.0, 1.0, 4.0][seed])),
            _compare_config("block_momentum:block_size=1024", *curve_to(2.0)),
            {**_compare_config("auto:risk=high", *curve_to(2.0)), "dir": str(out / "np2-auto")},
        ]
        document = {"arguments": {"model": "digits_cnn", "network": None, "seed": seed}, "configs": configs}
        (out / "compare.json").write_text(json.dumps(document))
        records.append((out / "compare.json", document))
    (row,) = campaign.campaign_rows(records, "data_parallel", 1.0)
    assert row["best_label"] == "model_averaging:block_size=1024" and row["ratio"] == pytest.approx(2.0)
    assert row["held_out_ratios"] == [pytest.approx(1.0), pytest.approx(1.0), pytest.approx(0.5)]
    assert row["held_out_ratio"] == pytest.approx(1.0)
    assert campaign.main([str(p) for p, _ in records]) == 0
    out = capsys.readouterr().out
    assert "auto / held-out best" in out
    assert "within 1.10x of the best fixed setting's time to target: 0 of 1" in out
    assert "within 1.10x of the setting picked on the other seeds (held out, median over the seeds): 1 of 1" in out
    assert main(["bench", "tta", str(records[0][0])]) == 0  # one seed: no held-out column figure, no line
    assert "held out" not in capsys.readouterr().out


def test_bench_tta_reads_what_auto_chose_from_its_printed_table(tmp_path):
    auto_choice = campaign.auto_choice

    def choice(*lines):
        (tmp_path / "stdout.txt").write_text("\n".join(lines) + "\n")
        return auto_choice(tmp_path / "stdout.txt")

    row = "[bunsan]   {:<28} {:9.2f} ms/step predicted{}"
    table = [row.format("exact", 10.0, "  <- chosen"), row.format("model_averaging:256", 9.5, "")]
    # exact kept, and the probes' reason says "exact kept without them": not an inconclusive network
    probes = (
        "[bunsan]   fixed-cost probes: exact, block: exact kept without them (model_averaging:64 less than 10% faster)"
    )
    assert choice(*table, probes) == "exact"
    assert choice("[bunsan] Auto at step 4: the network measurement was inconclusive (...): exact kept") == (
        "exact (network inconclusive)"
    )
    trial = "[bunsan] Auto's trial after block 2: a local step 111.21 ms, the round 33.0 ms, 112.24 ms a step in blocks of 32 against exact's 123.49 ms: "
    assert choice(*table[1:], probes, trial + "block_momentum:1024 kept: 10.0% faster than exact") == (
        "block_momentum:1024 (trial)"
    )
    assert (
        choice(*table[1:], trial + "back to exact: 7.0% faster than exact (< min_gain 10%)") == "exact (after a trial)"
    )
    assert choice("nothing printed") == "?"


def test_each_round_is_priced_with_its_own_compute_fixed_costs_and_codec():
    from bunsan.algorithms import cost_model as cm

    profile = cm.Profile(
        compute_s=0.010,
        straggler_s=0.002,
        params=1000,
        batch=32,
        fixed_s=(("exact", 0.001),),
        encode_s_per_element=1e-9,
        decode_s_per_element=1e-9,
        codec_call_s=1e-5,
    )
    codec = lambda call: ({"encode_s_per_element": 2e-9, "encode_call_s": call, "decode_call_s": 3 * call}, ())
    rounds = predict.round_profiles(
        profile,
        [0.020, 0.030, 0.040],
        [{"exact": 0.003}, {"exact": 0.004}, {"exact": 0.005}],
        [codec(1e-5), codec(2e-5), codec(3e-5)],
    )
    assert [r.compute_s for r in rounds] == [0.020, 0.030, 0.040]
    assert [r.fixed("exact") for r in rounds] == [0.003, 0.004, 0.005]
    # a round's codec: its own figures, the mean call of its two; what it did not time stays the job's
    assert [r.codec_call_s for r in rounds] == pytest.approx([2e-5, 4e-5, 6e-5])
    assert rounds[1].encode_s_per_element == 2e-9 and rounds[1].decode_s_per_element == 1e-9
    # the straggler and the sizes stay pooled
    assert {(r.straggler_s, r.params, r.batch) for r in rounds} == {(0.002, 1000, 32)}
    # the rounds' mean price, and each round's: 0.020 + 0.002 + 0.003 = 0.025 and so on
    mean, each = predict.paired_prediction(lambda p: p.compute_s + p.straggler_s + p.fixed("exact"), rounds)
    assert each == pytest.approx([0.025, 0.036, 0.047]) and mean == pytest.approx(0.036)
    # a slow last round: the mean moves with it (0.025 + 0.036 + 0.087 = 0.148), where the median would not
    slow = predict.round_profiles(
        profile, [0.020, 0.030, 0.080], [{"exact": 0.003}] * 2 + [{"exact": 0.005}], [codec(1e-5)] * 3
    )
    mean, each = predict.paired_prediction(lambda p: p.compute_s + p.straggler_s + p.fixed("exact"), slow)
    assert each == pytest.approx([0.025, 0.035, 0.087]) and mean == pytest.approx(0.049)
    with pytest.raises(ValueError, match="one compute, fixed-cost and codec entry per round"):
        predict.round_profiles(profile, [0.02], [], [codec(1e-5)])
    # the compute of one rank per core (where timed) moves with the round's: 6 ms against the pooled 10 ms
    per_core = predict.round_profiles(
        replace(profile, ranks_per_core=2.0, core_compute_s=0.006),
        [0.020, 0.005],
        [{"exact": 0.003}] * 2,
        [codec(1e-5)] * 2,
    )
    assert [r.core_compute_s for r in per_core] == pytest.approx([0.012, 0.003])
    assert [r.core_compute_s for r in rounds] == [0.0, 0.0, 0.0]  # not timed: stays untimed


def test_synced_straggler_is_the_slowest_ranks_mean_step_past_the_compute():
    # two ranks, three steps started together: the slowest 5, 6 and 7 ms (mean 6) past a 4.5 ms compute
    times = [[0.004, 0.006, 0.007], [0.005, 0.003, 0.006]]
    assert predict.synced_straggler(times, 0.0045) == pytest.approx(0.0015)
    assert predict.synced_straggler(times, 0.0065) == 0.0  # never a negative wait
    with pytest.raises(ValueError, match="same number"):
        predict.synced_straggler([[0.004], [0.005, 0.006]], 0.004)
    with pytest.raises(ValueError, match="same number"):
        predict.synced_straggler([], 0.004)


def test_median_codec_takes_each_figure_over_the_rounds():
    # three rounds of measure_codec's dict and measure_codecs's (bits, enc, dec, call, enc call, dec call)
    rounds = [
        (
            {"encode_s_per_element": 1.0, "encode_call_s": 4.0, "decode_call_s": 2.0, "codec_call_s": 3.0},
            [(1, 1.0, 2.0, 9.0, 10.0, 8.0), (8, 5.0, 6.0, 0.0, 1.0, 1.0)],
        ),
        (
            {"encode_s_per_element": 3.0, "encode_call_s": 6.0, "decode_call_s": 1.0, "codec_call_s": 3.5},
            [(1, 3.0, 1.0, 9.0, 2.0, 4.0), (8, 7.0, 4.0, 0.0, 3.0, 3.0)],
        ),
        (
            {"encode_s_per_element": 2.0, "encode_call_s": 5.0, "decode_call_s": 9.0, "codec_call_s": 7.0},
            [(1, 2.0, 3.0, 9.0, 6.0, 6.0), (8, 6.0, 5.0, 0.0, 2.0, 2.0)],
        ),
    ]
    fields, entries = predict.median_codec(rounds)
    # medians 2, 5, 2; the mean call from the two medians (5 + 2) / 2, not the median of the means (3.5)
    assert fields == {"encode_s_per_element": 2.0, "encode_call_s": 5.0, "decode_call_s": 2.0, "codec_call_s": 3.5}
    # 1 bit: medians 2, 2; calls 6 and 6, their mean 6; 8 bits: 6, 5; calls 2 and 2
    assert entries == ((1, 2.0, 2.0, 6.0, 6.0, 6.0), (8, 6.0, 5.0, 2.0, 2.0, 2.0))
    with pytest.raises(ValueError, match="at least one round"):
        predict.median_codec([])


def test_plan_reprice_prices_a_recorded_plan_as_plan_did(tmp_path, capsys):
    import subprocess
    import sys

    record = tmp_path / "plan.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bunsan",
            "plan",
            "--compute-ms",
            "12",
            "--params",
            "100000",
            "--batch",
            "64",
            "--workers",
            "2,8",
            "--link",
            "1gbit",
            "--latency",
            "50us",
            "--png",
            str(tmp_path / "plan.png"),
            "--json",
            str(record),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    script = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "plan_reprice.py"
    spec = importlib.util.spec_from_file_location("plan_reprice", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([str(record)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(rows) == 14 and {r[1] for r in rows} >= {"exact", "async", "1-bit"}
    for row in rows:  # the same checkout prices every row as plan recorded it
        assert row[2] == row[3], row
    assert module.main([str(tmp_path / "missing.json")]) == 2
    assert "is not a bunsan plan record" in capsys.readouterr().err


def test_noise_and_bias_parts_a_rows_runs_into_its_mean_and_the_pooled_spread():
    reprice = _load_reprice()
    # two rows of two runs: deviations of 0.1 about each row's mean, pooled over 4 - 2 = 2 degrees
    # of freedom: sd = sqrt(4 * 0.01 / 2) = 0.14142; means 0 and 0.1, rms sqrt(0.01 / 2) = 0.070711
    found = reprice.noise_and_bias({"a": [0.1, -0.1], "b": [0.0, 0.2]})
    assert found["dof"] == 2 and found["rows"] == 2
    assert found["noise_sd"] == pytest.approx(0.1414214, rel=1e-6)
    assert found["bias"] == pytest.approx({"a": 0.0, "b": 0.1})
    assert found["rms_bias"] == pytest.approx(0.0707107, rel=1e-6)
    # outside (0.8, 1.2): 1 - Phi(log 1.2 / sd) + Phi(log 0.8 / sd) = 1 - 0.90134 + 0.05730 for row a,
    # the same shifted by 0.1 for b
    assert found["p_outside"]["a"] == pytest.approx(0.155961, rel=1e-5)
    assert found["p_outside"]["b"] == pytest.approx(0.291407, rel=1e-5)
    assert found["expected_misses"] == pytest.approx(0.447368, rel=1e-5)
    assert found["p_none"] == pytest.approx((1 - 0.155961) * (1 - 0.291407), rel=1e-5)
    assert found["floor_misses"] == pytest.approx(2 * 0.155961, rel=1e-5)
    assert found["p_none_floor"] == pytest.approx((1 - 0.155961) ** 2, rel=1e-5)
    # each row's own spread: a's squares 0.02 (1 degree of freedom) and 4 of the pooled variance 0.02
    assert found["row_sd"]["a"] == pytest.approx(0.1414214, rel=1e-6)  # sqrt((0.02 + 4 * 0.02) / 5)
    # rows apart: a moves (0.1, -0.1), b not at all; pooled variance 0.02 / 2 = 0.01, so a's own is
    # (0.02 + 4 * 0.01) / 5 = 0.012 and b's (0 + 0.04) / 5 = 0.008; outside 20% at sd sqrt(0.012) and
    # sqrt(0.008) with mean 0: 0.0688446 and 0.0270552 (normal tails at log 1.2 / sd and log 0.8 / sd)
    apart = reprice.noise_and_bias({"a": [0.1, -0.1], "b": [0.0, 0.0]})
    assert apart["noise_sd"] == pytest.approx(0.1)
    assert apart["row_sd"]["a"] == pytest.approx(math.sqrt(0.012)) and apart["row_sd"]["b"] == pytest.approx(
        math.sqrt(0.008)
    )
    assert apart["row_floor_misses"] == pytest.approx(0.0688446 + 0.0270552, rel=1e-5)
    assert apart["row_expected_misses"] == pytest.approx(0.0688446 + 0.0270552, rel=1e-5)  # both means 0
    assert apart["row_p_none_floor"] == pytest.approx((1 - 0.0688446) * (1 - 0.0270552), rel=1e-5)
    assert found["rows_within"] == 2 and reprice.noise_and_bias({"a": [0.1, 0.3], "b": [0.0, 0.0]})["rows_within"] == 1
    # a row of one run adds its bias but no degree of freedom; without two runs of any row: refused
    assert reprice.noise_and_bias({"a": [0.1, -0.1], "c": [0.5]})["p_outside"]["c"] > 0.95
    with pytest.raises(ValueError, match="two runs"):
        reprice.noise_and_bias({"a": [0.1], "b": [0.0]})
    with pytest.raises(ValueError, match="at least one run"):
        reprice.noise_and_bias({"a": []})


def test_reprice_runs_together_on_the_records(tmp_path, capsys):
    reprice = _load_reprice()
    records = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "predict"
    paths = [str(records / name) for name in ("predict-25.json", "predict-26-small.json")]
    assert reprice.main([*paths, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("as recorded: ") == 2
    line = next(t for t in out.splitlines() if t.startswith("2 runs together, the model at this checkout"))
    assert "84 degrees of freedom" in line  # the 84 small-CNN rows are in both runs, the other 84 in one
    listed = [t for t in out.splitlines() if " outside, mean " in t]
    assert len(listed) == 3
    assert "  rows whose mean over the runs is within 20%: " in out
    assert "rounds (as recorded): a round's error moves " in out
    assert reprice.main([*paths, "--top", "0", "--medians"]) == 0
    out = capsys.readouterr().out
    assert "2 runs together, the model at this checkout, each side's median over the rounds: " in out
    assert reprice.main([paths[0], str(records / "nothing.json")]) == 2
    # two records that share no row: no run-to-run spread to measure, refused in one sentence
    digits = json.loads(Path(paths[1]).read_text())
    mnist = dict(digits, rows=[r for r in digits["rows"] if r["model"] == "mnist1d_cnn"])
    digits["rows"] = [r for r in digits["rows"] if r["model"] == "digits_cnn"]
    for name, data in (("a.json", digits), ("b.json", mnist)):
        (tmp_path / name).write_text(json.dumps(data))
    capsys.readouterr()
    assert reprice.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 2
    assert "cannot be taken together" in capsys.readouterr().err


def test_a_rows_measured_step_is_the_mean_of_its_rounds():
    # rounds of the same number of steps: 10, 12 and 17 ms a step -> 13 ms (the median would say 12)
    assert predict.measured_step([0.010, 0.012, 0.017]) == pytest.approx(0.013)
    with pytest.raises(ValueError, match="at least one round"):
        predict.measured_step([])


def test_round_noise_parts_the_rounds_spread_from_the_runs():
    reprice = _load_reprice()

    def record(errors):
        row = {"network": "loopback", "workers": 2, "model": "m", "label": "exact"}
        row["rounds_s"] = [1.0] * len(errors)
        row["predicted_rounds_s"] = [math.exp(e) for e in errors]
        return {"rows": [row]}

    # run 1 errors 0.1, 0, -0.1 (mean 0), run 2 0.3, 0.2, 0.1 (mean 0.2): each run's squares 0.02 over 2
    # degrees of freedom, so the rounds' sd sqrt(0.04 / 4) = 0.1; the runs' means 0 and 0.2 about 0.1,
    # sd sqrt(0.02 / 1)
    found = reprice.round_noise([record([0.1, 0.0, -0.1]), record([0.3, 0.2, 0.1])])
    assert found["round_sd"] == pytest.approx(0.1) and found["round_dof"] == 4
    assert found["measured_round_sd"] == 0.0  # every round measured 1.0 s: the errors are the price's alone
    # measured steps e^0.1, 1, e^-0.1 in both runs, priced 1 s: the errors' spread is the measurement's, 0.1
    steady = [record([-0.1, 0.0, 0.1]) for _ in range(2)]
    for data in steady:
        row = data["rows"][0]
        row["rounds_s"], row["predicted_rounds_s"] = [math.exp(0.1), 1.0, math.exp(-0.1)], [1.0] * 3
    moved = reprice.round_noise(steady)
    assert moved["measured_round_sd"] == pytest.approx(0.1)
    # an oracle's misses: the row's measured variance (0.04 + 4 * 0.01) / (4 + 4) = 0.01 over its 3 rounds a
    # run, a normal of sd sqrt(0.01 / 3) outside (log 0.8, log 1.2): 0.000850
    assert moved["oracle_misses"] == pytest.approx(0.000850099, rel=1e-5)
    assert moved["oracle_p_none"] == pytest.approx(1 - 0.000850099, rel=1e-7)
    assert found["run_sd"] == pytest.approx(math.sqrt(0.02)) and found["run_dof"] == 1 and found["rounds"] == 3
    with pytest.raises(ValueError, match="two rounds or more in two runs"):
        reprice.round_noise([record([0.1, 0.0, -0.1])])


def test_a_record_with_a_network_field_the_model_does_not_take_is_priced_as_the_checkout_prices_it():
    # predict-29-np4 ran at 921a166 (reverted), which timed the all-to-all's own rate: its rows are priced
    # at the all-gather's rate here, the quantized ones differently from their record, the others the same
    reprice = _load_reprice()
    records = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "predict"
    data = json.loads((records / "predict-29-np4.json").read_text())
    job = data["profiles"]["rate_100mbit-np4"]
    assert job["network"]["alltoall_bandwidth"] < job["network"]["gather_bandwidth"]
    for row in data["rows"]:
        if row["network"] != "rate=100mbit":
            continue
        priced = reprice.reprice(row, job, 256, own_compute=True)  # each round at its own compute, as then
        if row["label"] in ("1-bit", "8-bit"):
            assert priced < row["predicted_s"], row["label"]  # the all-to-all at the faster all-gather rate
        elif row["label"] == "exact":  # since: its ranks leave the wire together (exact_released_together)
            record = job["models"][row["model"]]
            assert record["synced_straggler_s"] < record["straggler_s"] and priced < row["predicted_s"]
        else:
            assert priced == pytest.approx(row["predicted_s"], rel=1e-9), row["label"]


def test_a_record_priced_again_counts_only_rows_the_model_moved_by_either_measure(capsys):
    reprice = _load_reprice()
    # a row before predict-28: predicted_s is the rounds' median; after: their mean, the median beside
    old = {"predicted_s": 0.02, "predicted_rounds_s": [0.01, 0.02, 0.06]}
    new = {"predicted_s": 0.03, "predicted_median_s": 0.02, "measured_median_s": 0.025, "predicted_rounds_s": [0]}
    assert reprice.recorded_price(old) == pytest.approx(0.03) and reprice.recorded_price(old, medians=True) == 0.02
    assert reprice.recorded_price(new) == 0.03 and reprice.recorded_price(new, medians=True) == 0.02
    # the model moved once since predict-27 (50c38a9): exact at 4 workers on 2 cores over the two shaped
    # links waits the straggler of steps started together (cost_model.exact_released_together), 4 models
    # x 2 links = 8 rows priced differently by either measure, and no other
    # (each round at its own compute slice, as the bench priced them: own_compute; since predict-34 the
    # job's compute prices every round, which moves every row)
    records = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "predict"
    for name in ("predict-27.json", "predict-28.json", "predict-30.json"):
        data = json.loads((records / name).read_text())
        for medians in (False, True):
            moved = sum(
                reprice.reprice(r, data["profiles"][reprice.row_slug(r)], 256, medians=medians, own_compute=True)
                != pytest.approx(reprice.recorded_price(r, medians=medians), rel=1e-9)
                for r in data["rows"]
            )
            assert moved == 8, (name, medians)
        assert reprice.main([str(records / name)]) == 0
        assert "rows priced differently)" in capsys.readouterr().out


def test_a_record_that_timed_the_compute_per_core_prices_rank_0s_async_worker_at_it():
    # predict-30 (f9992fd) timed the compute of one rank per core at 4 workers on 2 cores: its async rows
    # there are priced with it as recorded, and otherwise (the shared compute, as before) differently
    import copy

    reprice = _load_reprice()
    records = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "predict"
    data = json.loads((records / "predict-30.json").read_text())
    moved = 0
    for row in data["rows"]:
        if row["label"] != "async":
            continue
        job = data["profiles"][reprice.row_slug(row)]
        timed = job["models"][row["model"]]["core_compute_s"]
        assert (timed > 0) == (row["workers"] == 4 and row["ranks_per_core"] > 1)
        as_then = partial(reprice.reprice, own_compute=True)  # each round at its own compute, as recorded
        assert as_then(row, job, 256) == pytest.approx(row["predicted_s"], rel=1e-9)
        before = copy.deepcopy(job)
        before["models"][row["model"]]["core_compute_s"] = 0.0
        if timed:
            moved += as_then(row, before, 256) != pytest.approx(row["predicted_s"], rel=1e-6)
        else:
            assert as_then(row, before, 256) == pytest.approx(row["predicted_s"], rel=1e-9)
    assert moved == 12  # every async row at 4 workers: 4 models on 3 networks


def test_steps_within_steps_until_the_window_has_passed_at_least_once():
    now = [0.0]
    calls = []

    def step():
        calls.append(now[0])
        now[0] += 0.3

    # a 1 s window of 0.3 s steps: the fourth ends past it, at 1.2 s
    assert predict.steps_within(step, 1.0, clock=lambda: now[0]) == (4, pytest.approx(1.2))
    assert calls == pytest.approx([0.0, 0.3, 0.6, 0.9])
    # a window shorter than one step: that one step
    now[0], calls[:] = 0.0, []
    assert predict.steps_within(step, 0.1, clock=lambda: now[0]) == (1, pytest.approx(0.3))
    with pytest.raises(ValueError, match="window_s"):
        predict.steps_within(step, 0.0)


def test_a_models_rows_are_priced_on_each_rounds_probe_and_the_median_of_the_probes():
    from bunsan.algorithms.network_model import Network

    # predict-30's 1 Gbit/s probe at 4 workers (0.674 Gbit/s, 782 us) among two as the runs before found
    bad = Network(782e-6, 84.3e6, gather_bandwidth=100.4e6, half_bandwidth=None, burst_bytes=125000.0)
    good = [
        Network(200e-6, 118e6, gather_bandwidth=112e6, half_bandwidth=110e6, burst_bytes=125000.0),
        Network(240e-6, 117e6, gather_bandwidth=113e6, half_bandwidth=114e6, burst_bytes=125000.0),
    ]
    median = predict.median_network([bad, *good])
    assert median.latency_s == pytest.approx(240e-6) and median.bandwidth == pytest.approx(117e6)
    assert median.gather_bandwidth == pytest.approx(112e6) and median.burst_bytes == 125000.0
    # an optional field: the median of the probes that have it (of two, their mean)
    assert median.half_bandwidth == pytest.approx(112e6)
    assert predict.median_network([bad]) == bad
    with pytest.raises(ValueError, match="at least one probe"):
        predict.median_network([])
    # offline: a record with a probe per round prices each round on its own, the pooled on the median
    reprice = _load_reprice()
    records = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "predict"
    data = json.loads((records / "predict-30.json").read_text())
    job = data["profiles"]["rate_1gbit-np4"]
    row = next(r for r in data["rows"] if r["network"] == "rate=1gbit" and r["workers"] == 4 and r["label"] == "fp16")
    record = job["models"][row["model"]]
    # one probe, each round at its own compute: as recorded
    assert reprice.reprice(row, job, 256, own_compute=True) == pytest.approx(row["predicted_s"], rel=1e-9)
    as_fields = lambda net: {k: getattr(net, k) for k in Network.__dataclass_fields__}
    probed = {
        **job,
        "models": {
            **job["models"],
            row["model"]: {
                **record,
                "network_rounds": [as_fields(good[0]), as_fields(good[1]), as_fields(bad)],
                "network": as_fields(median),
            },
        },
    }
    assert len(row["compute_rounds_s"]) == 3
    # two of the three rounds on the good probes: the fp16 step priced lower than on the bad one alone,
    # and the pooled on the median, lower too
    assert reprice.reprice(row, probed, 256, own_compute=True) < row["predicted_s"]
    assert reprice.reprice(row, probed, 256, "pooled") < row["predicted_pooled_s"]
    # the pooled on the median alone: the bad probe as the third round's does not move it
    only_median = {**probed, "models": {**probed["models"], row["model"]: {**record, "network": as_fields(median)}}}
    assert reprice.reprice(row, only_median, 256, "pooled") == pytest.approx(
        reprice.reprice(row, probed, 256, "pooled")
    )


def test_predict_32s_exact_rows_over_the_links_at_4_workers_are_priced_with_the_wait_of_steps_started_together():
    # predict-32 ran at 4aa8bd8, before exact_released_together: its 4 exact rows at 4 workers on 1 Gbit/s
    # move, each to its price with the synced wait, and the digits CNN's +30% comes within 10%
    reprice = _load_reprice()
    records = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "predict"
    data = json.loads((records / "predict-32.json").read_text())
    job = data["profiles"]["rate_1gbit-np4"]
    for row in data["rows"]:
        if row["network"] != "rate=1gbit" or row["workers"] != 4 or row["label"] not in ("exact", "fp16"):
            continue
        priced = reprice.reprice(row, job, 256, own_compute=True)  # each round at its own compute, as then
        if row["label"] == "fp16":
            assert priced == pytest.approx(row["predicted_s"], rel=1e-9), row["model"]
            continue
        synced = reprice.reprice(row, job, 256, "synced", own_compute=True)
        assert priced == pytest.approx(synced, rel=1e-9), row["model"]
        assert priced != pytest.approx(row["predicted_s"], rel=1e-6), row["model"]
        if row["model"] == "digits_cnn":
            assert row["error"] > 0.25 and abs(priced / row["measured_s"] - 1) < 0.10
