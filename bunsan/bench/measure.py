"""Measure what the cost model needs: compute per step, codec speed, and the job's own network.

* :func:`measure_compute`: forward + backward + SGD update of one model on one
  synthetic batch, in this process (no communication), and the forward alone,
  whose share gives the backward fraction (the window that bucketed exchanges
  overlap).
* :func:`measure_codec`: seconds per element of :class:`bunsan.compression.Quantizer`'s
  encode (with error feedback) and decode.
* :func:`measure_network` (collective): all-reduces and all-gathers of several
  sizes over the job's process group, fitted to Hockney's alpha-beta model
  (:func:`bunsan.algorithms.cost_model.network_from_timings`).

``python -m bunsan.bench.measure`` is the probe job that ``bunsan plan --probe``
starts over a hostfile: every rank measures, rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bunsan import comm
from bunsan.algorithms.cost_model import Network, network_from_timings

__all__ = ["PROBE_SIZES", "main", "measure_codec", "measure_compute", "measure_network"]

# all-reduce message sizes in bytes: a latency-bound one, then bandwidth-bound ones
PROBE_SIZES = (4, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)


def _median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_compute(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, steps: int = 5,
                    warmup: int = 2) -> dict[str, float]:
    """Median seconds of a training step (forward, backward, SGD update) and of the forward alone.

    Returns ``{"compute_s", "forward_s", "step_times", "backward_fraction", "params", "tensors",
    "chunks"}`` (chunks: quantization chunks of 512, each tensor cut on its own); the
    backward fraction is ``1 - forward / step`` (it includes the update, which
    does not overlap; small beside backward).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    def forward() -> None:
        with torch.no_grad():
            model(inputs)

    model.train()
    for _ in range(warmup):
        step()
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - start)
    compute = statistics.median(step_times)
    forward_s = _median_time(forward, steps)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    from bunsan.compression import DEFAULT_CHUNK_SIZE

    chunks = sum(-(-p.numel() // DEFAULT_CHUNK_SIZE) for p in model.parameters() if p.requires_grad)
    return {"compute_s": compute, "forward_s": forward_s, "step_times": step_times,
            "backward_fraction": min(1.0, max(0.0, 1 - forward_s / compute)), "params": params, "tensors": tensors,
            "chunks": chunks}


def measure_codec(numel: int, bits: int = 1, *, repeats: int = 3) -> dict[str, float]:
    """Seconds per element of encoding (with error feedback) and decoding ``numel`` float32 values, and the
    fixed seconds of one call (``codec_call_s``)."""
    from bunsan.compression import Quantizer

    numel = max(1, min(numel, 4_000_000))  # per-element cost is flat past a few MB; spare the memory
    quantizer = Quantizer(bits)
    x = torch.randn(numel)
    residual = torch.zeros(numel)
    payload = torch.empty(quantizer.payload_bytes(numel), dtype=torch.uint8)
    out = torch.empty(numel)
    quantizer.encode_with_feedback(x, residual, out=payload)  # warm up
    encode = _median_time(lambda: quantizer.encode_with_feedback(x, residual, out=payload), repeats)
    decode = _median_time(lambda: quantizer.decode(payload, numel, out=out), repeats)
    # the fixed cost of one call: encode + decode of one small chunk, halved
    small = x[: quantizer.chunk_size]
    small_payload = payload[: quantizer.payload_bytes(small.numel())]
    call = _median_time(lambda: (quantizer.encode_with_feedback(small, residual[: small.numel()], out=small_payload),
                                 quantizer.decode(small_payload, small.numel(), out=out[: small.numel()])),
                        max(repeats, 9)) / 2
    return {"encode_s_per_element": max(0.0, encode - call) / numel,
            "decode_s_per_element": max(0.0, decode - call) / numel, "codec_call_s": call}


def measure_network(group: Any = None, *, sizes: Sequence[int] = PROBE_SIZES, repeats: int = 7) -> Network:
    """Collective: time all-reduces and all-gathers of ``sizes`` bytes and fit alpha and beta.

    Every rank times the same collectives; the median over ``repeats`` of the
    slowest rank (a collective ends when its last rank is done) is fitted.
    """
    n = comm.get_world_size(group)
    reduce_points, gather_points = [], []
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        tensor = torch.ones(numel)
        piece = torch.ones(max(1, numel // n))
        gathered = torch.empty(piece.numel() * n)
        comm.all_reduce(tensor, group=group)  # warm up this size's buffers
        comm.all_gather_into(gathered, piece, group=group)
        comm.barrier(group)
        reduce_s = _median_time(lambda: comm.all_reduce(tensor, group=group), repeats)
        comm.barrier(group)
        gather_s = _median_time(lambda: comm.all_gather_into(gathered, piece, group=group), repeats)
        slowest = torch.tensor([reduce_s, gather_s], dtype=torch.float64)
        comm.all_reduce(slowest, op="max", group=group)
        reduce_points.append((numel * 4, float(slowest[0])))
        gather_points.append((piece.numel() * 4, float(slowest[1])))
    return network_from_timings(reduce_points, n, gather_points)


def main(argv: Sequence[str] | None = None) -> int:
    """The probe job: measure the network over all ranks; rank 0 prints it as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bunsan.bench.measure", description=main.__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    import bunsan

    bunsan.init(timeout_s=120.0)
    network = measure_network(repeats=args.repeats)
    if bunsan.is_main():
        print(json.dumps({"workers": bunsan.size(), "latency_s": network.latency_s,
                          "bandwidth": network.bandwidth, "gather_bandwidth": network.gather_bandwidth}), flush=True)
    bunsan.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
