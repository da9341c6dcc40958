"""Step time and bytes of DataParallelSGD at 32, 16, 8, 4, 2 and 1 bits (and 1 bit rotated), side by side.

Run on N workers (the table is per N)::

    bunsan run -np 2 python -m bunsan.bench.quantized
    bunsan run -np 4 python -m bunsan.bench.quantized

Two models: a communication-heavy MLP (about 10M parameters, little compute per
parameter) and a compute-heavy CNN (few parameters, much compute per parameter).
Every bit width trains its own copy of the model from the same weights on the same
batches; rounds alternate between the bit widths so that the machine's noise hits
all alike, and each reports the median of its rounds as a ratio to bits=32.
Bytes are counted by the algorithm (`stats()`), not estimated.

A second table sets the codec itself beside a plain memory copy of the same bytes
(``torch.Tensor.copy_`` of the model's parameter count in float32, one thread):
encode with error feedback and decode, per bit width, as ratios to that copy.
``--codec-only`` prints just that table, in one process (no job needed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from typing import Any

import torch
from torch import nn

import bunsan
from bunsan.algorithms.data_parallel import DataParallelSGD
from bunsan.bench import write_json
from bunsan.bench._common import Column, format_records
from bunsan.bench.synthetic import time_steps
from bunsan.compression import Quantizer, RotatedQuantizer
from bunsan.compression.rotation import ROTATED_CHUNK_SIZE

__all__ = ["main"]


def _mlp() -> tuple[nn.Module, tuple[int, ...]]:
    # 2048 -> 2048 -> 2048 -> 10: 2 x 4.2M + 20k = ~8.4M weights, plus 2 x 512k in a third layer
    return nn.Sequential(
        nn.Linear(1024, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 10),
    ), (1024,)


def _cnn() -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    ), (3, 32, 32)


MODELS = {"mlp-10m": _mlp, "cnn": _cnn}


def parse_setting(label: str) -> tuple[int, bool]:
    """``"8"`` -> 8 bits, unrotated; ``"1r"`` -> 1 bit with rotated chunks (``DataParallelSGD(rotate=True)``,
    the default at 1 bit with Adam; with SGD the default is plain chunks, ``"1"``)."""
    rotate = label.endswith("r")
    digits = label[:-1] if rotate else label
    bits = int(digits) if digits.isdigit() else 0
    if not (1 <= bits <= 16 or (bits == 32 and not rotate)):
        raise ValueError(f"--bits takes 32 or 1..16, optionally with r for rotated chunks (1r), got {label!r}")
    return bits, rotate


def measure(name: str, bits_list: list[str], batch: int, steps: int, rounds: int) -> list[dict[str, Any]]:
    """Collective: every rank measures every bit width; rank 0's numbers are reported."""
    trainers = []
    for label in bits_list:
        torch.manual_seed(0)
        model, shape = MODELS[name]()
        bits, rotate = parse_setting(label)
        algorithm = DataParallelSGD(bits=bits, rotate=rotate)
        model, optimizer = bunsan.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), algorithm
        )
        trainers.append((label, model, optimizer, algorithm))
    g = torch.Generator().manual_seed(bunsan.rank())
    batches = [
        (torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(steps)
    ]
    for _, model, optimizer, algorithm in trainers:  # warm up, then count from zero
        time_steps(model, optimizer, batches[:2])
        algorithm.traffic.reset()
        algorithm.step = algorithm.local_samples = 0
        algorithm._encode_s = algorithm._decode_s = 0.0
    times: dict[str, list[float]] = {label: [] for label in bits_list}
    for _ in range(rounds):
        for label, model, optimizer, _ in trainers:
            times[label].append(time_steps(model, optimizer, batches))
    base = statistics.median(times["32"]) if "32" in times else None
    rows: list[dict[str, Any]] = []
    for label, _, _, algorithm in trainers:
        stats = algorithm.stats()
        ms = statistics.median(times[label]) * 1e3
        rows.append(
            {
                "model": name,
                "bits": label,
                "ms_per_step": ms,
                "time_ratio": ms / (base * 1e3) if base else float("nan"),
                "bytes_per_step": stats["bytes_sent_per_step"],
                "codec_ms_per_step": (stats.get("encode_s", 0.0) + stats.get("decode_s", 0.0))
                * 1e3
                / max(stats["steps"], 1),
            }
        )
    exact = next((r["bytes_per_step"] for r in rows if r["bits"] == "32"), None)
    for r in rows:
        r["bytes_ratio"] = r["bytes_per_step"] / exact if exact else float("nan")
    return rows


def _best_ms(fn, repeats: int) -> float:
    fn()  # the first call pays page faults and lazy set-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def codec_vs_copy(numel: int, bits_list: list[str], repeats: int = 7) -> list[dict[str, Any]]:
    """Local, one process: the codec's time on ``numel`` float32 beside a memory copy of them (min of runs)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g)
    target = torch.empty_like(x)
    copy_ms = _best_ms(lambda: target.copy_(x), repeats)
    rows = []
    for label in bits_list:
        bits, rotate = parse_setting(label)
        if bits == 32:
            continue
        codec = RotatedQuantizer(bits, ROTATED_CHUNK_SIZE) if rotate else Quantizer(bits)  # DataParallelSGD's
        residual = torch.zeros(numel)
        payload = torch.empty(codec.payload_bytes(numel), dtype=torch.uint8)
        encode_ms = _best_ms(partial(codec.encode_with_feedback, x, residual, out=payload), repeats)
        decode_ms = _best_ms(partial(codec.decode, payload, numel, out=target), repeats)
        rows.append(
            {
                "bits": label,
                "numel": numel,
                "encode_feedback_ms": encode_ms,
                "decode_ms": decode_ms,
                "copy_ms": copy_ms,
                "encode_vs_copy": encode_ms / copy_ms,
                "decode_vs_copy": decode_ms / copy_ms,
            }
        )
    return rows


def print_codec_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print(f"codec beside a memory copy of the same float32 ({rows[0]['numel']:,} elements, one thread, min of runs)")
    columns = [("bits", "{bits}"), ("encode+fb ms", "{encode_feedback_ms:.1f}"), ("decode ms", "{decode_ms:.1f}")]
    columns += [("copy ms", "{copy_ms:.1f}"), ("encode/copy", "{encode_vs_copy:.2f}")]
    columns += [("decode/copy", "{decode_vs_copy:.2f}")]
    print(format_records(rows, columns, left=0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bunsan.bench.quantized", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp-10m,cnn")
    parser.add_argument(
        "--bits",
        default="32,16,8,4,2,1,1r",
        help="bit widths; r = rotated chunks (DataParallelSGD(rotate=True)), e.g. 1r",
    )
    parser.add_argument("--batch", type=int, default=32, help="per-worker batch")
    parser.add_argument("--steps", type=int, default=3, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this file (rank 0)")
    parser.add_argument(
        "--codec-only", action="store_true", help="only the codec-versus-copy table, in this process (no job)"
    )
    args = parser.parse_args(argv)
    bits_list = [b.strip() for b in args.bits.split(",")]
    for label in bits_list:  # refuse bad input before joining the job
        try:
            parse_setting(label)
        except ValueError as e:
            parser.error(str(e))
    torch.set_num_threads(1)
    numel = sum(p.numel() for p in MODELS[args.models.split(",")[0]]()[0].parameters())
    if args.codec_only:
        codec_rows = codec_vs_copy(numel, bits_list)
        print_codec_table(codec_rows)
        if args.json:
            write_json(args.json, {"codec": codec_rows})
        return 0
    bunsan.init()
    codec_rows = codec_vs_copy(numel, bits_list)  # every rank at once: each sees the same load
    rows = [row for m in args.models.split(",") for row in measure(m, bits_list, args.batch, args.steps, args.rounds)]
    if bunsan.is_main():
        print(
            f"DataParallelSGD by bit width, {bunsan.size()} workers, batch {args.batch}/worker, "
            f"median of {args.rounds} alternating rounds x {args.steps} steps; ratios to bits=32"
        )
        columns: list[Column] = [("model", "{model}"), ("bits", "{bits}"), ("ms/step", "{ms_per_step:.1f}")]
        columns += [("time ratio", "{time_ratio:.3f}"), ("MB sent/step", lambda r: f"{r['bytes_per_step'] / 1e6:.3f}")]
        columns += [("bytes ratio", "{bytes_ratio:.4f}"), ("codec ms", "{codec_ms_per_step:.1f}")]
        print(format_records(rows, columns))
        print()
        print_codec_table(codec_rows)
        if args.json:
            write_json(args.json, {"workers": bunsan.size(), "rows": rows, "codec": codec_rows})
    bunsan.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
