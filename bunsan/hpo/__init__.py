"""Distributed hyper-parameter search with Optuna: every trial trains on all workers.

Rank 0 drives an Optuna study; each trial's parameters reach every rank, the
objective trains distributed, and the outcome is told to the study once::

    import bunsan, optuna
    from bunsan import hpo

    bunsan.init()

    def objective(trial):                      # runs on every rank
        algorithm = hpo.suggest_algorithm(trial, bits=(1, 8, 32))
        lr = hpo.suggest_learning_rate_per_sample(trial, 1e-4, 1e-2)
        ...                                    # train; report an all-reduced error
        return error

    study = hpo.optimize(objective, n_trials=20, storage="sqlite:///hpo.db", study_name="run1")

Optuna is an optional extra (``pip install 'bunsan[hpo]'``); this package
imports it when a search starts, so ``import bunsan.hpo`` works without it.
The search protocol, and which failures a search survives, are described in
:mod:`bunsan.hpo.search`.
"""

from __future__ import annotations

from bunsan.hpo.plots import PLOTS, save_plots
from bunsan.hpo.search import INSTALL_HINT, DistributedTrial, optimize
from bunsan.hpo.spaces import (
    ALGORITHMS,
    AlgorithmChoice,
    suggest_algorithm,
    suggest_learning_rate_per_sample,
    suggest_minibatch_size,
)

__all__ = [
    "ALGORITHMS",
    "INSTALL_HINT",
    "PLOTS",
    "AlgorithmChoice",
    "DistributedTrial",
    "optimize",
    "save_plots",
    "suggest_algorithm",
    "suggest_learning_rate_per_sample",
    "suggest_minibatch_size",
]
