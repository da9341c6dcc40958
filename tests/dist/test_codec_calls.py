"""The striped exchange coded in one call per bucket (a GPU's path) against one call per segment.

``BUNSAN_CODEC_CALLS=bucket`` runs on CPU what a GPU runs (stripes.coded_per_bucket); each body
sets the variable itself, so the module's warm workers never carry one test's mode into another.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import bunsan
from bunsan.algorithms.data_parallel import DataParallelSGD
from tests.dist import test_quantized as quantized


def _in_mode(mode: str) -> None:
    os.environ["BUNSAN_CODEC_CALLS"] = mode


def _body_identity(rank, world_size, mode, bits, steps, rotate=False):
    _in_mode(mode)
    return quantized._body_error_feedback_identity(rank, world_size, bits, steps, rotate=rotate)


def _body_momentum(rank, world_size, mode, bits, local_momentum, rotate=False):
    _in_mode(mode)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 9), nn.Tanh(), nn.Linear(9, 3))
    algorithm = DataParallelSGD(bits=bits, local_momentum=local_momentum, rotate=rotate)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    model, optimizer = bunsan.distribute(model, optimizer, algorithm)
    for k in range(8):
        g = torch.Generator().manual_seed(k)
        x = torch.randn(8 * world_size, 12, generator=g)
        optimizer.zero_grad()
        model(x[rank::world_size]).pow(2).mean().backward()
        optimizer.step()
    assert all(q.batched == (mode == "bucket") for q in algorithm._stripes.values())
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _body_batched_flag(rank, world_size, mode, bits):
    _in_mode(mode)
    model = nn.Sequential(nn.Linear(37, 11), nn.Linear(11, 3))
    algorithm = DataParallelSGD(bits=bits)
    bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    algorithm.reduce_gradients()
    return [q.batched for q in algorithm._stripes.values()]


@pytest.mark.parametrize(("mode", "bits", "batched"), [("bucket", 1, True), ("segment", 1, False), ("bucket", 8, True)])
def test_the_variable_picks_the_codec_calls(workers, mode, bits, batched):
    results = workers.run(f"{__name__}:_body_batched_flag", mode=mode, bits=bits)
    assert results[0] and all(flag == batched for flag in results[0])


@pytest.mark.parametrize(("bits", "rotate"), [(1, False), (2, False), (8, False), (1, True)])
@pytest.mark.parametrize("size", [2, 4])
def test_one_call_per_bucket_loses_nothing_and_replicas_agree(workers, workers4, size, bits, rotate):
    pool = workers if size == 2 else workers4
    results = pool.run(f"{__name__}:_body_identity", mode="bucket", bits=bits, steps=8, rotate=rotate)
    for i in range(2):  # per parameter
        applied = torch.tensor(results[0][0][i])
        true = torch.tensor(results[0][1][i])
        residual_sum = sum(torch.tensor(r[2][i]) for r in results) + sum(torch.tensor(r[3][i]) for r in results)
        torch.testing.assert_close(applied + residual_sum, true, rtol=0, atol=2e-5)
        assert (applied - true).abs().max() > 1e-4  # quantization did drop something
        assert all(r[4][i] == results[0][4][i] for r in results)  # every replica applies the same gradient


@pytest.mark.parametrize(("bits", "rotate"), [(1, False), (4, False), (1, True)])
@pytest.mark.parametrize("size", [2, 4])
def test_one_call_per_bucket_trains_as_one_call_per_segment(workers, workers4, size, bits, rotate):
    """The same codes; a short chunk's two means may differ in the last bit (a masked reduction), and
    the owner's sum of 4 ranks is one reduction instead of three additions in rank order: the
    parameters after 8 steps of local momentum SGD (the decode takes momentum units out) agree to
    float32 rounding, not bit for bit; rotated chunks (1024, padded tails) too."""
    pool = workers if size == 2 else workers4
    kwargs = {"bits": bits, "local_momentum": True, "rotate": rotate}
    per_bucket = pool.run(f"{__name__}:_body_momentum", mode="bucket", **kwargs)
    per_segment = pool.run(f"{__name__}:_body_momentum", mode="segment", **kwargs)
    assert all(r == per_bucket[0] for r in per_bucket)  # replicas agree
    assert all(r == per_segment[0] for r in per_segment)
    torch.testing.assert_close(torch.tensor(per_bucket[0]), torch.tensor(per_segment[0]), rtol=0, atol=1e-5)


def _body_coded_elements(rank, world_size, bits):
    """Elements this rank encodes and decodes in one coded step, each segment coded on its own."""
    _in_mode("segment")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(37, 11), nn.Linear(11, 3))
    algorithm = DataParallelSGD(bits=bits)
    bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm)
    quantizer = algorithm._quantizer
    counted = {"encoded": 0, "decoded": 0}
    depth = [0]  # the outermost call counts (decode_add decodes through decode)

    def counting(name, key, numel):
        real = getattr(quantizer, name)

        def call(*args, **kwargs):
            if depth[0] == 0:
                counted[key] += numel(args)
            depth[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(quantizer, name, call)

    counting("encode", "encoded", lambda a: a[0].numel())
    counting("encode_with_feedback", "encoded", lambda a: a[0].numel())
    counting("decode", "decoded", lambda a: a[1])
    counting("decode_add", "decoded", lambda a: a[1])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    algorithm.reduce_gradients()
    return counted, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("size", [2, 4])
def test_the_cost_model_counts_the_elements_the_exchange_codes(workers, workers4, size):
    """``cost_model.codec_elements`` against the exchange's own calls: every rank encodes all its
    gradient and, from 3 workers, the owner its summed stripe again (the stripes add up to the
    gradient over the ranks); at 2 workers no second quantization. Every rank decodes twice the gradient."""
    from bunsan.algorithms.cost_model import codec_elements

    results = (workers if size == 2 else workers4).run(f"{__name__}:_body_coded_elements", bits=8)
    params = results[0][1]
    encoded, decoded = codec_elements(params, size)
    assert sum(r[0]["encoded"] for r in results) == pytest.approx(size * encoded)
    assert sum(r[0]["decoded"] for r in results) == pytest.approx(size * decoded)
    assert sum(r[0]["encoded"] for r in results) == size * params + (params if size > 2 else 0)
