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
* :func:`measure_codecs`: the codec at each bit width a candidate uses.
* :func:`measure_fixed_costs` (collective): each candidate's step on a tiny model,
  less the local step and the model's prediction: the framework's fixed cost per step.

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

from bunsan.algorithms.measure import (
    PROBE_SIZES,
    measure_codec,
    measure_codecs,
    measure_fixed_costs,
    measure_network,
    median_time,
    synchronize,
)

__all__ = [
    "PROBE_SIZES",
    "main",
    "measure_codec",
    "measure_codecs",
    "measure_compute",
    "measure_fixed_costs",
    "measure_network",
]


def measure_compute(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, steps: int = 5, warmup: int = 2
) -> dict[str, Any]:
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

    device = inputs.device  # on a GPU each timing waits for the step's kernels (synchronize)
    model.train()
    for _ in range(warmup):
        step()
    synchronize(device)
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize(device)
        step_times.append(time.perf_counter() - start)
    compute = statistics.median(step_times)
    forward_s = median_time(forward, steps, device)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    from bunsan.compression import DEFAULT_CHUNK_SIZE

    chunks = sum(-(-p.numel() // DEFAULT_CHUNK_SIZE) for p in model.parameters() if p.requires_grad)
    return {
        "compute_s": compute,
        "forward_s": forward_s,
        "step_times": step_times,
        "backward_fraction": min(1.0, max(0.0, 1 - forward_s / compute)),
        "params": params,
        "tensors": tensors,
        "chunks": chunks,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """The probe job: measure the network over all ranks; rank 0 prints it as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m bunsan.bench.measure", description=main.__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    import bunsan

    bunsan.init(timeout_s=120.0)
    network = measure_network(repeats=args.repeats)
    if bunsan.is_main():
        print(
            json.dumps(
                {
                    "workers": bunsan.size(),
                    "latency_s": network.latency_s,
                    "bandwidth": network.bandwidth,
                    "gather_bandwidth": network.gather_bandwidth,
                    "half_bandwidth": network.half_bandwidth,
                }
            ),
            flush=True,
        )
    bunsan.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
