"""Schedules in samples, as CNTK counts them: minibatch size, per-sample learning rate, momentum.

CNTK states training hyper-parameters per *sample*, not per step, so that they
stay right when the minibatch grows or is split across workers (Seide et al.,
"1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
Distributed Training of Speech DNNs", Interspeech 2014, and the CNTK 2 learner
API). A schedule maps the global number of samples trained so far to a value:

>>> lr = schedule([0.01] * 2 + [0.005], epoch_size=1000)
>>> lr(0), lr(1999), lr(2000), lr(10**9)
(0.01, 0.01, 0.005, 0.005)

Everything here is pure arithmetic: no communication, no torch state. Every
rank evaluates the same schedule at the same global sample count, so every
rank gets the same value without exchanging it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from bunsan._validate import check_int, check_number

__all__ = [
    "Schedule",
    "ScheduleLike",
    "as_schedule",
    "learning_rate",
    "local_minibatch_size",
    "momentum_from_time_constant",
    "plan_minibatches",
    "schedule",
    "time_constant_from_momentum",
]


@dataclass(frozen=True)
class Schedule:
    """A piecewise-constant value over the global sample count. Build it with :func:`schedule`.

    Entry ``i`` of ``pairs`` is ``(count, value)``: ``value`` holds for
    ``count * epoch_size`` samples, then the next entry takes over; the last
    value holds forever.

    Attributes:
        pairs: ``((count, value), ...)``, adjacent equal values merged.
        epoch_size: Samples per unit of ``count``. ``None`` means "one sweep
            of the training data": :class:`bunsan.TrainingSession` fills it in
            with :meth:`resolve`. A single-valued schedule needs none.
    """

    pairs: tuple[tuple[int, float], ...]
    epoch_size: int | None = None

    def __post_init__(self) -> None:
        if not self.pairs:
            raise ValueError("a schedule needs at least one value, got an empty list; pass e.g. schedule(0.01)")
        for count, value in self.pairs:
            check_int("schedule counts", count, minimum=1, hint="e.g. [(5, 0.01), (1, 0.005)]")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"schedule values must be real numbers, got {value!r} ({type(value).__name__})")
            # Every schedule bunsan takes (minibatch size, learning rate per sample,
            # momentum time constant) is >= 0: a negative one is a typo, not a setting.
            check_number("schedule values", float(value), minimum=0)
        check_int("epoch_size", self.epoch_size, minimum=1, allow_none=True, hint="samples per schedule entry")

    @classmethod
    def constant(cls, value: float) -> Schedule:
        """The schedule that is ``value`` forever."""
        return cls(((1, value),), None)

    @property
    def values(self) -> list[float]:
        """The distinct values in order (the last one holds forever)."""
        return [value for _, value in self.pairs]

    @property
    def is_constant(self) -> bool:
        return len(self.pairs) == 1

    def resolve(self, epoch_size: int) -> Schedule:
        """This schedule with ``epoch_size`` filled in where it was ``None``."""
        if self.epoch_size is not None or self.is_constant:
            return self
        return Schedule(self.pairs, int(epoch_size))

    def boundaries(self) -> list[int]:
        """Global sample counts where the value changes (one fewer than the entries)."""
        if self.is_constant:
            return []
        size = self._size()
        ends, total = [], 0
        for count, _ in self.pairs[:-1]:
            total += count * size
            ends.append(total)
        return ends

    def __call__(self, samples: int) -> float:
        """The value in effect once ``samples`` global samples have been trained."""
        if samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        if self.is_constant:
            return self.pairs[0][1]
        for end, (_, value) in zip(self.boundaries(), self.pairs):
            if samples < end:
                return value
        return self.pairs[-1][1]

    def next_change(self, samples: int) -> int | None:
        """The first sample count after ``samples`` where the value changes, or None."""
        for end in self.boundaries():
            if end > samples:
                return end
        return None

    def scaled(self, factor: float) -> Schedule:
        """Every value multiplied by ``factor`` (the boundaries stay)."""
        return Schedule(tuple((count, value * factor) for count, value in self.pairs), self.epoch_size)

    def _size(self) -> int:
        if self.epoch_size is None:
            raise ValueError(
                f"schedule {self.values} has several values but no epoch_size: pass epoch_size=<samples> "
                "to bunsan.schedule(), or give it to a TrainingSession, which uses one sweep of the data"
            )
        return self.epoch_size

    # -- checkpoints: primitives only, so that torch.load(weights_only=True) reads them back
    def state_dict(self) -> dict[str, Any]:
        return {"pairs": [[count, float(value)] for count, value in self.pairs], "epoch_size": self.epoch_size}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Schedule:
        return cls(tuple((int(count), float(value)) for count, value in state["pairs"]), state["epoch_size"])

    def __repr__(self) -> str:
        return f"schedule({[[c, v] for c, v in self.pairs]}, epoch_size={self.epoch_size})"


ScheduleLike = Schedule | float | int | Sequence[Any]


def _entries(values: Iterable[Any]) -> list[tuple[int, float]]:
    pairs: list[tuple[int, float]] = []
    for item in values:
        if isinstance(item, numbers.Real) and not isinstance(item, bool):
            count, value = 1, item
        elif isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2:
            count, value = item
        else:
            raise TypeError(
                f"schedule entry {item!r} is neither a number nor a (count, value) pair; "
                "write e.g. [256] * 6 + [512] or [(6, 256), (1, 512)]"
            )
        if isinstance(count, bool) or not isinstance(count, numbers.Integral):
            raise TypeError(f"schedule count {count!r} in {item!r} must be an integer >= 1")
        count = int(count)
        if pairs and pairs[-1][1] == value:
            pairs[-1] = (pairs[-1][0] + count, pairs[-1][1])  # merge repeats: [256]*6 is (6, 256)
        else:
            pairs.append((count, value))
    return pairs


def schedule(values: ScheduleLike, epoch_size: int | None = None) -> Schedule:
    """A value that changes with the number of samples trained, in CNTK's form.

    Args:
        values: A number (constant), a list of numbers where entry ``i`` holds
            for ``epoch_size`` samples, e.g. ``[256] * 6 + [512] * 9 + [1024]``,
            or a list of ``(count, value)`` pairs where ``value`` holds for
            ``count * epoch_size`` samples, e.g. ``[(6, 256), (9, 512), (1, 1024)]``.
            The last value holds forever.
        epoch_size: Samples per entry; ``None`` means one sweep of the
            training data (filled in by :class:`bunsan.TrainingSession`).

    Returns:
        A :class:`Schedule`; call it with a global sample count.

    Raises:
        TypeError: A value that is not a number, a count that is not an int.
        ValueError: An empty list, a count < 1, a negative or non-finite value,
            or ``epoch_size`` < 1.

    Example:
        >>> mb = schedule([256] * 6 + [512] * 9 + [1024], epoch_size=54000)
        >>> mb(0), mb(6 * 54000), mb(10**9)
        (256, 512, 1024)
    """
    if isinstance(values, Schedule):
        return values if epoch_size is None else Schedule(values.pairs, epoch_size)
    if isinstance(values, numbers.Real) and not isinstance(values, bool):
        return Schedule(((1, cast(float, values)),), epoch_size)  # an int stays an int (minibatch sizes)
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"schedule values must be a number or a list, got {values!r}")
    return Schedule(tuple(_entries(values)), epoch_size)


def as_schedule(name: str, value: ScheduleLike | None, epoch_size: int) -> Schedule | None:
    """``value`` as a schedule whose missing ``epoch_size`` is ``epoch_size``; None stays None.

    Args:
        name: The argument's name, for error messages.
    """
    if value is None:
        return None
    try:
        return schedule(value).resolve(epoch_size)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name}: {error}") from None


def learning_rate(learning_rate_per_sample: float, minibatch_samples: int) -> float:
    """The torch optimizer's ``lr`` for a minibatch of ``minibatch_samples`` (global) samples.

    CNTK's per-sample rate multiplies the *sum* of the samples' gradients. A torch
    loss averaged over the minibatch gives their *mean*, and an exact data-parallel
    algorithm averages the workers' means, so the step ``lr * mean`` equals
    ``learning_rate_per_sample * sum`` when ``lr = learning_rate_per_sample * minibatch_samples``.
    """
    return learning_rate_per_sample * minibatch_samples


def momentum_from_time_constant(time_constant: float, minibatch_samples: int) -> float:
    """Momentum per minibatch from a time constant in samples: ``exp(-minibatch / time_constant)``.

    A gradient's contribution decays by ``1/e`` after ``time_constant`` samples,
    whatever the minibatch size. ``time_constant=0`` means no momentum;
    ``math.inf`` means momentum 1.

    Raises:
        ValueError: ``time_constant`` < 0 or ``minibatch_samples`` < 0.
    """
    if time_constant < 0 or math.isnan(time_constant):
        raise ValueError(f"time_constant must be >= 0 samples (0 turns momentum off), got {time_constant}")
    if minibatch_samples < 0:
        raise ValueError(f"minibatch_samples must be >= 0, got {minibatch_samples}")
    if time_constant == 0:
        return 0.0
    return math.exp(-minibatch_samples / time_constant)


def time_constant_from_momentum(momentum: float, minibatch_samples: int) -> float:
    """The inverse of :func:`momentum_from_time_constant`: ``-minibatch / ln(momentum)``."""
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if momentum == 0:
        return 0.0
    return -minibatch_samples / math.log(momentum)


def local_minibatch_size(global_size: float, world_size: int) -> int:
    """Samples each worker takes from a global minibatch of ``global_size``: ``global_size // world_size``.

    Rounding is down, so that every worker takes the same number of samples and
    no sample is counted twice: the global minibatch actually trained is
    ``world_size * (global_size // world_size)``, up to ``world_size - 1`` below
    the request (256 on 3 workers trains 3 x 85 = 255 samples per step).

    Raises:
        ValueError: ``global_size`` is smaller than ``world_size`` or not an integer.
    """
    if isinstance(global_size, bool) or not float(global_size).is_integer():
        raise ValueError(f"minibatch_size must be an integer number of samples, got {global_size!r}")
    global_size = int(global_size)
    if global_size < world_size:
        raise ValueError(
            f"minibatch_size={global_size} is smaller than the {world_size} workers: every worker needs at "
            f"least one sample per step; use minibatch_size >= {world_size}"
        )
    return global_size // world_size


def plan_minibatches(
    shard_size: int,
    position: int,
    samples: int,
    minibatch_size: Schedule,
    world_size: int,
    max_samples: int | None = None,
) -> list[int]:
    """Per-worker minibatch sizes for the rest of an epoch. Pure.

    Each step's global size is ``minibatch_size(samples)`` at the step's first
    sample, so a schedule may change inside an epoch: the next batch is simply
    cut at the new size. A minibatch never spans two epochs (the last one of an
    epoch takes what is left) and never passes ``max_samples``.

    Args:
        shard_size: Samples per epoch on each worker.
        position: Samples of this epoch's shard already consumed, on each worker.
        samples: Global samples trained before the first of these steps.
        minibatch_size: Schedule of the *global* minibatch size.
        world_size: Number of workers.
        max_samples: Stop once this many global samples are trained; None for no limit.

    Returns:
        The number of samples each worker takes at each remaining step.
    """
    sizes: list[int] = []
    while position < shard_size:
        local = min(local_minibatch_size(minibatch_size(samples), world_size), shard_size - position)
        if max_samples is not None:
            local = min(local, max(max_samples - samples, 0) // world_size)
            if local == 0:
                break
        sizes.append(local)
        position += local
        samples += local * world_size
    return sizes
