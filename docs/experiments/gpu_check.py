"""bunsan's NCCL/CUDA path on one GPU: every algorithm, Auto, evaluation, sessions, finalize.

Run on a machine with a CUDA device (``python docs/experiments/gpu_check.py [--json PATH]``,
or under ``torchrun --nproc_per_node N`` with N GPUs). NCCL moves only CUDA tensors, so any
collective that bunsan makes on a CPU tensor fails here even at one worker, where the CPU
test suite (Gloo) cannot see it. Each case trains the digits CNN on the GPU for 60 steps of
batch 32 and prints one line: ``ok`` with its loss and test accuracy, or ``FAIL`` with the
error's last line (the traceback follows). Auto's line also gives the step time it measured
against the synchronized step time of the same loop: on a GPU a step's kernels run after the
host returns, and a clock read without synchronizing times the launches.

Exit status: the number of failed cases (0: all passed).
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import bunsan
from bunsan.datasets import digits
from bunsan.models import DigitsCNN

STEPS = 60
BATCH = 32


def _sync() -> None:
    if bunsan.device().type == "cuda":
        torch.cuda.synchronize()


def _train(model: torch.nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor, *, amp: bool = False) -> float:
    kind = bunsan.device().type
    scaler = torch.amp.GradScaler(kind, enabled=amp)
    loss = torch.zeros(())
    for step in range(STEPS):
        i = (step * BATCH) % (len(x) - BATCH)
        optimizer.zero_grad()
        with torch.autocast(kind, dtype=torch.float16 if kind == "cuda" else torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x[i : i + BATCH]), y[i : i + BATCH])
        scaler.scale(loss).backward()
        if amp:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    return float(loss)


def _algorithms() -> dict[str, Callable[[], Any]]:
    return {
        "exact": lambda: bunsan.DataParallelSGD(),
        "fp16": lambda: bunsan.DataParallelSGD(compression="fp16"),
        "8-bit": lambda: bunsan.DataParallelSGD(bits=8),
        "1-bit": lambda: bunsan.DataParallelSGD(bits=1),
        "block_momentum": lambda: bunsan.BlockMomentumSGD(block_size=8 * BATCH),
        "model_averaging": lambda: bunsan.ModelAveragingSGD(block_size=8 * BATCH),
        "async": lambda: bunsan.AsyncSGD(),
        "auto": lambda: bunsan.Auto(risk="high", verbose=bunsan.is_main()),
    }


def _case_algorithm(name: str, make: Callable[[], Any], data: dict[str, Any]) -> dict[str, Any]:
    device = bunsan.device()
    torch.manual_seed(0)
    model = DigitsCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    algorithm = make()
    model, optimizer = bunsan.distribute(model, optimizer, algorithm)
    _sync()
    start = time.perf_counter()
    loss = _train(model, optimizer, data["x"], data["y"])
    _sync()
    elapsed = time.perf_counter() - start
    optimizer.join()
    result = bunsan.evaluate(model, data["test"], device=device)
    buffer = io.BytesIO()  # the optimizer's state (the algorithm's, Auto's decision) saved and loaded back
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    optimizer.load_state_dict(torch.load(buffer, weights_only=False))
    found: dict[str, Any] = {"loss": loss, "accuracy": result["accuracy"], "seconds": elapsed}
    if name == "auto":
        decision = algorithm.decision or {}
        measured = decision.get("measured", {})
        found["decision"] = decision.get("label")
        found["measured_step_s"] = measured.get("exact_step_s")
        # the same loop, synchronized after every step: what a step really takes here
        times = []
        for _ in range(3):
            _sync()
            t = time.perf_counter()
            _train(model, optimizer, data["x"][: BATCH * 4], data["y"][: BATCH * 4])
            _sync()
            times.append((time.perf_counter() - t) / STEPS)
        found["synchronized_step_s"] = sorted(times)[1]
    return found


def _case_probes() -> dict[str, Any]:
    """Auto's measurements over the job's own group (at one worker Auto itself skips them: no exchange)."""
    from bunsan.algorithms import cost_model as cm
    from bunsan.algorithms.measure import measure_codec, measure_fixed_costs, measure_network
    from bunsan.algorithms.network_model import Network

    device = bunsan.device()
    found: dict[str, Any] = {}
    try:
        network = measure_network(sizes=(4, 1 << 20, 4 << 20), repeats=3)
        found["network"] = {"latency_us": network.latency_s * 1e6, "bandwidth_GBps": network.bandwidth / 1e9}
    except ValueError as e:  # one rank: the times need not grow with size; the collectives ran
        found["network"] = f"inconclusive at {bunsan.size()} worker(s): {e}"
    codec = measure_codec(_digits_cnn_params(), bits=1, collective=True, device=device)
    found["codec_1bit_ns_per_element"] = 1e9 * (codec["encode_s_per_element"] + codec["decode_s_per_element"])
    candidates = [
        cm.Candidate("data_parallel", {}, "exact"),
        cm.Candidate("data_parallel", {"compression": "fp16"}, "fp16"),
        cm.Candidate("data_parallel", {"bits": 1}, "1-bit"),
        cm.Candidate("block_momentum", {"block_size": 64}, "block_momentum"),
    ]
    fixed = measure_fixed_costs(candidates, Network(latency_s=1e-5, bandwidth=1e10))
    found["fixed_ms"] = {label: 1e3 * s for label, s in fixed}
    return found


def _digits_cnn_params() -> int:
    return sum(p.numel() for p in DigitsCNN().parameters())


def _case_amp_clip(data: dict[str, Any]) -> dict[str, Any]:
    device = bunsan.device()
    torch.manual_seed(0)
    model = DigitsCNN().to(device)
    model, optimizer = bunsan.distribute(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "data_parallel")
    loss = _train(model, optimizer, data["x"], data["y"], amp=True)
    return {"loss": loss, "accuracy": bunsan.evaluate(model, data["test"], device=device)["accuracy"]}


def _case_sync_batchnorm(data: dict[str, Any]) -> dict[str, Any]:
    device = bunsan.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 8 * 8, 10),
    )
    model = bunsan.nn.convert_sync_batchnorm(model).to(device)
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.05), "data_parallel")
    loss = _train(model, optimizer, data["x"], data["y"])
    return {"loss": loss, "accuracy": bunsan.evaluate(model, data["test"], device=device)["accuracy"]}


def _case_session(data: dict[str, Any]) -> dict[str, Any]:
    device = bunsan.device()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = DigitsCNN().to(device)
        session = bunsan.TrainingSession(
            model,
            F.cross_entropy,
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            "data_parallel",
            train_data=digits("train"),
            minibatch_size=32 * bunsan.size(),
            max_epochs=2,
            checkpoint=bunsan.Checkpoint(Path(tmp) / "ckpt"),
            test=bunsan.Test(digits("test")),
            progress=False,
        )
        session.train()
        found = {"checkpoints": sorted(p.name for p in Path(tmp).rglob("*") if p.is_file())}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here (rank 0)")
    parser.add_argument("--backend", default="nccl", help="gloo: the same cases on the CPU (a dry run of this script)")
    args = parser.parse_args(argv)
    bunsan.init(backend=args.backend, timeout_s=120.0)
    device = bunsan.device()
    rank = bunsan.rank()
    train = digits("train")
    x, y = (t.to(device) for t in train.tensors)
    data = {"x": x, "y": y, "test": digits("test")}
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        name: (lambda name=name, make=make: _case_algorithm(name, make, data)) for name, make in _algorithms().items()
    }
    cases["Auto's probes"] = _case_probes
    cases["exact AdamW+GradScaler+clip"] = lambda: _case_amp_clip(data)
    cases["SyncBatchNorm"] = lambda: _case_sync_batchnorm(data)
    cases["TrainingSession+Checkpoint+Test"] = lambda: _case_session(data)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "workers": bunsan.size(),
        "cases": {},
    }
    failed = 0
    for name, case in cases.items():
        try:
            found = case()
            results["cases"][name] = {"ok": True, **found}
            bunsan.print(f"ok    {name:32s} {json.dumps(found, default=str)}")
        except Exception as e:  # report every case, not only the first failure
            failed += 1
            results["cases"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
            bunsan.print(f"FAIL  {name:32s} {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if bunsan.is_main():
                traceback.print_exc()
    try:
        bunsan.finalize()
        results["finalize"] = "ok"
    except Exception as e:
        failed += 1
        results["finalize"] = f"{type(e).__name__}: {e}".splitlines()[0]
        traceback.print_exc()
    print(f"finalize: {results['finalize']}")
    if args.json is not None and rank == 0:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
