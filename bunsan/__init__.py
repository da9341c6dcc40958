"""bunsan (分散, "distributed"): data-parallel and model-parallel training on torch.distributed.

A single-process PyTorch script becomes a multi-worker one with a handful of lines::

    import bunsan
    bunsan.init()
    model, optimizer = bunsan.distribute(model, optimizer, bunsan.DataParallelSGD())
    loader = bunsan.data.loader(train_set, batch_size=64)   # this worker's shard

and runs under ``bunsan run -np 4 train.py``, torchrun, mpirun or srun.
"""

from __future__ import annotations

from bunsan import algorithms, comm, data, datasets, errors, models
from bunsan.algorithms import Algorithm, DataParallelSGD
from bunsan.optim import DistributedOptimizer, distribute
from bunsan.runtime import (
    device,
    finalize,
    init,
    is_initialized,
    is_main,
    local_rank,
    local_size,
    rank,
    session,
    size,
)

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "DataParallelSGD",
    "DistributedOptimizer",
    "algorithms",
    "comm",
    "data",
    "datasets",
    "device",
    "distribute",
    "errors",
    "finalize",
    "init",
    "is_initialized",
    "is_main",
    "local_rank",
    "local_size",
    "models",
    "rank",
    "session",
    "size",
]
