"""The quantized exchange's codec calls replayed as CUDA graphs (bunsan.algorithms.data_parallel.graphs).

On CPU, with a recorder in place of a CUDA graph: which call runs eagerly, which is captured
and which replayed, and the fallback. On a GPU (``-m gpu``): the exchange's own code, with its
collectives stubbed as in docs/experiments/gpu_codec_calls.py, leaves every buffer bit for bit
as the eager calls leave it, step after step.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import bunsan.algorithms.data_parallel.quantized as exchange
from bunsan.algorithms.data_parallel import DataParallelSGD
from bunsan.algorithms.data_parallel.buckets import build_buckets
from bunsan.algorithms.data_parallel.stripes import build_stripes
from bunsan.compression import Quantizer
from bunsan.algorithms.data_parallel.graphs import CapturedCalls, graphs_enabled


class Recorded(CapturedCalls):
    """A capture that records what it was asked to replay, and can be made to fail."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(torch.device("cpu"))
        self.fail, self.replays = fail, 0

    def _capture(self, call):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

        def replay():
            self.replays += 1
            call()

        return replay


def test_first_call_eager_second_captured_then_replayed():
    calls = Recorded()
    a, b = torch.zeros(3), torch.zeros(3)
    ran = []
    for _ in range(4):
        calls("encode", lambda: ran.append("a"), [a, None])
    assert ran == ["a"] * 4 and calls.captured == 1 and calls.replays == 3  # eager, then capture + 3 replays
    calls("encode", lambda: ran.append("b"), [b, None])  # other storage: another graph, eager first
    assert calls.captured == 1 and ran[-1] == "b" and calls.replays == 3
    calls("decode", lambda: ran.append("a2"), [a, None])  # another site, the same tensors
    assert calls.captured == 1
    calls("encode", lambda: ran.append("a3"), [a.view(1, 3), None])  # another shape
    calls("encode", lambda: ran.append("a4"), [a.double(), None])  # another dtype (and storage)
    assert calls.captured == 1 and calls.replays == 3


def test_a_failed_capture_warns_once_and_leaves_every_call_eager():
    calls = Recorded(fail=True)
    x, ran = torch.zeros(2), []
    calls("encode", lambda: ran.append(1), [x])
    with pytest.warns(RuntimeWarning, match="could not be captured as a CUDA graph .RuntimeError: operation not"):
        calls("encode", lambda: ran.append(2), [x])
    assert ran == [1, 2] and calls.failed.startswith("RuntimeError")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(3):
            calls("encode", lambda k=k: ran.append(3 + k), [x])
    assert ran == [1, 2, 3, 4, 5] and calls.captured == 0


def test_graphs_only_on_cuda_and_the_switch(monkeypatch):
    monkeypatch.delenv("BUNSAN_CODEC_GRAPHS", raising=False)
    cuda = torch.device("cuda", 0)  # a device object needs no GPU
    assert graphs_enabled(cuda) and not graphs_enabled(torch.device("cpu"))
    monkeypatch.setenv("BUNSAN_CODEC_GRAPHS", "0")
    assert not graphs_enabled(cuda)
    monkeypatch.setenv("BUNSAN_CODEC_GRAPHS", "1")
    assert graphs_enabled(cuda) and not graphs_enabled(torch.device("cpu"))
    monkeypatch.setenv("BUNSAN_CODEC_GRAPHS", "yes")
    with pytest.raises(ValueError, match="BUNSAN_CODEC_GRAPHS must be 0 or 1, got 'yes'"):
        graphs_enabled(cuda)


def test_the_cpu_exchange_has_no_graphs(monkeypatch):
    monkeypatch.setenv("BUNSAN_CODEC_CALLS", "bucket")
    monkeypatch.setenv("BUNSAN_CODEC_GRAPHS", "1")
    bucket = build_buckets([("w", torch.zeros(3000))], 2**20, 2)[0]
    stripes = build_stripes(bucket, Quantizer(1), 4)
    assert stripes.batched and stripes.graphs is None


def _exchange(named, bits, workers, rank, rotate):
    """DataParallelSGD's quantized exchange as rank ``rank`` of ``workers`` does it, on one device."""

    class OneRank(DataParallelSGD):
        world_size = workers

    algorithm = OneRank(bits=bits, rotate=rotate)
    if not rotate:
        algorithm._quantizer = Quantizer(bits)
    algorithm._buckets = build_buckets(named, 2**14, 2)  # several buckets
    algorithm._stripes = {b.index: build_stripes(b, algorithm._quantizer, workers) for b in algorithm._buckets}
    algorithm._round, algorithm._sent_finite, algorithm._merge_owner_residuals = None, [], False
    return algorithm


def _step(algorithm, workers, generator, n_active):
    """One exchange step on new gradients and new payloads "from the other ranks", written in place."""
    for bucket in algorithm._buckets:
        bucket.buffer.copy_(torch.randn(bucket.buffer.numel(), generator=generator))
        algorithm._launch_stripes(bucket)
    for stripes in algorithm._stripes.values():
        for buffer in (stripes.received, stripes.gathered):
            fresh = torch.randint(0, 256, buffer.shape, generator=generator, dtype=torch.uint8)
            fresh[stripes.params_index.cpu() % buffer.numel()] = 0  # finite chunk parameters
            buffer.copy_(fresh)
    algorithm._finish_stripes(n_active)
    algorithm._sent_finite = []


def _state(algorithm):
    found = []
    for bucket in algorithm._buckets:
        s = algorithm._stripes[bucket.index]
        found += [bucket.buffer, s.send, s.residual, s.owner_residual, s.own_payload]
    return [t.detach().cpu().clone() for t in found]


CASES = [(1, 2, False), (1, 4, False), (8, 4, False), (1, 4, True), (1, 2, True)]
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
@pytest.mark.parametrize("bits, workers, rotate", CASES)
def test_replayed_calls_leave_the_exchange_bit_for_bit_as_eager_calls(monkeypatch, device, bits, workers, rotate):
    """On CUDA the calls are CUDA graphs; on CPU (the per-bucket codec forced) a recorder stands in for
    the graphs, which checks the calls' wiring: which call is replayed with which tensors."""
    for name in ("all_to_all", "all_gather_into", "wait"):
        monkeypatch.setattr(exchange, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(exchange, "get_rank", lambda group=None: 1)
    monkeypatch.setenv("BUNSAN_CODEC_CALLS", "bucket")
    shapes = [(64, 3, 3, 3), (64,), (700,), (128, 64), (5,), (4097,), (270_000,)]  # the last fills the first bucket
    named = [(f"p{i}", torch.zeros(shape, device=device)) for i, shape in enumerate(shapes)]
    states = {}
    for captured in ("0", "1"):
        monkeypatch.setenv("BUNSAN_CODEC_GRAPHS", captured)
        algorithm = _exchange(named, bits, workers, 1, rotate)
        if device == "cpu" and captured == "1":
            for s in algorithm._stripes.values():
                s.graphs = Recorded()
        graphs = [s.graphs for s in algorithm._stripes.values()]
        assert len(graphs) >= 2 and all(g is not None for g in graphs) == (captured == "1")
        generator = torch.Generator().manual_seed(bits * 10 + workers)
        states[captured] = []
        for n_active in (workers, workers, workers, workers - 1, workers, workers):
            _step(algorithm, workers, generator, n_active)
            states[captured].append(_state(algorithm))
        if captured == "1":
            assert all(g.failed is None for g in graphs)
            # per bucket: the encode and the owner's (or the pair's) call, and the last decode (not a pair's)
            assert all(g.captured == (2 if workers == 2 else 3) for g in graphs)
    for eager, replayed in zip(states["0"], states["1"]):
        for a, b in zip(eager, replayed):
            # bit for bit; random payload bytes can decode to NaN, the same NaN either way
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
