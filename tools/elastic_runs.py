"""Kill a worker of an elastic job at a random step, many times, and say what became of each job.

Campaign tooling for issue 67's acceptance, run from a checkout as root or not::

    python tools/elastic_runs.py --jobs 20                 # kill -9 one worker per job (slots in turn, 0 included)
    python tools/elastic_runs.py --jobs 3 --kill none      # the uninterrupted jobs, seeds 0, 1, 2
    python tools/elastic_runs.py --jobs 10 --kill second   # a second kill while the others recover
    python tools/elastic_runs.py --jobs 5 --kill rejoin    # the killed slot starts again and joins
    python tools/elastic_runs.py --jobs 5 --kill restart --checkpoint   # the same kill in a fixed group:
                                                           # --max-restarts 1 and a checkpoint every epoch

Each job is ``bunsan run -np NP --min-np MIN`` of this file's worker: the MNIST-1D CNN with
``bunsan.epochs``, a global batch of 128, SGD lr 0.05 momentum 0.9. The workers trace their steps
(``BUNSAN_ELASTIC_TRACE``); this script kills the chosen worker with SIGKILL once its trace shows the
chosen step, then reads the traces: seconds from the kill to the next committed step, whether every worker
that finished holds the same parameters, the final test error, the exit code, and the processes of the job
left afterwards. One line per job, then a summary; ``--out`` keeps every record as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def worker(epochs: int, seed: int, out: Path, checkpoint: bool, algorithm: str = "data_parallel") -> None:
    """One worker of the job (run by bunsan run): elastic, or (``checkpoint``) a fixed group that saves a
    checkpoint at every epoch's end and resumes from it when ``--max-restarts`` starts it again."""
    import torch
    import torch.nn.functional as F

    import bunsan
    from bunsan import datasets
    from bunsan.bench.specs import parse_algorithm_spec
    from bunsan.models import MNIST1DCNN

    bunsan.init()
    torch.manual_seed(seed)
    train, test = datasets.load("mnist1d", "train"), datasets.load("mnist1d", "test")
    model = MNIST1DCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    setting = parse_algorithm_spec(algorithm)
    model, optimizer = bunsan.distribute(model, optimizer, setting.name, **setting.options)
    loader = bunsan.data.loader(train, batch_size=32, shuffle=True, seed=seed)
    member = bunsan.elastic.current()
    name = member.replica if member is not None else f"rank{bunsan.rank()}"
    start = os.environ.get("BUNSAN_RESTART", "0")  # a trace per start, as the member's (<job>-<slot>-<start>)
    trace = open(out / f"{name}-{start}.trace", "a") if member is None else None  # noqa: SIM115 - the member traces its own
    saved, first = out / "checkpoint.pt", 0
    if checkpoint and saved.exists():
        state = torch.load(saved)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["epoch"]
    step = first * len(loader)
    for epoch in bunsan.epochs(epochs) if member is not None else range(first, epochs):
        if member is None:
            loader.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1
            if trace is not None:
                trace.write(f"{time.time():.6f} {step} 1 {bunsan.size()}\n")
                trace.flush()
        if checkpoint and bunsan.is_main():
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            torch.save(state, out / "checkpoint.tmp")
            os.replace(out / "checkpoint.tmp", saved)
    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        error = float((model(x).argmax(1) != y).float().mean())
    digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    (out / f"final-{name}.json").write_text(json.dumps({"digest": digest, "test_error": error}))
    bunsan.finalize()


def _job_pids(job_id: str) -> dict[str, int]:
    """Worker name (the replica's, or ``rank<R>`` in a fixed group) -> pid, for the live workers of ``job_id``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path("/proc", entry, "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"BUNSAN_JOB_ID={job_id}".encode() in env:
            values = dict(item.split(b"=", 1) for item in env if b"=" in item)
            if b"BUNSAN_ELASTIC_REPLICA" in values:
                found[values[b"BUNSAN_ELASTIC_REPLICA"].decode()] = int(entry)
            elif b"RANK" in values and b"BUNSAN_LAUNCHER" in values:
                found[f"rank{values[b'RANK'].decode()}"] = int(entry)
    return found


def _trace(folder: Path) -> dict[str, list[tuple[float, int, int, int]]]:
    steps = {}
    for path in folder.glob("*.trace"):
        rows = [row for row in (line.split() for line in path.read_text().split("\n")[:-1]) if len(row) == 4]
        steps[path.stem] = [(float(t), int(s), int(c), int(m)) for t, s, c, m in rows]
    return steps


def _wait_for_step(folder: Path, replica: str, step: int, process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    path = folder / f"{replica}.trace"
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists():  # complete lines only: the worker may be writing the last one
            lines = [line.split() for line in path.read_text().split("\n")[:-1]]
            if lines and len(lines[-1]) == 4 and int(lines[-1][1]) >= step:
                return True
        time.sleep(0.01)
    return False


def run_one(args: argparse.Namespace, index: int, folder: Path) -> dict[str, Any]:
    """One job (module docstring); its record."""
    rng = random.Random(1000 + index)
    seed = index % 3 if args.kill == "none" else args.seed
    job_id = f"el{uuid.uuid4().hex[:10]}"
    shutil.rmtree(folder, ignore_errors=True)  # a rerun into the same --out
    folder.mkdir(parents=True)
    env = {**os.environ, "BUNSAN_ELASTIC_TRACE": str(folder), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    restarts = ["--max-restarts", "1"] if args.kill in ("rejoin", "restart") else []
    elastic = [] if args.checkpoint else ["--min-np", str(args.min_np)]
    command = [sys.executable, "-m", "bunsan", "run", "-np", str(args.np), *elastic]
    command += ["--oversubscribe", "--job-id", job_id, *restarts, sys.executable, __file__, "--worker"]
    command += ["--epochs", str(args.epochs), "--seed", str(seed), "--out", str(folder), "--algorithm", args.algorithm]
    command += ["--checkpoint"] if args.checkpoint else []
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    record: dict[str, Any] = {"run": index, "seed": seed, "kill": args.kill, "np": args.np}
    steps_total = args.epochs * (4000 // 128)
    if args.kill != "none":
        slot, step = index % args.np, rng.randrange(steps_total // 10, 9 * steps_total // 10)
        target = f"rank{slot}" if args.checkpoint else f"{job_id}-{slot}-0"
        record.update(slot=slot, step=step)
        if _wait_for_step(folder, f"rank{slot}-0" if args.checkpoint else target, step, process, args.timeout):
            pid = _job_pids(job_id).get(target)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                record["killed_at"] = time.time()
            if args.kill == "second":
                _second_kill(folder, job_id, target, process, record)
            if args.kill == "rejoin":
                record["joiner_started_at"] = _wait_for_start(job_id, f"{job_id}-{slot}-1", process)
    try:
        output, _ = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        record["timed_out"] = True
    record.update(code=process.returncode, wall_s=time.monotonic() - started)
    time.sleep(2.0)
    record["left"] = len(_job_pids(job_id))
    record["launcher"] = [line for line in output.decode(errors="replace").splitlines() if "bunsan run:" in line][-3:]
    _summarize_traces(folder, record)
    return record


def _wait_for_start(job_id: str, replica: str, process: subprocess.Popen[bytes]) -> float | None:
    """When the restarted worker's process appears (polled every 5 ms)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        if replica in _job_pids(job_id):
            return time.time()
        time.sleep(0.005)
    return None


def _second_kill(folder: Path, job_id: str, first: str, process: subprocess.Popen[bytes], record: dict) -> None:
    """Kill another worker as soon as a survivor's trace shows the dropped step (the group is rebuilding)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        traces = _trace(folder)
        if any(row[2] == 0 for name, rows in traces.items() if name != first for row in rows):
            others = sorted(name for name in _job_pids(job_id) if name != first and name.startswith(job_id))
            if others:
                os.kill(_job_pids(job_id)[others[-1]], signal.SIGKILL)
                record["second_killed_at"] = time.time()
            return
        time.sleep(0.005)


def _summarize_traces(folder: Path, record: dict[str, Any]) -> None:
    traces = _trace(folder)
    finals = [json.loads(p.read_text()) for p in folder.glob("final-*.json")]
    record["finished"] = len(finals)
    record["replicas_equal"] = len({f["digest"] for f in finals}) == 1 if finals else False
    record["test_error"] = statistics.mean(f["test_error"] for f in finals) if finals else None
    restarted = {name: rows for name, rows in traces.items() if not name.endswith("-0")}
    killed = record.get("killed_at")
    if record["kill"] == "restart":  # a fixed group: every worker starts again from the checkpoint
        # the steps each restarted worker trains that its first start had trained; the first of them
        # ends the recovery (the survivors' steps after the kill are lost with them)
        redone = [
            sum(s <= max(r[1] for r in traces[n[:-2] + "-0"]) for _, s, _, _ in rows) for n, rows in restarted.items()
        ]
        record["redone_steps"] = max(redone, default=0)
        traces = restarted
    else:
        longest = max(traces.values(), key=len, default=[])
        steps = [step for _, step, committed, _ in longest if committed]
        record["redone_steps"] = len(steps) - len(set(steps)) + sum(not row[2] for row in longest)
    if killed is not None:
        after = [t for rows in traces.values() for t, _, committed, _ in rows if committed and t > killed]
        record["recovery_s"] = min(after) - killed if after else None
    started = record.get("joiner_started_at")
    if restarted and started:  # the restarted worker: from its process's start to its first step in a full group
        full = [t for t, _, _, members in next(iter(restarted.values())) if members == record["np"]]
        record["rejoined_s"] = full[0] - started if full else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=20, help="jobs to run, one after the other")
    parser.add_argument("--kill", choices=("one", "none", "second", "rejoin", "restart"), default="one")
    parser.add_argument(
        "--checkpoint", action="store_true", help="a fixed group that checkpoints every epoch (with --kill restart)"
    )
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--min-np", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--algorithm", default="data_parallel", help="NAME[:KEY=VALUE,...], e.g. data_parallel:bits=1 (bench specs)"
    )
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=Path("runs/elastic"))
    args = parser.parse_args(argv)
    if (args.kill == "restart") != args.checkpoint and not args.worker and args.kill != "none":
        parser.error("--kill restart goes with --checkpoint (a fixed group that restarts from its checkpoint)")
    if args.worker:
        worker(args.epochs, args.seed, args.out, args.checkpoint, args.algorithm)
        return 0
    stamp = f"load average {os.getloadavg()[0]:.2f} at the start"
    records = []
    for index in range(args.jobs):
        record = run_one(args, index, args.out / f"{args.kill}-{index}")
        records.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "launcher"}), flush=True)
    (args.out / f"{args.kill}.json").write_text(json.dumps(records, indent=1))
    ok = sum(r["code"] == 0 and r["replicas_equal"] and r["left"] == 0 for r in records)
    recoveries = [r["recovery_s"] for r in records if r.get("recovery_s") is not None]
    errors = [100 * r["test_error"] for r in records if r.get("test_error") is not None]
    print(
        f"{args.kill}: {ok}/{len(records)} exit 0 with equal replicas and nothing left; {stamp}, "
        f"{os.getloadavg()[0]:.2f} at the end"
    )
    if recoveries:
        print(f"kill to next committed step: median {statistics.median(recoveries):.2f} s, max {max(recoveries):.2f} s")
    rejoins = [r["rejoined_s"] for r in records if r.get("rejoined_s") is not None]
    if rejoins:
        print(
            f"restarted worker's start to a full group: median {statistics.median(rejoins):.2f} s, max {max(rejoins):.2f} s"
        )
    walls = [r["wall_s"] for r in records]
    redone = [r["redone_steps"] for r in records]
    print(
        f"job wall time: median {statistics.median(walls):.1f} s; steps trained twice: median {statistics.median(redone)}"
    )
    if errors:
        print(f"final test error: mean {statistics.mean(errors):.2f}%, {min(errors):.2f}-{max(errors):.2f}%")
    return 0 if ok == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
