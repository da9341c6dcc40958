"""Golden runs: short deterministic trainings whose results are stored in the repository.

Each run is ``bunsan bench compare``'s job (:func:`bunsan.bench.job.train`) with
the README's compare settings (MNIST-1D CNN, global batch 128, lr 0.5, momentum 0,
seed 0), cut to 2 epochs, at 1 and 2 workers, for exact data parallel and each
algorithm. Their per-epoch training losses and final test error and loss are in
``values.json``. A change in the training dynamics (data order, initialization,
the optimizer path, an algorithm) changes them, and ``test_golden.py`` fails
instead of the README's figures going silently stale.

Regenerate after an intended change (then commit values.json and say why)::

    python -m tests.golden --update        # or: make golden-update
    python -m tests.golden                 # check only, as the test does

What "the same" means:

* Every run except ``async`` must repeat bit for bit: same code, same data, same
  kernels. The runs pin the kernels so that other x86-64 machines give the same
  bits too: ATen's portable ``default`` CPU kernels instead of the ones chosen for
  this CPU (``ATEN_CPU_CAPABILITY``), oneDNN (mkldnn) off, MKL in its conditional
  numerical reproducibility mode (``MKL_CBWR=COMPATIBLE``), one thread per worker.
  Measured on this project's machine: the same 20-epoch compare run ends at 14.0%
  to 23.9% test error depending on these choices alone, while the losses of the
  first two epochs agree to 1e-4 (README, "Benchmarks").
* ``async`` at 2 workers is nondeterministic by design (the parameter server
  applies updates in arrival order), so it is checked to a tolerance,
  :data:`ASYNC_TOLERANCE`, on the median of :data:`ASYNC_RERUNS` reruns, and runs
  at :data:`ASYNC_LR` (both runs, so that the 1-worker one, deterministic, covers
  the same setting exactly).
* The stored fingerprint (torch version, machine architecture, a digest of the
  data) must match; where it does not (another torch, an ARM machine, another
  ``mnist1d`` that generates different data), the check fails and says which part
  differs: regenerate there, or compare on the machine that recorded them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VALUES = Path(__file__).with_name("values.json")
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}
SETTINGS = {
    "model": "mnist1d_cnn",
    "dataset": "mnist1d",
    "epochs": 2,
    "batch": 128,
    "lr": 0.5,
    "momentum": 0.0,
    "seed": 0,
    "curves": False,
}
ALGORITHMS = [
    "data_parallel",
    "data_parallel:bits=1",
    "block_momentum:block_size=1024,block_learning_rate=0.5",
    "model_averaging:block_size=1024",
    "async",  # last: its parameter server is the one run that is not deterministic
]
# async applies every worker's update in full: at lr 0.5 and 2 workers five reruns ended
# anywhere between 70% and 90% test error. It runs at lr 0.125 (the README's lr / N advice).
# One run there is too noisy to check alone: 66 reruns (26 quiet, 20 beside one busy process,
# 20 beside two; 2026-11-29) ended between 1.778 and 1.876 test loss, with rare outliers
# (1.876 beside two busy processes; 1.856 once under `make test`, which failed CI at 8658a65)
# while most stayed within 1.78-1.80. So the 2-worker async run is repeated ASYNC_RERUNS
# times and each value checked is the median of the reruns (element by element for the
# per-epoch losses). Medians of 5 drawn from those 66 spread by 0.024 in test loss, 2.1
# points of test error and 0.025 and 0.052 in the two training losses; the tolerances are
# about twice that. Dropping one worker's updates would move test loss by ~0.17 (the
# 1-worker run ends at 1.96), which they still catch.
ASYNC_LR = 0.125
ASYNC_RERUNS = 5
ASYNC_TOLERANCE = {"train_loss": 0.1, "test_loss": 0.05, "test_error": 0.05}
KEYS = ("train_loss", "test_error", "test_loss")


def run_names() -> list[str]:
    return [f"np{n}:{algorithm}" for n in (1, 2) for algorithm in ALGORITHMS]


def is_exact(name: str) -> bool:
    return not name.endswith(":async") or name.startswith("np1:")


def _data_digest() -> str:
    from bunsan import datasets

    h = hashlib.sha256()
    for split in ("train", "test"):
        for tensor in datasets.load("mnist1d", split).tensors:
            h.update(tensor.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def warm(rank: int, world_size: int) -> None:
    """Nothing: waits until the pool has started (for the timings of --verbose)."""


def body(rank: int, world_size: int, algorithm: str, lr: float | None = None) -> dict[str, Any] | None:
    """One golden run on this rank of a warm pool (:class:`tests.helpers.workers.WorkerPool`)."""
    import torch

    from bunsan.bench.compare import parse_algorithm_spec
    from bunsan.bench.job import JobSpec, train

    torch.backends.mkldnn.enabled = False
    setting = parse_algorithm_spec(algorithm)
    settings = dict(SETTINGS, lr=lr) if lr is not None else SETTINGS
    result = train(JobSpec(algorithm=setting.name, options=dict(setting.options), **settings))
    if result is None:
        return None
    out = {key: result[key] for key in KEYS}
    out["replicas_equal"] = result["replicas_equal"]
    out["fingerprint"] = {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "data": _data_digest(),
        "aten": torch.backends.cpu.get_cpu_capability(),
    }
    return out


def median_run(values: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's record from reruns of it: the median of each checked value (per epoch for lists)."""
    if len(values) == 1:
        return values[0]
    out = dict(values[0])
    for key in KEYS:
        column = [v[key] for v in values]
        if isinstance(column[0], list):
            out[key] = [statistics.median(epoch) for epoch in zip(*column, strict=True)]
        else:
            out[key] = statistics.median(column)
    out["replicas_equal"] = all(v["replicas_equal"] for v in values)
    return out


def measure(verbose: bool = False) -> dict[str, Any]:
    """Run every golden run in warm pools of 1 and 2 workers with the pinned kernels; return the record."""
    from tests.helpers.workers import WorkerPool

    results: dict[str, Any] = {}
    fingerprint = None
    with tempfile.TemporaryDirectory() as scratch:
        for world_size in (1, 2):
            saved = {k: os.environ.get(k) for k in PINNED_ENV}
            os.environ.update(PINNED_ENV)  # read by the spawned workers when they start, at import torch
            begin = time.perf_counter()
            try:
                pool = WorkerPool(Path(scratch), world_size=world_size)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            try:
                pool.run(f"{__name__}:warm")
                if verbose:
                    print(f"pool of {world_size}: {time.perf_counter() - begin:.1f} s to start", file=sys.stderr)
                for algorithm in ALGORITHMS:
                    begin = time.perf_counter()
                    lr = ASYNC_LR if algorithm == "async" else None
                    reruns = ASYNC_RERUNS if not is_exact(f"np{world_size}:{algorithm}") else 1
                    values = [pool.run(f"{__name__}:body", algorithm=algorithm, lr=lr)[0] for _ in range(reruns)]
                    value = median_run(values)
                    if verbose:
                        print(f"np{world_size}:{algorithm}: {time.perf_counter() - begin:.1f} s", file=sys.stderr)
                    fingerprint = value.pop("fingerprint")
                    results[f"np{world_size}:{algorithm}"] = value
            finally:
                pool.close()
    return {
        "settings": dict(SETTINGS, async_lr=ASYNC_LR, async_reruns=ASYNC_RERUNS),
        "pinned_env": PINNED_ENV,
        "fingerprint": fingerprint,
        "runs": results,
    }


def compare(stored: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """What differs between the stored record and a fresh one, one sentence each; empty when they agree."""
    problems = []
    if stored.get("fingerprint") != measured.get("fingerprint"):
        problems.append(
            f"the environment differs from the one that recorded the values: stored {stored.get('fingerprint')}, "
            f"here {measured.get('fingerprint')}; regenerate here with `python -m tests.golden --update`"
        )
    if stored.get("settings") != measured.get("settings"):
        problems.append(f"the run settings changed: stored {stored.get('settings')}, now {measured.get('settings')}")
    for name in run_names():
        old, new = stored.get("runs", {}).get(name), measured["runs"].get(name)
        if old is None or new is None:
            problems.append(f"{name}: {'not stored' if old is None else 'not measured'}")
            continue
        if not new["replicas_equal"] and name.startswith("np2:") and name != "np2:async":
            problems.append(f"{name}: the replicas differ at the end of the run")
        for key in KEYS:
            a, b = old[key], new[key]
            if is_exact(name):
                if a != b:
                    problems.append(f"{name}: {key} changed from {a!r} to {b!r} (must repeat bit for bit)")
            else:
                tol = ASYNC_TOLERANCE[key]
                pairs = zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]
                if any(abs(x - y) > tol for x, y in pairs):
                    problems.append(f"{name}: {key} moved from {a!r} to {b!r}, beyond the tolerance {tol}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.golden", description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help=f"measure and overwrite {VALUES.name}")
    parser.add_argument("--verbose", action="store_true", help="print each run's time")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    measured = measure(args.verbose)
    elapsed = time.perf_counter() - start
    if args.update:
        measured["recorded"] = {"command": "python -m tests.golden --update", "seconds": round(elapsed, 1)}
        VALUES.write_text(json.dumps(measured, indent=1, sort_keys=True) + "\n")
        print(f"wrote {VALUES} ({len(measured['runs'])} runs, {elapsed:.0f} s)")
        return 0
    problems = compare(json.loads(VALUES.read_text()), measured)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(measured['runs'])} golden runs in {elapsed:.0f} s: {'differ' if problems else 'all as stored'}")
    return 1 if problems else 0
