"""The tiny all-reduce job that ``bunsan doctor`` runs with one worker per host.

It lives here, not in ``bunsan.launch``, because the launcher side imports
nothing of the training side (DESIGN.md): ``bunsan doctor`` starts it through
``bunsan run -- python -m bunsan.bench.probe``.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import torch

import bunsan
from bunsan import comm

__all__ = ["main"]


def main() -> int:
    """One worker of the tiny all-reduce job: every rank adds rank + 1; print the result as JSON."""
    info = bunsan.init(timeout_s=60.0)
    value = torch.tensor([float(info.rank + 1)], device=comm.tensor_device())  # NCCL: a CUDA tensor
    started = time.perf_counter()
    comm.all_reduce(value)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    expected = info.world_size * (info.world_size + 1) / 2
    print(
        json.dumps(
            {
                "rank": info.rank,
                "host": socket.gethostname(),
                "sum": value.item(),
                "expected": expected,
                "ms": round(elapsed_ms, 2),
            }
        ),
        flush=True,
    )
    bunsan.finalize()
    return 0 if value.item() == expected else 1


if __name__ == "__main__":
    sys.exit(main())
