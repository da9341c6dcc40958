"""Training sessions in CNTK's style: schedules in samples, exact-resume checkpoints,
cross-validation control, a distributed test and progress reporting.

Example::

    session = bunsan.TrainingSession(model, F.cross_entropy, optimizer, "data_parallel", train_set,
                                     minibatch_size=bunsan.schedule([256] * 6 + [512]), max_epochs=20,
                                     learning_rate_per_sample=0.001, checkpoint=bunsan.Checkpoint("ckpt/run.pt"))
    summary = session.train()
"""

from __future__ import annotations

from bunsan.train.callbacks import Callback, CSVLogger, ProgressPrinter, TensorBoardLogger
from bunsan.train.checkpoint.files import Checkpoint
from bunsan.train.metrics import (
    Accumulator,
    CrossValidation,
    EvalResult,
    Test,
    accuracy,
    classification_error,
    evaluate,
)
from bunsan.train.schedules import (
    Schedule,
    learning_rate,
    local_minibatch_size,
    momentum_from_time_constant,
    plan_minibatches,
    schedule,
    time_constant_from_momentum,
)
from bunsan.train.session import TrainingSession
from bunsan.train.summaries import EpochSummary, TrainingSummary

__all__ = [
    "Accumulator",
    "CSVLogger",
    "Callback",
    "Checkpoint",
    "CrossValidation",
    "EpochSummary",
    "EvalResult",
    "ProgressPrinter",
    "Schedule",
    "TensorBoardLogger",
    "Test",
    "TrainingSession",
    "TrainingSummary",
    "accuracy",
    "classification_error",
    "evaluate",
    "learning_rate",
    "local_minibatch_size",
    "momentum_from_time_constant",
    "plan_minibatches",
    "schedule",
    "time_constant_from_momentum",
]
