"""``bunsan bench throughput``, ``bunsan bench comm``, the shaped network and the bit-width settings of
``bench.quantized``: the pure parts, no processes."""

from __future__ import annotations

import argparse
import json

import pytest

from bunsan.bench import comm_bench, netns, netns_plan, throughput
from bunsan.cli import main


# -- comm: sizes and bandwidth -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "size"),
    [("1KB", 1024), ("64MB", 64 * 2**20), ("1gb", 2**30), ("512", 512), ("4 KiB", 4096), ("2M", 2 * 2**20), ("8B", 8)],
)
def test_parse_size(text, size):
    assert comm_bench.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "1TB", "MB", "1.5MB", "2B", "-1KB"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="size"):
        comm_bench.parse_size(text)


def test_parse_sizes_ranges_and_lists():
    assert comm_bench.parse_sizes("1KB..64KB") == [1024, 4096, 16384, 65536]
    assert comm_bench.parse_sizes("1KB..8KB", factor=2) == [1024, 2048, 4096, 8192]
    assert comm_bench.parse_sizes("1KB..10KB") == [1024, 4096]  # stops before passing the end
    assert comm_bench.parse_sizes("1MB,16MB,1MB") == [2**20, 16 * 2**20]
    assert [comm_bench.format_size(s) for s in comm_bench.parse_sizes("1KB..64MB")] == [
        "1KB",
        "4KB",
        "16KB",
        "64KB",
        "256KB",
        "1MB",
        "4MB",
        "16MB",
        "64MB",
    ]
    assert comm_bench.format_size(1000) == "1000B"
    with pytest.raises(ValueError, match="larger than the last"):
        comm_bench.parse_sizes("4MB..1MB")
    with pytest.raises(ValueError, match="factor"):
        comm_bench.parse_sizes("1KB..4KB", factor=1)


def test_bus_bandwidth_as_nccl_tests_defines_it():
    # 1 GB in 1 s: algbw 1e9 B/s; all-reduce x 2(n-1)/n, all-gather x (n-1)/n
    assert comm_bench.bus_bandwidth("all_reduce", 10**9, 1.0, 2) == (1e9, 1e9)
    assert comm_bench.bus_bandwidth("all_reduce", 10**9, 2.0, 4) == (5e8, 7.5e8)
    assert comm_bench.bus_bandwidth("all_gather", 10**9, 1.0, 4) == (1e9, 7.5e8)
    assert comm_bench.bus_bandwidth("all_gather", 10**9, 1.0, 1)[1] == 0.0
    with pytest.raises(ValueError, match="op must be"):
        comm_bench.bus_bandwidth("broadcast", 1, 1.0, 2)


def test_iterations_shrink_for_large_messages():
    assert comm_bench.iterations_for(1024, 50) == 50
    assert comm_bench.iterations_for(16 * 2**20, 50) == 16
    assert comm_bench.iterations_for(1 * 2**30, 50) == 2


def test_comm_table_from_a_result():
    result = {
        "workers": 2,
        "copies": [{"size_bytes": 2**20, "copy_s": 1e-4}],
        "rows": [
            {
                "size_bytes": 2**20,
                "requested_bytes": 2**20,
                "op": "all_reduce",
                "iters": 5,
                "bunsan_s": 2e-3,
                "torch_s": 1e-3,
            }
        ],
    }
    rows = comm_bench._rows_with_bandwidth(result)
    assert rows[0]["torch_busbw"] == pytest.approx(2**20 / 1e-3)
    assert rows[0]["time_ratio"] == pytest.approx(2.0)
    assert comm_bench.table_rows(rows) == [
        ["1MB", "all_reduce", "5", "2.000", "0.524", "1.000", "1.049", "2.00", "10.49"]
    ]


# -- throughput: statistics and models ------------------------------------------------------------
def test_throughputs_per_worker_and_total():
    # two workers, three iterations of 10 images
    per_worker, total = throughput.throughputs([[0.1, 0.2, 0.1], [0.1, 0.1, 0.05]], 10)
    assert total == pytest.approx([200.0, 150.0, 300.0])
    assert per_worker == pytest.approx([100.0, 75.0, 150.0])
    with pytest.raises(ValueError, match="same number"):
        throughput.throughputs([[0.1], [0.1, 0.2]], 10)


def test_summarize_is_mean_and_196_sigma():
    mean, spread = throughput.summarize([1.0, 3.0])
    assert mean == 2.0 and spread == pytest.approx(1.96)
    assert throughput.summarize([5.0]) == (5.0, 0.0)
    with pytest.raises(ValueError):
        throughput.summarize([])


def test_scaling_efficiency():
    assert throughput.scaling_efficiency(180.0, 2, 100.0) == pytest.approx(0.9)
    assert throughput.scaling_efficiency(300.0, 4, 100.0) == pytest.approx(0.75)
    assert throughput.scaling_efficiency(300.0, 4, 180.0, reference_workers=2) == pytest.approx(300 / 360)
    assert throughput.oversubscribed(4, 1, 2) and not throughput.oversubscribed(2, 1, 2)


def test_finish_adds_efficiency_and_vs_first():
    records = [
        {
            "label": a,
            "workers": n,
            "status": "ok",
            "total_mean": t,
            "total_spread": 1.0,
            "per_worker_mean": t / n,
            "per_worker_spread": 0.5,
        }
        for a, n, t in [("dp", 1, 100.0), ("dp", 2, 150.0), ("q", 1, 100.0), ("q", 2, 190.0)]
    ]
    records.append({"label": "q", "workers": 4, "status": "failed"})
    assert throughput._finish(records, [1, 2, 4], "dp") == 1
    assert [r.get("efficiency") for r in records] == pytest.approx([1.0, 0.75, 1.0, 0.95, None])
    assert records[3]["vs_first"] == pytest.approx(190 / 150)
    rows = throughput.table_rows(records)
    assert rows[3][:6] == ["2", "q", "95.0 +- 0.5", "190 +- 1", "0.95", "1.27"]
    assert rows[-1][:3] == ["4", "q", "failed"]


@pytest.mark.parametrize(
    ("name", "size", "kwargs", "shape"),
    [
        ("resnet20", None, {"num_classes": 10}, (3, 32, 32)),
        ("resnet20", 64, {"num_classes": 10}, (3, 64, 64)),
        ("cifar_convnet", 16, {"num_classes": 10, "image_size": 16}, (3, 16, 16)),
        ("mnist_convnet", None, {"num_classes": 10, "image_size": 28}, (1, 28, 28)),
        ("mnist1d_cnn", 60, {"num_classes": 10, "length": 60}, (1, 60)),
        ("mlp", 8, {"in_features": 64, "out_features": 10}, (1, 8, 8)),
        ("mlp_10m", None, {"in_features": 1024, "out_features": 10}, (1, 32, 32)),
        ("digits_cnn", None, {"num_classes": 10}, (1, 8, 8)),
    ],
)
def test_model_inputs(name, size, kwargs, shape):
    assert throughput.model_inputs(name, size, 10) == (kwargs, shape)


def test_model_inputs_refuses_sizes_a_model_cannot_take():
    with pytest.raises(ValueError, match="8x8 images only"):
        throughput.model_inputs("digits_cnn", 16, 10)
    with pytest.raises(ValueError, match=">= 4"):
        throughput.model_inputs("resnet20", 2, 10)


# -- the shaped network: pure parts --------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "bits"), [("1gbit", 10**9), ("100mbit", 10**8), ("2.5Gbit", 2_500_000_000), ("64kbit", 64_000)]
)
def test_parse_rate(text, bits):
    assert netns.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["1gbps", "fast", "1", "1kbit"])
def test_parse_rate_refuses(text):
    with pytest.raises(ValueError, match="rate"):
        netns.parse_rate(text)


def test_parse_network():
    spec = netns.parse_network("rate=1gbit")
    assert spec.rate_bits == 10**9 and spec.burst_bytes == 125_000 and spec.label == "1gbit"
    assert netns.parse_network("rate=10mbit").burst_bytes == netns_plan.MIN_BURST_BYTES  # 1 ms is only 1250 bytes
    assert netns.parse_network(" rate = 100mbit , burst=64kb ").burst_bytes == 65536


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("rate=1gbit,delay=10ms", "delay cannot be emulated: that needs tc's netem"),
        ("rate=1gbit,loss=1%", "loss cannot be emulated"),
        ("burst=64kb", "no rate"),
        ("1gbit", "not KEY=VALUE"),
        ("rate=1gbit,mtu=9000", "unknown key 'mtu'"),
        ("rate=1gbit,rate=2gbit", "twice"),
        ("rate=1gbit,burst=1kb", "at least 2kb"),
    ],
)
def test_parse_network_refuses(text, match):
    with pytest.raises(ValueError, match=match):
        netns.parse_network(text)


def test_topology_names_and_addresses():
    topology = netns.plan_topology(3, prefix="bunsan-42")
    assert topology.namespaces == ["bunsan-42-br", "bunsan-42-w0", "bunsan-42-w1", "bunsan-42-w2"]
    assert [topology.address(r) for r in (0, 1, 254, 255, 300)] == [
        "10.213.0.1",
        "10.213.0.2",
        "10.213.0.255",
        "10.213.1.0",
        "10.213.1.45",
    ]
    assert netns.plan_topology(2).prefix == f"bunsan-{__import__('os').getpid()}"
    with pytest.raises(ValueError, match="world_size must be an int >= 1 and <= 1000"):
        netns.plan_topology(0)


def test_setup_commands_shape_both_directions_of_every_link():
    topology = netns.plan_topology(2, prefix="bunsan-7")
    commands = netns.setup_commands(topology, netns.parse_network("rate=1gbit"))
    assert commands[:3] == [["ip", "netns", "add", n] for n in topology.namespaces]
    shaped = [c for c in commands if c[0] == "tc"]
    assert [(c[2], c[6]) for c in shaped] == [
        ("bunsan-7-w0", "bsn0"),
        ("bunsan-7-br", "w0"),
        ("bunsan-7-w1", "bsn0"),
        ("bunsan-7-br", "w1"),
    ]
    assert all(c[8:12] == ["tbf", "rate", "1000000000bit", "burst"] for c in shaped)
    # veth ends are created inside their namespaces, never in the machine's own
    veths = [c for c in commands if "veth" in c]
    assert veths[0] == [
        "ip",
        "link",
        "add",
        "bsn0",
        "netns",
        "bunsan-7-w0",
        "type",
        "veth",
        "peer",
        "name",
        "w0",
        "netns",
        "bunsan-7-br",
    ]
    assert not any(c[0] == "tc" for c in netns.setup_commands(topology, None))


def test_worker_environment():
    topology = netns.plan_topology(2, prefix="bunsan-7")
    env = netns.worker_environment(topology, 1, {"PATH": "/bin", "GROUP_RANK": "5"}, "job1")
    assert {
        k: env[k]
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "BUNSAN_JOB_ID",
            "GLOO_SOCKET_IFNAME",
            "OMP_NUM_THREADS",
        )
    } == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.213.0.1",
        "MASTER_PORT": "29500",
        "BUNSAN_JOB_ID": "job1",
        "GLOO_SOCKET_IFNAME": "bsn0",
        "OMP_NUM_THREADS": "1",
    }
    assert "GROUP_RANK" not in env and env["PATH"] == "/bin"


def test_refuses_when_not_root(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root"):
        netns.check_privileges()
    args = argparse.Namespace(network="rate=1gbit")
    assert "needs root" in netns.check_network_argument(args)
    assert netns.check_network_argument(argparse.Namespace(network=None)) is None


# -- the command line ----------------------------------------------------------------------------
def test_throughput_dry_run_prints_one_job_per_count(capsys, tmp_path):
    assert (
        main(["bench", "throughput", "--model", "resnet20", "-np", "1,2,4", "--dry-run", "--out", str(tmp_path)]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("bunsan.bench.throughput --worker" in line for line in lines)
    assert [json.loads(line.split("--worker ")[1].strip("'"))["model"] for line in lines] == ["resnet20"] * 3


def test_compare_with_network_runs_jobs_through_the_namespace_launcher(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    assert (
        main(
            [
                "bench",
                "compare",
                "--dry-run",
                "-np",
                "2",
                "--network",
                "rate=1gbit",
                "--out",
                str(tmp_path),
                "--model",
                "digits_cnn",
                "--dataset",
                "digits",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert "-m bunsan.bench.netns --network rate=1gbit -np 2 --" in line and "bunsan.bench.job" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "throughput", "--network", "rate=1gbit,delay=5ms", "--dry-run"], "netem"),
        (["bench", "throughput", "--model", "nope", "--dry-run"], "unknown model 'nope'"),
        (["bench", "throughput", "--algorithm", "data_parallel:bits=0", "--dry-run"], "bits"),
        (["bench", "throughput", "--iters", "0", "--dry-run"], "--iters must be an int >= 1"),
        (["bench", "comm", "-np", "1", "--dry-run"], "needs two workers"),
        (["bench", "comm", "--ops", "broadcast", "--dry-run"], "--ops"),
        (["bench", "comm", "--sizes", "1XB", "--dry-run"], "size '1XB'"),
        (["bench", "compare", "--network", "speed=1gbit", "--dry-run"], "unknown key 'speed'"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# -- quantized: bit-width settings -----------------------------------------------------------------
def test_quantized_settings_take_an_r_for_rotated_chunks():
    from bunsan.bench.quantized import parse_setting

    assert parse_setting("32") == (32, False)
    assert parse_setting("1r") == (1, True)
    for bad in ("one", "r", "0", "17", "32r", "-1"):
        with pytest.raises(ValueError, match=r"32 or 1\.\.16"):
            parse_setting(bad)
