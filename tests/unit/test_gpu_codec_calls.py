"""docs/experiments/gpu_codec_calls.py: the rank it simulates is the one the step waits for."""

import importlib.util
from pathlib import Path

import torch

from bunsan import models
from bunsan.algorithms.data_parallel.buckets import build_buckets
from bunsan.algorithms.data_parallel.stripes import build_stripes
from bunsan.bench.synthetic import model_inputs
from bunsan.compression import Quantizer

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "experiments" / "gpu_codec_calls.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_codec_calls", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resnet20_stripes(workers):
    kwargs, _ = model_inputs("resnet20", None, 10)
    named = list(models.create("resnet20", **kwargs).named_parameters())
    buckets = build_buckets(named, 25 * 2**20, 2)
    return named, [build_stripes(b, Quantizer(1), workers) for b in buckets]


def _owned(stripes, rank):
    return [sum(length for _, length, _ in s.segments[rank]) for s in stripes]


def test_busiest_rank_owns_a_stripe_in_every_bucket_where_rank_0_does_not():
    calls = _module()
    _, stripes = _resnet20_stripes(32)
    assert len(stripes) == 2
    assert 0 in _owned(stripes, 0)  # the small bucket has fewer chunks than 32 ranks: rank 0 owns none there
    busiest = calls.busiest_rank(stripes)
    assert all(_owned(stripes, busiest))
    most = max(sum(_owned(stripes, r)) for r in range(32) if all(_owned(stripes, r)))
    assert sum(_owned(stripes, busiest)) == most


def test_busiest_rank_at_two_workers_is_the_larger_stripe():
    calls = _module()
    _, stripes = _resnet20_stripes(2)
    sizes = [sum(_owned(stripes, r)) for r in range(2)]
    assert calls.busiest_rank(stripes) == sizes.index(max(sizes))


def test_one_step_runs_the_exchange_code_as_the_given_rank(monkeypatch):
    calls = _module()
    for name in ("all_to_all", "all_gather_into", "wait"):
        monkeypatch.setattr(calls.exchange, name, calls._no_collective)
    monkeypatch.setattr(calls.exchange, "get_rank", calls.exchange.get_rank)  # restored after the test
    named, _ = _resnet20_stripes(32)
    monkeypatch.setenv("BUNSAN_CODEC_CALLS", "bucket")
    seen = []
    original = calls.exchange.QuantizedExchange._finish_stripes

    def spy(self, n_active, pieces=None):
        seen.append(calls.exchange.get_rank(self.group))
        return original(self, n_active, pieces)

    monkeypatch.setattr(calls.exchange.QuantizedExchange, "_finish_stripes", spy)
    assert calls._one_step_s(named, 8, 32, 1, torch.device("cpu")) > 0
    assert calls._one_step_s(named, 8, 32, 1, torch.device("cpu"), rank=0) > 0
    assert seen[0] != 0 and set(seen[:3]) == {seen[0]} and set(seen[3:]) == {0}


def test_a_rank_outside_the_smallest_worker_count_is_refused_in_one_sentence():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--workers", "2,8", "--rank", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--rank must be a rank of every worker count, 0 to 1; got 2" in done.stderr
