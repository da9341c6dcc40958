"""Run test bodies on gloo ranks that live for a whole test module.

Spawning ranks for each test costs 3-9 s on a 2-core machine (interpreter,
``import torch``, the lazy ``torch._dynamo`` import). A pool started once per
module runs each body in milliseconds. Bodies are module-level functions
``_body_x(rank, world_size, **kwargs)`` named as ``"package.module:function"``.
"""

from __future__ import annotations

import importlib
import os
import queue
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

RESULT_TIMEOUT_S = 90.0  # one body, all ranks
GRACE_S = 5.0  # after one rank failed, wait this long for the others' tracebacks
PG_TIMEOUT_S = 30.0  # a collective that waits longer than this raises


def _resolve(target: str) -> Any:
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    return obj


def _worker_loop(rank: int, world_size: int, store_path: str, tasks: Any, results: Any) -> None:
    # One intra-op thread per rank, before the first torch op: 2 ranks x 2 threads
    # on 2 cores made a step 15x slower.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world_size),  # a file: no port to collide on
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    # The first optimizer in a process imports torch._dynamo and ~800 modules: pay it once.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    results.put((rank, None, "ready"))
    while (task := tasks.get()) is not None:
        target, kwargs = task
        try:
            torch.manual_seed(0)  # same seed on every rank, fresh for every body
            value = _resolve(target)(rank=rank, world_size=world_size, **kwargs)
            results.put((rank, None, value))
        except BaseException:  # noqa: BLE001 - report everything, SystemExit included
            results.put((rank, traceback.format_exc(), None))
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` gloo ranks that run test bodies one after another.

    After a failed or silent body the ranks may be stuck in mismatched
    collectives, so the next :meth:`run` starts fresh processes.
    """

    def __init__(self, store_dir: Path, world_size: int = 2) -> None:
        self.world_size = world_size
        self._store_dir = Path(store_dir)
        self._ctx = mp.get_context("spawn")  # never fork: forked children can hang in OpenMP
        self._generation = 0
        self._procs: list[Any] = []
        self._healthy = False  # close() reads it if the first start times out
        self._start()

    def _start(self) -> None:
        self._generation += 1
        store_path = str(self._store_dir / f"store-{self._generation}")
        self._tasks = [self._ctx.SimpleQueue() for _ in range(self.world_size)]
        self._results = self._ctx.Queue()
        self._procs = [
            self._ctx.Process(
                target=_worker_loop,
                args=(rank, self.world_size, store_path, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()
        for _ in range(self.world_size):  # wait until every rank has joined the group
            try:
                self._results.get(timeout=RESULT_TIMEOUT_S)
            except queue.Empty:
                self.close()
                raise TimeoutError("worker pool did not start within its timeout") from None
        self._healthy = True

    def run(self, target: str, **kwargs: Any) -> list[Any]:
        """Call ``target(rank=r, world_size=n, **kwargs)`` on every rank ``r``.

        Returns the ranks' return values in rank order. Raises ``AssertionError``
        with every failed rank's traceback, or ``TimeoutError`` when a rank stays
        silent.
        """
        if not self._healthy:
            self.close()
            self._start()
        for tasks in self._tasks:
            tasks.put((target, kwargs))
        values: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        answered = 0
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while answered < self.world_size:
            timeout = GRACE_S if errors else deadline - time.monotonic()
            try:
                rank, error, value = self._results.get(timeout=max(timeout, 0.0))
            except queue.Empty:
                break
            answered += 1
            if error is None:
                values[rank] = value
            else:
                errors[rank] = error
        self._healthy = not errors and answered == self.world_size
        if errors:
            report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{target} failed on ranks {sorted(errors)}:\n{report}")
        if answered < self.world_size:
            raise TimeoutError(f"{target}: {self.world_size - answered} rank(s) silent after {RESULT_TIMEOUT_S:.0f} s")
        return values

    def close(self) -> None:
        if self._healthy:
            for tasks in self._tasks:
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=5 if self._healthy else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
