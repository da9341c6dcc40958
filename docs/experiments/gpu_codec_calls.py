"""The quantized exchange's codec on a GPU: one call per segment against one call per bucket.

Times the codec work of one step of ``DataParallelSGD(bits=B)``'s striped exchange at ``N``
workers, as one rank does it, for a model's gradients on this device, in both modes
(``BUNSAN_CODEC_CALLS=segment`` and ``bucket``, :func:`bunsan.algorithms.data_parallel.
stripes.coded_per_bucket`), and on a GPU the per-bucket calls also replayed as CUDA graphs
(``BUNSAN_CODEC_GRAPHS=1``, the default there: :mod:`bunsan.algorithms.data_parallel.graphs`; the
two warm-up steps run the first call eagerly and capture the second). It runs the exchange's own code (``QuantizedExchange.
_launch_stripes`` and ``_finish_stripes``: quantize every stripe, the owner's sum and
re-quantization, the decode of every stripe) with its collectives replaced by nothing: one
GPU cannot hold ``N`` ranks, and the wire is not what is measured here (the cost model
adds it). The rank simulated is the one the step waits for (:func:`busiest_rank`), not rank 0. Each figure is the median of ``--repeats`` steps, each synchronized; the buffers
hold random gradients.

Usage (on a GPU machine): ``python docs/experiments/gpu_codec_calls.py [--model resnet20]
[--workers 2,8,32,256] [--bits 1,8] [--rotate] [--json PATH]``. On CPU it runs too (``--device cpu``),
where the per-segment calls are the C kernels and the one-call codec is slower.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

import bunsan.algorithms.data_parallel.quantized as exchange
from bunsan import models
from bunsan.algorithms.data_parallel import DataParallelSGD
from bunsan.algorithms.data_parallel.buckets import build_buckets
from bunsan.algorithms.data_parallel.stripes import Stripes, build_stripes
from bunsan.bench.synthetic import model_inputs
from bunsan.compression import Quantizer


def _no_collective(*args: Any, **kwargs: Any) -> None:
    return None


def busiest_rank(stripes: list[Stripes]) -> int:
    """The rank whose codec work the step waits for: the one owning chunks in the most buckets, then
    the most elements. Rank 0 is not it in general: a bucket of fewer chunks than ranks leaves some
    ranks without a stripe there (ResNet-20's 9,808-element bucket, 20 chunks of 512, at 32
    workers: rank 0 owns none), and such a rank skips that bucket's owner calls (an encode and a
    summing decode), while the others' all-gather waits for the owners that do them."""

    def work(r: int) -> tuple[int, int]:
        owned = [sum(length for _, length, _ in s.segments[r]) for s in stripes]
        return sum(1 for n in owned if n), sum(owned)

    return max(range(len(stripes[0].segments)), key=work)


def _one_step_s(
    named: list[tuple[str, torch.Tensor]],
    bits: int,
    workers: int,
    repeats: int,
    device: Any,
    rotate: bool = False,
    rank: int | None = None,
) -> float:
    """The codec work of one step as rank ``rank`` does it (``None``: :func:`busiest_rank`)."""

    class OneRank(DataParallelSGD):
        world_size = workers  # type: ignore[assignment]  # the exchange's arithmetic at N ranks

    algorithm = OneRank(bits=bits, rotate=rotate)
    if not rotate:
        algorithm._quantizer = Quantizer(bits)
    algorithm._buckets = build_buckets(named, int(algorithm.bucket_size_mb * 2**20), 2)
    generator = torch.Generator().manual_seed(0)
    for bucket in algorithm._buckets:
        bucket.buffer.copy_(torch.randn(bucket.buffer.numel(), generator=generator))
    algorithm._stripes = {b.index: build_stripes(b, algorithm._quantizer, workers) for b in algorithm._buckets}
    me = busiest_rank(list(algorithm._stripes.values())) if rank is None else rank
    exchange.get_rank = lambda group=None: me  # type: ignore[assignment]
    algorithm._round, algorithm._sent_finite, algorithm._merge_owner_residuals = None, [], False
    for stripes in algorithm._stripes.values():  # what "arrived": random payloads of the right sizes
        for buffer in (stripes.received, stripes.gathered):
            buffer.copy_(torch.randint(0, 256, buffer.shape, generator=generator, dtype=torch.uint8))
            # keep every chunk's two parameters finite: the received bytes are decoded
            buffer[stripes.params_index % buffer.numel()] = 0

    def step() -> None:
        for bucket in algorithm._buckets:
            algorithm._launch_stripes(bucket)
        algorithm._finish_stripes(workers)
        algorithm._sent_finite = []

    times = []
    for k in range(repeats + 2):  # two to warm up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if k >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--workers", default="2,8,32,256")
    parser.add_argument("--bits", default="1,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--rotate", action="store_true", help="rotated chunks (rotate=True: Auto's 1-bit under momentum)"
    )
    parser.add_argument(
        "--rank", type=int, default=None, help="the rank simulated (default: the one the step waits for, busiest_rank)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    fewest = min(int(n) for n in args.workers.split(","))
    if args.rank is not None and not 0 <= args.rank < fewest:
        parser.error(f"--rank must be a rank of every worker count, 0 to {fewest - 1}; got {args.rank}")
    device = torch.device(args.device)
    for name in ("all_to_all", "all_gather_into", "wait"):
        setattr(exchange, name, _no_collective)
    kwargs, _ = model_inputs(args.model, None, 10)
    model = models.create(args.model, **kwargs).to(device)
    named = [(n, p) for n, p in model.named_parameters()]
    print(
        f"{args.model}: {sum(p.numel() for _, p in named):,} parameters in {len(named)} tensors, on {device}"
        + (f" ({torch.cuda.get_device_name(device)}, torch {torch.__version__})" if device.type == "cuda" else "")
    )
    graphs = device.type == "cuda"  # CUDA graphs of the per-bucket calls (bunsan.algorithms.data_parallel.graphs)
    print(
        ("rotated chunks\n" if args.rotate else "")
        + "bits  workers  per segment (ms)  per bucket (ms)  ratio"
        + ("  graphed (ms)  bucket / graphed  peak MB, bucket / graphed" if graphs else "")
    )
    rows = []
    for bits in [int(b) for b in args.bits.split(",")]:
        for workers in [int(n) for n in args.workers.split(",")]:
            found, peaks = {}, {}
            for mode, captured in [("segment", "0"), ("bucket", "0")] + ([("graphs", "1")] if graphs else []):
                os.environ["BUNSAN_CODEC_CALLS"] = "segment" if mode == "segment" else "bucket"
                os.environ["BUNSAN_CODEC_GRAPHS"] = captured
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                found[mode] = _one_step_s(named, bits, workers, args.repeats, device, args.rotate, args.rank)
                if device.type == "cuda":  # the exchange's buffers, scratch and graph pool at their peak
                    peaks[mode] = (torch.cuda.max_memory_allocated() - before) / 2**20
            ratio = found["segment"] / found["bucket"]
            line = (
                f"{bits:4d}  {workers:7d}  {found['segment'] * 1e3:16.2f}  {found['bucket'] * 1e3:15.2f}  {ratio:5.1f}x"
            )
            row = {"bits": bits, "workers": workers, "segment_s": found["segment"], "bucket_s": found["bucket"]}
            if graphs:
                line += f"  {found['graphs'] * 1e3:12.2f}  {found['bucket'] / found['graphs']:15.1f}x"
                row["graphs_s"] = found["graphs"]
                line += f"  {peaks['bucket']:9.1f} / {peaks['graphs']:.1f}"
                row["peak_mb"] = peaks
            print(line)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "device": str(device),
                    "torch": torch.__version__,
                    "rotate": args.rotate,
                    "rank": args.rank,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
