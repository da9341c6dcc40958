"""The settings of a :class:`bunsan.TrainingSession` that a cross-validation callback may change.

The learning rate per sample and the momentum time constant are schedules over the
global sample count (CNTK's ``UnitType.sample`` and ``momentum_as_time_constant``);
together with ``extra_state`` they form the *control state*. It is the same on every
rank at every step: a callback's outcome is rank 0's, sent to every rank
(:meth:`SessionControl._steer`), and the state goes into checkpoints.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed import ProcessGroup

from bunsan import comm
from bunsan._validate import check_number
from bunsan.train.schedules import (
    Schedule,
    ScheduleLike,
    as_schedule,
    learning_rate,
    momentum_from_time_constant,
    schedule,
)

__all__ = ["SessionControl"]


class SessionControl:
    """Mixin of :class:`bunsan.TrainingSession`: the learning-rate and momentum schedules and ``extra_state``.

    The session sets the attributes annotated below; :meth:`_init_control` sets the rest.
    """

    rank: int
    world_size: int
    group: ProcessGroup | None
    samples: int  # global samples trained since the start: where the schedules are read
    samples_per_epoch: int

    def _init_control(
        self,
        learning_rate_per_sample: ScheduleLike | None,
        momentum_time_constant: ScheduleLike | None,
        unit_gain: bool,
    ) -> None:
        self._lr = as_schedule("learning_rate_per_sample", learning_rate_per_sample, self.samples_per_epoch)
        self._momentum = as_schedule("momentum_time_constant", momentum_time_constant, self.samples_per_epoch)
        self._check_rates(self._lr, self._momentum)
        self.unit_gain = bool(unit_gain)
        self.extra_state: dict[str, Any] = {}

    @staticmethod
    def _check_rates(lr: Schedule | None, momentum: Schedule | None) -> None:
        for name, sched in (("learning_rate_per_sample", lr), ("momentum_time_constant", momentum)):
            if sched is not None and any(v < 0 for v in sched.values):
                raise ValueError(f"{name} values must be >= 0, got {sched.values}")

    @property
    def is_main(self) -> bool:
        """True on rank 0 of the session's group (in an elastic job, of the step's quorum): the rank that prints
        and writes files."""
        elastic = getattr(self, "elastic", None)
        return self.rank == 0 if elastic is None else elastic.member.rank() == 0

    @property
    def learning_rate_schedule(self) -> Schedule | None:
        """The per-sample learning-rate schedule over global samples (None: the optimizer's lr is left alone)."""
        return self._lr

    @learning_rate_schedule.setter
    def learning_rate_schedule(self, value: ScheduleLike | None) -> None:
        new = as_schedule("learning_rate_schedule", value, self.samples_per_epoch)
        self._check_rates(new, None)
        self._lr = new

    @property
    def learning_rate_per_sample(self) -> float | None:
        """The per-sample learning rate in effect now; assigning makes it constant from now on."""
        return None if self._lr is None else float(self._lr(self.samples))

    @learning_rate_per_sample.setter
    def learning_rate_per_sample(self, value: float | None) -> None:
        check_number("learning_rate_per_sample", value, minimum=0, allow_none=True)
        self._lr = None if value is None else schedule(float(value))

    @property
    def momentum_schedule(self) -> Schedule | None:
        """The momentum time-constant schedule over global samples (None: momentum is left alone)."""
        return self._momentum

    @momentum_schedule.setter
    def momentum_schedule(self, value: ScheduleLike | None) -> None:
        new = as_schedule("momentum_schedule", value, self.samples_per_epoch)
        self._check_rates(None, new)
        self._momentum = new

    @property
    def momentum_time_constant(self) -> float | None:
        """The momentum time constant in effect now, in samples; assigning makes it constant from now on."""
        return None if self._momentum is None else float(self._momentum(self.samples))

    @momentum_time_constant.setter
    def momentum_time_constant(self, value: float | None) -> None:
        self.momentum_schedule = None if value is None else float(value)

    def _set_rates(self, param_groups: list[dict[str, Any]], minibatch: int) -> None:
        """Set ``lr`` (and ``momentum``, ``dampening``) of every group for a step of ``minibatch`` global samples."""
        for group in param_groups:
            if self._lr is not None:
                group["lr"] = learning_rate(self._lr(self.samples), minibatch)
            if self._momentum is not None:
                group["momentum"] = momentum_from_time_constant(self._momentum(self.samples), minibatch)
                if self.unit_gain and "dampening" in group:
                    group["dampening"] = group["momentum"]

    # -- the control state: the same on every rank, broadcast from rank 0 and checkpointed
    def _control(self) -> dict[str, Any]:
        return {
            "learning_rate": self._lr.state_dict() if self._lr is not None else None,
            "momentum": self._momentum.state_dict() if self._momentum is not None else None,
            "extra_state": dict(self.extra_state),
        }

    def _apply_control(self, control: Mapping[str, Any]) -> None:
        self._lr = Schedule.from_state_dict(control["learning_rate"]) if control["learning_rate"] else None
        self._momentum = Schedule.from_state_dict(control["momentum"]) if control["momentum"] else None
        self.extra_state = dict(control["extra_state"])

    def _steer(self, call: Callable[[], Any]) -> bool:
        """Run a control callback on every rank, then apply rank 0's outcome everywhere. Collective."""
        error = None
        try:
            decision = call()
            keep_going = decision is None or bool(decision)
        except Exception:
            error, keep_going = traceback.format_exc(), True
        outcome: dict[str, Any] = {"continue": keep_going, "control": self._control(), "error": error}
        outcomes = comm.all_gather_object(outcome, group=self.group) if self.world_size > 1 else [outcome]
        for rank, theirs in enumerate(outcomes):
            if theirs["error"] is not None:
                raise RuntimeError(f"the cross-validation callback raised on rank {rank}:\n{theirs['error']}")
        chosen = outcomes[0]
        differing = [rank for rank, theirs in enumerate(outcomes) if theirs != chosen]
        if differing and self.is_main:
            warnings.warn(
                f"the cross-validation callback decided differently on rank(s) {differing} than on rank 0 "
                "(it depends on something rank-local); rank 0's decision and settings apply on every rank",
                stacklevel=2,
            )
        self._apply_control(chosen["control"])
        return bool(chosen["continue"])
