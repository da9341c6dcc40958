"""``bunsan plan``: the published figures it must reproduce, its parsing, its output and its refusals."""

import json
from pathlib import Path

import pytest
import torch

from bunsan.bench import plan
from bunsan.cli import main


@pytest.mark.parametrize("name", sorted(plan.PUBLISHED))
def test_reproduces_published_efficiency_within_10_points(name):
    case, predictions = plan.plan_published(name)
    at = next(p for p in predictions if p.workers == case.at)
    assert abs(at.efficiency - case.efficiency) <= 0.10, (name, at.efficiency, case.efficiency)
    # more workers never predict a higher efficiency for the same exact SGD
    efficiencies = [p.efficiency for p in sorted(predictions, key=lambda p: p.workers)]
    assert efficiencies == sorted(efficiencies, reverse=True)


def test_published_compute_times_are_the_stated_arithmetic():
    assert plan.PUBLISHED["horovod-resnet101"].compute_s == pytest.approx(0.61804, rel=1e-4)  # 64 / (1656.82 / 16)
    assert plan.PUBLISHED["goyal-resnet50"].compute_s == pytest.approx(0.23179, rel=1e-4)  # 104400 / 450410
    assert plan.PUBLISHED["cntk-resnet20"].compute_s == pytest.approx(0.073590, rel=1e-4)  # 2874.594 / 39062.5


def test_the_published_set_ups_are_data_read_from_the_package(tmp_path):
    shipped = json.loads((Path(plan.__file__).with_name("published.json")).read_text())
    assert [r["name"] for r in shipped["setups"]] == list(plan.PUBLISHED)
    assert plan.PUBLISHED["cntk-resnet20"].workers == (1, 2, 4) and not plan.PUBLISHED["cntk-resnet20"].overlap
    record = {**shipped["setups"][0], "name": "mine", "workers": [2, 8], "at": 8}
    (tmp_path / "mine.json").write_text(json.dumps({"setups": [record]}))
    assert plan.load_published(tmp_path / "mine.json")["mine"].workers == (2, 8)


def test_parse_link_and_latency():
    assert plan.parse_link("25gbit") == pytest.approx(3.125e9)
    assert plan.parse_link("100mbit") == pytest.approx(12.5e6)
    assert plan.parse_latency("10us") == pytest.approx(1e-5)
    assert plan.parse_latency("1.5ms") == pytest.approx(1.5e-3)
    with pytest.raises(ValueError, match="--link"):
        plan.parse_link("25gbps")
    with pytest.raises(ValueError, match="--latency"):
        plan.parse_latency("10")


def test_plan_prints_every_algorithm_at_every_count_and_writes_png_and_json(tmp_path, capsys):
    png, record = tmp_path / "p.png", tmp_path / "p.json"
    code = main(
        [
            "plan",
            "--compute-ms",
            "100",
            "--params",
            "25000000",
            "--workers",
            "8,256",
            "--link",
            "25gbit",
            "--latency",
            "10us",
            "--png",
            str(png),
            "--json",
            str(record),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    rows = json.loads(record.read_text())["predictions"]
    labels = {r["label"] for r in rows}
    assert len(rows) == 2 * len(labels) and {"exact", "1-bit", "async"} <= labels
    for label in labels:
        assert f"  {label}  " in out or f"  {label}\n" in out
    exact = {r["workers"]: r for r in rows if r["label"] == "exact"}
    # 100 MB of gradients at 25 Gbit/s: 2 * 255/256 * 100e6 / 3.125e9 = 63.75 ms on the wire, plus
    # 2 * 255 * 10 us = 5.1 ms of latency for each of 5 buckets (1 + 25 + 25 + 25 + 19.4 MiB)
    assert exact[256]["communication_s"] == pytest.approx(0.06375 + 5 * 0.0051, rel=1e-3)


def test_a_token_bucket_links_burst_shortens_a_small_models_exchange(tmp_path):
    def exact_step(*burst):
        record = tmp_path / "b.json"
        args = ["--compute-ms", "2", "--params", "8192", "--workers", "2", "--link", "100mbit", "--latency", "0us"]
        assert main(["plan", *args, *burst, "--png", str(tmp_path / "b.png"), "--json", str(record)]) == 0
        saved = json.loads(record.read_text())
        return saved["network"]["burst_bytes"], next(r for r in saved["predictions"] if r["label"] == "exact")

    # 32 KB of gradients at 2 workers: 32768 B a rank at 12.5e6 B/s = 2.62144 ms, of which tc tbf's 16 KiB
    # burst (refilled in 1.31 ms of the 2 ms compute) passes at once: 1.31072 ms less exposed
    plain_burst, plain = exact_step()
    burst, shaped = exact_step("--burst", "16kb")
    assert (plain_burst, burst) == (0.0, 16384.0)
    assert plain["step_s"] - shaped["step_s"] == pytest.approx(16384 / 12.5e6)


def test_plan_measures_a_model(tmp_path, capsys):
    code = main(["plan", "--model", "mnist1d_cnn", "--batch", "8", "--workers", "2", "--png", str(tmp_path / "m.png")])
    assert code == 0
    out = capsys.readouterr().out
    assert "measured mnist1d_cnn" in out and "8,010 parameters" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give one profile"),
        (["--compute-ms", "10"], "give one profile"),
        (["--compute-ms", "10", "--params", "100", "--link", "25gbps"], "--link"),
        (["--compute-ms", "10", "--params", "100", "--workers", "0"], "-np"),
        (["--compute-ms", "-1", "--params", "100"], "--compute-ms"),
        (["--published", "nope"], "unknown published"),
        (["--compute-ms", "10", "--params", "100", "--hostfile", "h"], "--probe"),
        (["--compute-ms", "10", "--params", "100", "--burst", "16 kbit"], "--burst"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(argv, message, capsys, tmp_path):
    assert main(["plan", *argv, "--png", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_device_must_be_the_cpu_or_a_cuda_device(tmp_path, capsys):
    for bad in ("foo", "meta", "cuda:x"):
        code = main(
            ["plan", "--model", "mnist1d_cnn", "--device", bad, "--workers", "2", "--png", str(tmp_path / "m.png")]
        )
        assert code == 2, bad
        assert (
            f"--device must be cpu, cuda or cuda:N (where one worker computes), got {bad!r}" in capsys.readouterr().err
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no CUDA device is visible")
def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path, capsys):
    code = main(
        ["plan", "--model", "mnist1d_cnn", "--device", "cuda", "--workers", "2", "--png", str(tmp_path / "m.png")]
    )
    assert code == 2
    assert "--device cuda: no CUDA device is visible here" in capsys.readouterr().err


@pytest.mark.gpu
def test_device_cuda_measures_the_profile_on_the_gpu(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["plan", "--model", "mnist1d_cnn", "--device", "cuda", "--workers", "2"]
    code = main([*args, "--png", str(tmp_path / "m.png"), "--json", str(out)])
    assert code == 0
    assert "batch 32, cuda: " in capsys.readouterr().out
    assert json.loads(out.read_text())["profile"]["compute_s"] > 0


def _auto_decision(**measured):
    """A decision as bunsan.Auto records it (4 workers, 100 Mbit/s-like link, the job's codecs)."""
    return {
        "algorithm": "block_momentum",
        "options": {"block_size": 512},
        "label": "block_momentum:512",
        "why": "predicted 5.0x faster than exact",
        "step": 4,
        "workers": 4,
        "measured": {
            "exact_step_s": 0.250,
            "compute_s": 0.040,
            "latency_s": 80e-6,
            "bandwidth": 11.3e6,
            "gather_bandwidth": 11.4e6,
            "half_bandwidth": 11.1e6,
            "encode_s_per_element": 2e-9,
            "decode_s_per_element": 1e-9,
            "codec_call_s": 5e-6,
            "cast_s_per_element": 0.5e-9,
            "codecs": [[8, 3e-9, 2e-9, 6e-6], [2, 2.5e-9, 1.5e-9, 5e-6]],
            "overlap": False,
            "fixed_s": {"exact": 0.004, "block_momentum:512": 0.009},
            "params": 1_000_000,
            "batch": 16,
            "tensors": 6,
            "chunks": 1956,
            "codec_per_bucket": False,
            **measured,
        },
        "predictions": [],
    }


def _job_profile(**changes):
    """The profile ``plan --job`` should build from :func:`_auto_decision`'s measurements."""
    from bunsan.algorithms import cost_model as cm

    fields = {
        "compute_s": 0.040,
        "params": 1_000_000,
        "batch": 16,
        "encode_s_per_element": 2e-9,
        "decode_s_per_element": 1e-9,
        "codec_call_s": 5e-6,
        "cast_s_per_element": 0.5e-9,
        "codecs": ((8, 3e-9, 2e-9, 6e-6), (2, 2.5e-9, 1.5e-9, 5e-6)),
        "tensors": 6,
        "chunks": 1956,
    }
    return cm.Profile(**{**fields, **changes})


def test_job_takes_the_profile_and_network_auto_measured_from_a_checkpoint_or_json(tmp_path, capsys):
    from bunsan.algorithms import async_model as am
    from bunsan.algorithms import cost_model as cm

    decision = _auto_decision()
    # a training script's checkpoint: the model, and the distributed optimizer's state with Auto's under "algorithm"
    checkpoint = {
        "epoch": 3,
        "model": {"0.weight": torch.zeros(2, 2)},
        "optimizer": {
            "state": {},
            "param_groups": [{"lr": 0.1, "params": [0]}],
            "algorithm": {"algorithm": "auto", "world_size": 4, "decision": decision, "measured_steps": 4},
        },
    }
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    from bunsan.train.checkpoint import files

    files.write_file(tmp_path / "session.pt", {"format": files.FORMAT, **checkpoint})  # a TrainingSession's file
    # Auto(record=...)'s JSON lines: the last record is the decision as the job left it
    earlier = {**decision, "step": 99, "label": "exact"}
    lines = [json.dumps({"event": "decision", **earlier}), json.dumps({"event": "block_check", **decision})]
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n")
    m = decision["measured"]
    job_network = cm.Network(m["latency_s"], m["bandwidth"], m["gather_bandwidth"], m["half_bandwidth"])
    profile = _job_profile()
    expected = am.predict_all(profile, job_network, am.default_candidates(1024), [4, 16, 64], overlap=False)
    for source in ("ckpt.pt", "decision.json", "session.pt", "records.jsonl"):
        record = tmp_path / f"{source}.plan.json"
        argv = ["plan", "--job", str(tmp_path / source), "--workers", "4,16,64", "--png", str(tmp_path / "p.png")]
        assert main([*argv, "--json", str(record)]) == 0
        out = capsys.readouterr().out
        assert "job: Auto at step 4 on 4 workers chose block_momentum:512" in out
        assert "compute 40.00 ms per step per worker (batch 16), 1,000,000 parameters" in out
        exact_at_4 = next(p for p in expected if p.label == "exact" and p.workers == 4)
        assert (
            f"at the job's 4 workers: exact predicted {exact_at_4.step_s * 1e3:.2f} ms a step, measured 250.00" in out
        )
        got = json.loads(record.read_text())
        assert got["network"]["bandwidth"] == pytest.approx(11.3e6) and got["network"]["latency_s"] == pytest.approx(
            80e-6
        )
        assert [p["label"] for p in got["predictions"]] == [p.label for p in expected]
        for p, q in zip(got["predictions"], expected):
            assert p["step_s"] == pytest.approx(q.step_s, rel=1e-12), p["label"]
    # a link given replaces the job's network; a fixed global batch starts from the job's whole batch on one worker
    record = tmp_path / "linked.json"
    argv = ["plan", "--job", str(tmp_path / "ckpt.pt"), "--workers", "4", "--link", "25gbit", "--global-batch"]
    assert main([*argv, "--png", str(tmp_path / "p.png"), "--json", str(record)]) == 0
    got = json.loads(record.read_text())
    assert got["network"]["bandwidth"] == pytest.approx(3.125e9) and got["network"]["latency_s"] == pytest.approx(10e-6)
    assert got["profile"]["compute_s"] == pytest.approx(0.160) and got["profile"]["batch"] == 64
    assert got["predictions"][0]["compute_s"] == pytest.approx(0.040)  # back at 4 workers: the job's own compute


def _plan_job_at_2_and_16(tmp_path, capsys, **measured):
    """``plan --job`` of :func:`_auto_decision` with ``measured`` at 2 and 16 workers: its predictions
    (the JSON record's) and the job's network."""
    from bunsan.algorithms import cost_model as cm

    (tmp_path / "decision.json").write_text(json.dumps(_auto_decision(**measured)))
    record = tmp_path / "plan.json"
    argv = ["plan", "--job", str(tmp_path / "decision.json"), "--workers", "2,16", "--png", str(tmp_path / "p.png")]
    assert main([*argv, "--json", str(record)]) == 0
    capsys.readouterr()
    m = _auto_decision(**measured)["measured"]
    network = cm.Network(m["latency_s"], m["bandwidth"], m["gather_bandwidth"], m["half_bandwidth"])
    return json.loads(record.read_text())["predictions"], network


def test_job_prices_the_encode_and_decode_calls_its_auto_timed_apart(tmp_path, capsys):
    from bunsan.algorithms import async_model as am
    from bunsan.algorithms import cost_model as cm

    split = {
        "encode_call_s": 9e-6,
        "decode_call_s": 1e-6,
        "codecs": [[8, 3e-9, 2e-9, 6e-6, 10e-6, 2e-6], [2, 2.5e-9, 1.5e-9, 5e-6, 8e-6, 2e-6]],
    }
    got, network = _plan_job_at_2_and_16(tmp_path, capsys, **split)
    profile = _job_profile(encode_call_s=9e-6, decode_call_s=1e-6, codecs=tuple(tuple(c) for c in split["codecs"]))
    expected = am.predict_all(profile, network, am.default_candidates(1024), [2, 16], overlap=False)
    assert [p["label"] for p in got] == [p.label for p in expected]
    for p, q in zip(got, expected):
        assert p["step_s"] == pytest.approx(q.step_s, rel=1e-12), p["label"]
    # the split moves the quantized rows: the same record with every call at the mean predicts otherwise
    mean = am.predict_all(
        cm.Profile(**{**vars(profile), "encode_call_s": None, "decode_call_s": None, "codecs": ()}),
        network,
        am.default_candidates(1024),
        [2],
        overlap=False,
    )
    one_bit = next(p for p in got if p["label"] == "1-bit" and p["workers"] == 2)
    assert one_bit["step_s"] != pytest.approx(next(p.step_s for p in mean if p.label == "1-bit"), rel=1e-6)


def test_job_prices_the_block_rounds_and_copies_its_auto_timed(tmp_path, capsys):
    from bunsan.algorithms import async_model as am

    timed = {"update_s_per_element": 7e-9, "copy_s_per_element": 1e-9}
    got, network = _plan_job_at_2_and_16(tmp_path, capsys, **timed)
    expected = am.predict_all(_job_profile(**timed), network, am.default_candidates(1024), [2, 16], overlap=False)
    untimed = am.predict_all(_job_profile(), network, am.default_candidates(1024), [2, 16], overlap=False)
    for p, q, r in zip(got, expected, untimed):
        assert p["step_s"] == pytest.approx(q.step_s, rel=1e-12), p["label"]
        if p["label"].startswith(("block_momentum", "model_averaging", "async")):  # what the two price
            assert q.step_s > r.step_s, p["label"]


def test_job_says_where_its_codec_was_not_measured(tmp_path, capsys):
    # Auto decided at its first step without measuring the codec: the plan says how it prices those rows
    argv = ["plan", "--job", str(tmp_path / "decision.json"), "--workers", "2", "--png", str(tmp_path / "p.png")]
    for flag, said in ((False, True), (None, False)):
        decision = _auto_decision()
        if flag is not None:
            decision["measured"]["codec_measured"] = flag
        (tmp_path / "decision.json").write_text(json.dumps(decision))
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert ("its codec was not measured" in out) == said, out
    # decided at the second step without it: the plan names that step
    decision = _auto_decision()
    decision["measured"].update(codec_measured=False, second_step_before_exchange_s=0.004, bound_margin=2.0)
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "its second step settled a block algorithm without it" in out, out


def test_job_decided_at_its_first_step_takes_the_compute_its_block_check_timed(tmp_path, capsys):
    # a first-step decision predicted from that step's time (an upper bound); where its block check ran,
    # the local step it timed is the job's compute, and the plan says which it used
    argv = ["plan", "--job", str(tmp_path / "decision.json"), "--workers", "2", "--png", str(tmp_path / "p.png")]
    decision = _auto_decision()
    bound = decision["measured"]["compute_s"]
    decision["measured"]["first_step"] = True
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "an upper bound" in out and f"compute {bound * 1e3:.2f} ms" in out, out
    decision["block_check"] = {"local_step_s": bound / 20, "exchange_s": 0.01, "steps": 32}
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"compute {bound / 20 * 1e3:.2f} ms" in out and "its block check's local step" in out, out
    # decided at the second step, from twice its time: a bound too, the check's local step where it ran
    del decision["measured"]["first_step"]
    decision["measured"].update(second_step_before_exchange_s=bound / 2, bound_margin=2.0)
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"compute {bound / 20 * 1e3:.2f} ms" in out and "at its second step" in out, out
    del decision["block_check"]
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"compute {bound * 1e3:.2f} ms" in out and "second step's time taken 2 times, a bound" in out, out
    # a decision on timed steps keeps its own compute, check or not
    del decision["measured"]["second_step_before_exchange_s"], decision["measured"]["bound_margin"]
    decision["block_check"] = {"local_step_s": bound / 20, "exchange_s": 0.01, "steps": 32}
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"compute {bound * 1e3:.2f} ms" in out and "upper bound" not in out, out


def test_job_whose_auto_ran_a_trial_says_what_the_trial_timed(tmp_path, capsys):
    argv = ["plan", "--job", str(tmp_path / "decision.json"), "--workers", "2", "--png", str(tmp_path / "p.png")]
    decision = _auto_decision()
    compute = decision["measured"]["compute_s"]
    decision["trial"] = {"of": "model_averaging:1024", "steps": 8, "exact_step_s": 0.13}
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    assert main(argv) == 0
    assert "trial" not in capsys.readouterr().out  # under way: nothing timed yet
    decision["trial"].update(local_step_s=0.115, exchange_s=0.01, outcome="back to exact: 7.0% faster than exact")
    (tmp_path / "decision.json").write_text(json.dumps(decision))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "its trial of model_averaging:1024 timed a local step of 115.00 ms and a round of 10.0 ms" in out, out
    assert "back to exact" in out and f"compute {compute * 1e3:.2f} ms" in out, out


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("nothing", "no decision of algorithm='auto' in it"),
        ("undecided", "no decision of algorithm='auto' in it"),
        ("inconclusive", "has no compute_s, params, batch, latency_s, bandwidth"),
        ("missing", "no such file"),
        ("garbage", "torch.load(weights_only=True) cannot read it"),
        ("damaged", "fails its SHA-256 checksum"),
        ("batch", "--batch comes from the job"),
    ],
)
def test_job_refuses_what_holds_no_decision_in_one_sentence(what, message, tmp_path, capsys):
    path = tmp_path / "ckpt.pt"
    extra = []
    if what == "nothing":
        torch.save({"model": {"w": torch.zeros(1)}}, path)
    elif what == "undecided":  # saved while Auto was still measuring
        torch.save({"optimizer": {"algorithm": {"algorithm": "auto", "decision": None, "measured_steps": 2}}}, path)
    elif what == "inconclusive":  # Auto kept exact: only the step was measured
        decision = {"label": "exact", "step": 4, "workers": 2, "measured": {"exact_step_s": 0.01}}
        torch.save({"algorithm": {"decision": decision}}, path)
    elif what == "garbage":
        path.write_bytes(b"not a checkpoint")
    elif what == "damaged":  # a TrainingSession's file with one byte changed
        from bunsan.train.checkpoint import files

        files.write_file(path, {"format": files.FORMAT, "decision": _auto_decision()})
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    elif what == "batch":
        (path := tmp_path / "d.json").write_text(json.dumps(_auto_decision()))
        extra = ["--batch", "8"]
    assert main(["plan", "--job", str(path), *extra, "--png", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_job_and_another_profile_together_are_refused(tmp_path, capsys):
    (path := tmp_path / "d.json").write_text(json.dumps(_auto_decision()))
    assert (
        main(["plan", "--job", str(path), "--compute-ms", "5", "--params", "10", "--png", str(tmp_path / "x.png")]) == 2
    )
    assert "give one profile" in capsys.readouterr().err
