"""What :meth:`bunsan.TrainingSession.train` reports: one summary per epoch and one for the whole run.

Every figure is reduced over the workers (sums and counts all-reduced, see
:mod:`bunsan.train.metrics`), so a summary is the same on every rank. An
:class:`EpochSummary` round-trips through a checkpoint (:meth:`EpochSummary.as_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bunsan.train.metrics import EvalResult

__all__ = ["EpochSummary", "TrainingSummary"]


@dataclass
class EpochSummary:
    """One epoch of training, reduced over every worker.

    Attributes:
        epoch: 0-based epoch.
        samples: Global samples trained in the epoch.
        trained_samples: Global samples trained since the start when it ended.
        loss: Mean training loss per sample (exact: sums and counts all-reduced).
        metrics: Mean of each metric per training sample.
        seconds: Wall time of the epoch in this process (since the restore, for
            the epoch a run resumed in).
        samples_per_s: ``samples / seconds`` over the part this process trained.
        learning_rate_per_sample: In effect at the end of the epoch (None when
            the session does not set the learning rate).
        minibatch_size: Global minibatch the schedule asked for at the epoch's
            last step (before rounding to the workers and cutting at the epoch's end).
        complete: False for the part of an epoch trained before a stop.
        cross_validation: The evaluation run at the end of this epoch, if any.
    """

    epoch: int
    samples: int
    trained_samples: int
    loss: float
    metrics: dict[str, float]
    seconds: float
    samples_per_s: float
    learning_rate_per_sample: float | None
    minibatch_size: int
    complete: bool = True
    cross_validation: EvalResult | None = None

    def as_dict(self) -> dict[str, Any]:
        state = {
            k: getattr(self, k)
            for k in (
                "epoch",
                "samples",
                "trained_samples",
                "loss",
                "seconds",
                "samples_per_s",
                "learning_rate_per_sample",
                "minibatch_size",
                "complete",
            )
        }
        state["metrics"] = dict(self.metrics)
        state["cross_validation"] = self.cross_validation.as_dict() if self.cross_validation else None
        return state

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> EpochSummary:
        cv = state.get("cross_validation")
        return cls(
            int(state["epoch"]),
            int(state["samples"]),
            int(state["trained_samples"]),
            float(state["loss"]),
            {k: float(v) for k, v in state["metrics"].items()},
            float(state["seconds"]),
            float(state["samples_per_s"]),
            state["learning_rate_per_sample"],
            int(state["minibatch_size"]),
            bool(state["complete"]),
            EvalResult.from_dict(cv) if cv else None,
        )


@dataclass
class TrainingSummary:
    """What :meth:`TrainingSession.train` returns (the same on every rank).

    Attributes:
        epochs: Every epoch since the start of training, restored ones included;
            a last incomplete one when training stopped inside an epoch.
        cross_validations: Every cross-validation since the start.
        test: The final test, if a :class:`Test` was given.
        samples: Global samples trained since the start.
        steps: Optimizer steps since the start.
        seconds: Training wall time of this process (not counting the test).
        samples_per_s: Global samples per second trained by this process.
        bytes_per_sample: Bytes this worker sent per training sample it
            processed, as counted by the algorithm (``algorithm.stats()``).
        stats: The algorithm's ``stats()`` on this rank.
        stopped_by: ``"max_epochs"``, ``"max_samples"`` or ``"cross_validation"``.
        restored_from: The checkpoint this run continued from, if any.
    """

    epochs: list[EpochSummary]
    cross_validations: list[EvalResult]
    test: EvalResult | None
    samples: int
    steps: int
    seconds: float
    samples_per_s: float
    bytes_per_sample: float
    stats: dict[str, float]
    stopped_by: str
    restored_from: str | None = None

    @property
    def loss(self) -> float | None:
        """The training loss of the last epoch."""
        return self.epochs[-1].loss if self.epochs else None

    @property
    def metrics(self) -> dict[str, float]:
        """The training metrics of the last epoch."""
        return dict(self.epochs[-1].metrics) if self.epochs else {}
