"""bunsan (分散, "distributed"): data-parallel and model-parallel training on torch.distributed.

A single-process PyTorch script becomes a multi-worker one with a handful of lines::

    import bunsan
    bunsan.init()
    model, optimizer = bunsan.distribute(model, optimizer, bunsan.DataParallelSGD())
    loader = bunsan.data.loader(train_set, batch_size=64)   # this worker's shard

and runs under ``bunsan run -np 4 train.py``, torchrun, mpirun or srun.

Names are imported on first use (PEP 562), so ``bunsan run`` and ``bunsan doctor``
start without importing torch: the launcher imports nothing of the training side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it ("" = the name is a submodule)
_EXPORTS: dict[str, str] = {
    "Algorithm": "bunsan.algorithms",
    "AsyncSGD": "bunsan.algorithms",
    "Auto": "bunsan.algorithms",
    "BlockMomentumSGD": "bunsan.algorithms",
    "DataParallelSGD": "bunsan.algorithms",
    "ModelAveragingSGD": "bunsan.algorithms",
    "DistributedOptimizer": "bunsan.optim",
    "distribute": "bunsan.optim",
    "epochs": "bunsan.elastic",
    "device": "bunsan.runtime",
    "finalize": "bunsan.runtime",
    "init": "bunsan.runtime",
    "is_initialized": "bunsan.runtime",
    "is_main": "bunsan.runtime",
    "local_rank": "bunsan.runtime",
    "local_size": "bunsan.runtime",
    "rank": "bunsan.runtime",
    "session": "bunsan.runtime",
    "size": "bunsan.runtime",
    "Checkpoint": "bunsan.train",
    "CrossValidation": "bunsan.train",
    "Test": "bunsan.train",
    "TrainingSession": "bunsan.train",
    "schedule": "bunsan.train",
    "RankFilter": "bunsan.console",
    "print": "bunsan.console",
    "rank_zero_only": "bunsan.console",
    "broadcast_optimizer_state": "bunsan.sync",
    "broadcast_parameters": "bunsan.sync",
    "all_reduce_metrics": "bunsan.evaluation",
    "evaluate": "bunsan.evaluation",
    "algorithms": "",
    "comm": "",
    "data": "",
    "elastic": "",
    "datasets": "",
    "errors": "",
    "hpo": "",
    "integrations": "",
    "models": "",
    "nn": "",
    "parallel": "",
    "train": "",
}

# Every name of _EXPORTS but `print`, sorted (a test checks it): `print` is bunsan.print, not part
# of `from bunsan import *`, which would silently turn every print of the importing script into a
# rank-0 print.
__all__ = [
    "Algorithm",
    "AsyncSGD",
    "Auto",
    "BlockMomentumSGD",
    "Checkpoint",
    "CrossValidation",
    "DataParallelSGD",
    "DistributedOptimizer",
    "ModelAveragingSGD",
    "RankFilter",
    "Test",
    "TrainingSession",
    "algorithms",
    "all_reduce_metrics",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "comm",
    "data",
    "datasets",
    "device",
    "distribute",
    "elastic",
    "epochs",
    "errors",
    "evaluate",
    "finalize",
    "hpo",
    "init",
    "integrations",
    "is_initialized",
    "is_main",
    "local_rank",
    "local_size",
    "models",
    "nn",
    "parallel",
    "rank",
    "rank_zero_only",
    "schedule",
    "session",
    "size",
    "train",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bunsan' has no attribute {name!r}")
    value = (
        importlib.import_module(f"bunsan.{name}") if module == "" else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from bunsan import algorithms, comm, data, datasets, elastic, errors, hpo, integrations, models, nn, parallel, train
    from bunsan.algorithms import Algorithm, AsyncSGD, Auto, BlockMomentumSGD, DataParallelSGD, ModelAveragingSGD
    from bunsan.console import RankFilter, rank_zero_only
    from bunsan.console import print as print  # bunsan.print: exported by name, not in __all__ (see above)
    from bunsan.elastic import epochs
    from bunsan.evaluation import all_reduce_metrics, evaluate
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
    from bunsan.sync import broadcast_optimizer_state, broadcast_parameters
    from bunsan.train import Checkpoint, CrossValidation, Test, TrainingSession, schedule
