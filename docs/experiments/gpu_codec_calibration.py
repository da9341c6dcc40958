"""The cost model's codec term against the exchange's own codec work, measured side by side.

``bunsan plan --device`` and Auto predict a quantized step's codec time from
:func:`bunsan.bench.measure.measure_codec` (seconds per element of encode and decode, and the
fixed cost of one encode call and of one decode call, each a one-chunk call) and the count of
calls of each kind (:func:`bunsan.algorithms.cost_model.codec_call_counts`). Each row also
prints what the model predicted before the two calls were timed apart (every call at their
mean, ``codec_calls`` of them: "mean"). This script measures that profile and the
exchange's codec work of one step (``gpu_codec_calls._one_step_s``: the exchange's own
``_launch_stripes`` / ``_finish_stripes``, collectives stubbed) alternately, ``--rounds`` times,
and prints both, with the fixed-cost probe's parts (the one-chunk encode and decode apart) and
the one-call codec's encode and decode of a whole bucket, so a gap can be placed.

Usage (on a GPU machine): ``python docs/experiments/gpu_codec_calibration.py [--model resnet20]
[--workers 2,8,32,256] [--bits 1,8] [--rounds 3] [--json PATH]``; a recorded run priced again with
the model at the checkout, on any machine: ``--reprice docs/experiments/gpu-h200/codec_calibration_cebdee4.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
from pathlib import Path

import torch

from bunsan import models
from bunsan.algorithms.cost_model import Profile, codec_call_counts, codec_elements, mean_call_profile
from bunsan.algorithms.data_parallel import DataParallelSGD
from bunsan.algorithms.data_parallel.buckets import build_buckets
from bunsan.algorithms.data_parallel.stripes import coded_per_bucket
from bunsan.algorithms.measure import CODEC_NUMEL_CAP, measure_codec, median_time
from bunsan.bench.synthetic import model_inputs
from bunsan.compression import Quantizer
from bunsan.compression.segments import SegmentCodec


def _calls_module():
    spec = importlib.util.spec_from_file_location("gpu_codec_calls", Path(__file__).with_name("gpu_codec_calls.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parts(numel: int, bits: int, device: torch.device, segments: list[tuple[int, int]]) -> dict[str, float]:
    """The fixed-cost probe's encode and decode apart, and one bucket's one-call encode and decode."""
    q = Quantizer(bits)
    x = torch.randn(numel, device=device)
    residual = torch.zeros(numel, device=device)
    out = torch.empty(numel, device=device)
    small = min(q.chunk_size, numel)
    one = SegmentCodec(q, [(0, small, 0)], device)
    one_payload = torch.empty(q.payload_bytes(small), dtype=torch.uint8, device=device)
    cuts, at = [], 0
    for lo, length in segments:
        cuts.append((lo, length, at))
        at += q.payload_bytes(length)
    whole = SegmentCodec(q, cuts, device)
    payload = torch.empty(at, dtype=torch.uint8, device=device)
    found = {}
    for name, fn in (
        ("one_encode_s", lambda: one.encode(x, one_payload, residual)),
        ("one_decode_s", lambda: one.decode(one_payload, out)),
        ("bucket_encode_s", lambda: whole.encode(x, payload, residual)),
        ("bucket_decode_s", lambda: whole.decode(payload, out)),
    ):
        fn()  # warm up
        found[name] = median_time(fn, 9, device)
    return found


def codec_price(figures: dict, encoded: float, decoded: float, encodes: float, decodes: float) -> float:
    """Seconds of codec work a step, the cost model's way: ``figures`` holds measure_codec's per-element
    and per-call costs; the elements and calls of each kind from :func:`codec_elements` and
    :func:`codec_call_counts`."""
    return (
        figures["encode_s_per_element"] * encoded
        + figures["decode_s_per_element"] * decoded
        + figures["encode_call_s"] * encodes
        + figures["decode_call_s"] * decodes
    )


def reprice(path: str) -> None:
    """Each recorded row's codec time priced again from its own recorded profile and call counts with
    the element counts at this checkout (:func:`bunsan.algorithms.cost_model.codec_elements`), medians
    over rounds beside the recorded prediction and the measurement."""
    try:
        record = json.loads(Path(path).read_text())
        record["rows"][0]["encode_calls"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        raise SystemExit(f"gpu_codec_calibration: {path} is not a calibration record of this script ({err})") from None
    kwargs, _ = model_inputs(record["model"], None, 10)
    params = sum(p.numel() for p in models.create(record["model"], **kwargs).parameters())
    for bits in sorted({r["bits"] for r in record["rows"]}):
        for workers in sorted({r["workers"] for r in record["rows"]}):
            mine = [r for r in record["rows"] if r["bits"] == bits and r["workers"] == workers]
            if not mine:
                continue
            encoded, decoded = codec_elements(params, workers)
            now = statistics.median(
                codec_price(r, encoded, decoded, r["encode_calls"], r["decode_calls"]) for r in mine
            )
            then = statistics.median(r["predicted_s"] for r in mine)
            m = statistics.median(r["measured_s"] for r in mine)
            print(
                f"median {bits:2d} bit {workers:4d} workers: recorded {then * 1e3:.2f} ms ({then / m - 1:+.0%}),"
                f" at this checkout {now * 1e3:.2f} ms ({now / m - 1:+.0%}), measured {m * 1e3:.2f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--workers", default="2,8,32,256")
    parser.add_argument("--bits", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--reprice",
        default=None,
        metavar="JSON",
        help="price a recorded run's rows again with the model at this checkout (no GPU needed) and exit",
    )
    args = parser.parse_args()
    if args.reprice:
        reprice(args.reprice)
        return
    device = torch.device(args.device)
    calls = _calls_module()
    for name in ("all_to_all", "all_gather_into", "wait"):  # as gpu_codec_calls stubs them: no wire
        setattr(calls.exchange, name, calls._no_collective)
    kwargs, _ = model_inputs(args.model, None, 10)
    model = models.create(args.model, **kwargs).to(device)
    named = list(model.named_parameters())
    params = sum(p.numel() for _, p in named)
    buckets = build_buckets(named, int(DataParallelSGD(bits=1).bucket_size_mb * 2**20), 2)
    largest = max(buckets, key=lambda b: b.buffer.numel())
    segments = [(offset, p.numel()) for offset, p in zip(largest.offsets, largest.params)]
    per_bucket = coded_per_bucket(Quantizer(1), device)
    print(f"{args.model}: {params:,} parameters in {len(named)} tensors, {len(buckets)} buckets, on {device}")
    rows = []
    for round_ in range(args.rounds):
        for bits in [int(b) for b in args.bits.split(",")]:
            profile = measure_codec(params, bits, device=device)
            parts = _parts(largest.buffer.numel(), bits, device, segments) if per_bucket else {}
            for workers in [int(n) for n in args.workers.split(",")]:
                os.environ["BUNSAN_CODEC_CALLS"] = "bucket" if per_bucket else "segment"
                measured = calls._one_step_s(named, bits, workers, 7, device)
                encodes, decodes = codec_call_counts(len(named), len(buckets), workers, per_bucket)
                count = encodes + decodes
                encoded, decoded = codec_elements(params, workers)
                predicted = codec_price(profile, encoded, decoded, encodes, decodes)
                # the model before the split (cost_model.mean_call_profile): per-element costs net of the
                # mean call, every call at the mean
                before = mean_call_profile(
                    Profile(compute_s=1.0, params=params, **profile), min(params, CODEC_NUMEL_CAP)
                )
                predicted_mean = (
                    before.encode_s_per_element * encoded
                    + before.decode_s_per_element * decoded
                    + before.codec_call_s * count
                )
                row = {
                    "round": round_,
                    "bits": bits,
                    "workers": workers,
                    "calls": count,
                    "encode_calls": encodes,
                    "decode_calls": decodes,
                    "predicted_s": predicted,
                    "predicted_mean_s": predicted_mean,
                    "measured_s": measured,
                    **profile,
                    **parts,
                }
                rows.append(row)
                print(
                    f"round {round_} {bits:2d} bit {workers:4d} workers: predicted {predicted * 1e3:7.2f} ms"
                    f" (encode call {profile['encode_call_s'] * 1e3:.3f} ms x {encodes:g}, decode call"
                    f" {profile['decode_call_s'] * 1e3:.3f} ms x {decodes:g}, encode"
                    f" {profile['encode_s_per_element'] * 1e9:.2f} ns/el; mean {predicted_mean * 1e3:.2f} ms)"
                    f" measured {measured * 1e3:7.2f} ms ({predicted / measured - 1:+.0%}; mean"
                    f" {predicted_mean / measured - 1:+.0%})"
                    + (
                        f"; probe encode {parts['one_encode_s'] * 1e3:.3f} decode {parts['one_decode_s'] * 1e3:.3f} ms,"
                        f" bucket encode {parts['bucket_encode_s'] * 1e3:.3f} decode"
                        f" {parts['bucket_decode_s'] * 1e3:.3f} ms"
                        if parts
                        else ""
                    )
                )
    for bits in sorted({r["bits"] for r in rows}):
        for workers in sorted({r["workers"] for r in rows}):
            mine = [r for r in rows if r["bits"] == bits and r["workers"] == workers]
            p = statistics.median(r["predicted_s"] for r in mine)
            pm = statistics.median(r["predicted_mean_s"] for r in mine)
            m = statistics.median(r["measured_s"] for r in mine)
            print(
                f"median {bits:2d} bit {workers:4d} workers: predicted {p * 1e3:.2f} ms, measured {m * 1e3:.2f} ms"
                f" ({p / m - 1:+.0%}); every call at the mean {pm * 1e3:.2f} ms ({pm / m - 1:+.0%})"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model": args.model, "device": str(device), "torch": torch.__version__, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
