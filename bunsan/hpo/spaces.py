"""Search spaces for bunsan's own knobs: the algorithm and its options, the rate, the minibatch.

Each function takes any Optuna-style trial (a :class:`~bunsan.hpo.DistributedTrial`,
an ``optuna.Trial``, an ``optuna.trial.FixedTrial``) and suggests only what the
choices leave open: a knob given one value is fixed, not searched, so the
study's parameters are the knobs that vary. Only valid combinations are
suggested: ``warm_start`` only where it has an effect (quantized
``DataParallelSGD`` and the block algorithms), ``compression`` only with
``bits=32``, ``block_size`` only for the block algorithms.

Parameter names are shared where the meaning is (``warm_start`` and
``block_size`` of the two block algorithms), with the same distribution, as
Optuna requires of one name in one study.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

from bunsan import algorithms, comm
from bunsan._validate import check_int, check_number
from bunsan.algorithms.base import Algorithm

__all__ = [
    "ALGORITHMS",
    "AlgorithmChoice",
    "suggest_algorithm",
    "suggest_learning_rate_per_sample",
    "suggest_minibatch_size",
]

ALGORITHMS = ("data_parallel", "block_momentum", "model_averaging")  # what suggest_algorithm knows
_COMPRESSIONS = (None, "fp16", "bf16")

IntRange = int | tuple[int, int]


class AlgorithmChoice(NamedTuple):
    """An algorithm's registry name and options, as :func:`suggest_algorithm` chose them.

    It unpacks as ``name, options`` and builds with ``choice.create()`` (or
    ``bunsan.algorithms.create(name, **options)``); ``TrainingSession`` and
    ``bunsan.distribute`` also take ``choice.create()``.
    """

    name: str
    options: dict[str, Any]

    def create(self, group: Any = None) -> Algorithm:
        """A new algorithm with these options (``group``: ``None`` means the world)."""
        return algorithms.create(self.name, **self.options, group=group)

    def __str__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


def _pair(value: Any, kind: type, message: str) -> tuple[Any, Any]:
    """``value`` (one number of ``kind`` or a ``(low, high)`` pair of them) as a pair; TypeError otherwise. Pure."""
    pair: Any = (value, value) if isinstance(value, kind) and not isinstance(value, bool) else value
    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or not all(isinstance(v, kind) and not isinstance(v, bool) for v in pair)
    ):
        raise TypeError(message)
    return pair[0], pair[1]


def _int_range(argument: str, value: Any, minimum: int) -> tuple[int, int]:
    """``value`` (an int or ``(low, high)``) as ``(low, high)`` with ``minimum <= low <= high``. Pure."""
    message = (
        f"{argument} must be an int >= {minimum} (fixed) or a range (low, high) of ints with "
        f"{minimum} <= low <= high (searched), got {value!r}"
    )
    low, high = _pair(value, numbers.Integral, message)
    if not minimum <= low <= high:
        raise ValueError(message)
    return int(low), int(high)


def _float_range(argument: str, value: Any, low_ok: float, high_limit: float) -> tuple[float, float]:
    """``value`` (a number or ``(low, high)``) as ``(low, high)`` within ``[low_ok, high_limit)``. Pure."""
    message = (
        f"{argument} must be a number or a range (low, high) with {low_ok} <= low <= high < {high_limit}, got {value!r}"
    )
    low, high = _pair(value, numbers.Real, message)
    if not low_ok <= low <= high < high_limit:
        raise ValueError(message)
    return float(low), float(high)


def _choices(argument: str, values: Any) -> list[Any]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{argument} must be a non-empty sequence of choices, got {values!r}")
    if not values:
        raise ValueError(f"{argument} must be a non-empty sequence of choices, got {values!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{argument} names a choice twice: {values!r}")
    return list(values)


def _pick(trial: Any, name: str, choices: Sequence[Any]) -> Any:
    """One choice: suggested when there are several, else fixed (no parameter in the study)."""
    return choices[0] if len(choices) == 1 else trial.suggest_categorical(name, list(choices))


def _pick_int(trial: Any, name: str, bounds: tuple[int, int], log: bool) -> int:
    low, high = bounds
    return low if low == high else trial.suggest_int(name, low, high, log=log)


def _check_algorithm_choices(
    choices: Any, bits: Any, warm_start: Any, block_size: Any, block_momentum: Any, compression: Any
) -> tuple[list[str], list[int], tuple[int, int], tuple[int, int], tuple[float, float] | None, list[Any]]:
    """Validate :func:`suggest_algorithm`'s arguments. Pure."""
    names = _choices("choices", choices)
    registered = algorithms.names()
    for name in names:
        if name not in registered:
            raise ValueError(f"choices: unknown algorithm {name!r}; choose among {registered}")
        if name not in ALGORITHMS:
            raise ValueError(
                f"choices: suggest_algorithm knows the options of {list(ALGORITHMS)}, not of {name!r}; "
                f"suggest {name!r}'s options with trial.suggest_* yourself"
            )
    bit_choices = _choices("bits", bits)
    for b in bit_choices:
        message = f"bits must hold 32 (exact) or 1..16 (quantized), got {b!r} in {bits!r}"
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(message)
        if not (b == 32 or 1 <= b <= 16):
            raise ValueError(message)
    warm = _int_range("warm_start", warm_start, 0)
    block = _int_range("block_size", block_size, 1)
    momentum = None if block_momentum is None else _float_range("block_momentum", block_momentum, 0.0, 1.0)
    compressions = _choices("compression", compression)
    for c in compressions:
        if c not in _COMPRESSIONS:
            raise ValueError(f"compression must hold None, 'fp16' or 'bf16', got {c!r} in {compression!r}")
    return names, bit_choices, warm, block, momentum, compressions


def suggest_algorithm(
    trial: Any,
    choices: Sequence[str] = ALGORITHMS,
    *,
    bits: Sequence[int] = (1, 2, 4, 8, 32),
    warm_start: IntRange = (0, 20000),
    block_size: IntRange = (256, 8192),
    block_momentum: float | tuple[float, float] | None = None,
    compression: Sequence[str | None] = (None,),
    minibatch_size: int | None = None,
    world_size: int | None = None,
) -> AlgorithmChoice:
    """Suggest a parallel SGD algorithm and its options, in valid combinations only.

    Collective when ``trial`` is a :class:`~bunsan.hpo.DistributedTrial`, as are
    the other ``suggest_*`` functions here: every rank calls them in the same order.

    Parameters of the study (each only when its choices leave something open):

    * ``algorithm``: one of ``choices``;
    * ``data_parallel``: ``bits``; ``warm_start`` when ``bits < 32``;
      ``compression`` when ``bits == 32``;
    * ``block_momentum``: ``block_size`` (log scale), ``warm_start``,
      ``block_momentum`` when given as a range;
    * ``model_averaging``: ``block_size`` (log scale), ``warm_start``.

    With ``minibatch_size`` (the global minibatch of the trial), a block is
    searched in whole minibatches of a worker instead (parameter
    ``block_minibatches``, log scale), so that every block ends exactly at
    ``block_size`` samples: ``block_size = block_minibatches * (minibatch_size //
    world_size)``, within ``block_size``'s range where a whole number of
    minibatches fits (at least one minibatch).

    Args:
        trial: An Optuna-style trial.
        choices: Registry names among :data:`ALGORITHMS`.
        bits: ``DataParallelSGD`` bit widths to try: 32 (exact) or 1..16.
        warm_start: Samples (all workers together) of exact averaging first:
            an int (fixed) or ``(low, high)`` (searched, linear).
        block_size: Samples per worker between two synchronizations of the
            block algorithms: an int or ``(low, high)`` (searched, log scale).
        block_momentum: ``None`` for ``BlockMomentumSGD``'s default
            ``1 - 1/world_size``, a number, or ``(low, high)`` within ``[0, 1)``.
        compression: Casts to try with ``bits=32``: ``None``, ``"fp16"``, ``"bf16"``.
        minibatch_size: The trial's global minibatch; ``None`` searches
            ``block_size`` in samples.
        world_size: Workers sharing the minibatch; default the size of the
            job's world (1 without a process group).

    Returns:
        An :class:`AlgorithmChoice` ``(name, options)``.

    Raises:
        ValueError: An argument is out of range or names an unknown algorithm
            (the message names it).

    Example:
        >>> choice = bunsan.hpo.suggest_algorithm(trial, ("data_parallel", "block_momentum"), bits=(1, 32))
        >>> model, optimizer = bunsan.distribute(model, optimizer, choice.create())
    """
    names, bit_choices, warm, block, momentum, compressions = _check_algorithm_choices(
        choices, bits, warm_start, block_size, block_momentum, compression
    )
    local = None if minibatch_size is None else _local_minibatch(minibatch_size, world_size)
    name = _pick(trial, "algorithm", names)
    options: dict[str, Any] = {}
    if name == "data_parallel":
        options["bits"] = _pick(trial, "bits", bit_choices)
        if options["bits"] == 32:
            # warm_start does nothing at 32 bits (the exchange is exact): not searched there.
            compressed = _pick(trial, "compression", compressions)
            if compressed is not None or len(compressions) > 1:  # the options name every searched knob
                options["compression"] = compressed
        else:
            options["warm_start"] = _pick_int(trial, "warm_start", warm, log=False)
    else:
        if local is None:
            options["block_size"] = _pick_int(trial, "block_size", block, log=True)
        else:  # whole minibatches: the blocks end exactly where the algorithm expects
            low = max(1, -(-block[0] // local))
            high = max(low, block[1] // local)
            options["block_size"] = local * _pick_int(trial, "block_minibatches", (low, high), log=True)
        options["warm_start"] = _pick_int(trial, "warm_start", warm, log=False)
        if name == "block_momentum" and momentum is not None:
            bm_low, bm_high = momentum
            options["block_momentum"] = (
                bm_low if bm_low == bm_high else trial.suggest_float("block_momentum", bm_low, bm_high)
            )
    return AlgorithmChoice(name, options)


def _local_minibatch(minibatch_size: Any, world_size: int | None) -> int:
    workers = comm.get_world_size() if world_size is None else world_size
    check_int("world_size", workers, minimum=1, hint="None: the job's world")
    check_int(
        "minibatch_size",
        minibatch_size,
        minimum=workers,
        hint=f"a global minibatch >= the {workers} worker(s); or None to search block_size in samples",
    )
    return minibatch_size // workers


def suggest_learning_rate_per_sample(
    trial: Any, low: float = 1e-5, high: float = 1e-2, *, name: str = "learning_rate_per_sample"
) -> float:
    """Suggest a learning rate per sample (CNTK's unit; ``TrainingSession``'s), on a log scale.

    With ``TrainingSession(learning_rate_per_sample=...)`` the step's ``lr`` is
    this times the global minibatch, so the value found holds when the
    minibatch or the number of workers changes.

    Args:
        trial: An Optuna-style trial.
        low: Smallest rate, > 0.
        high: Largest rate, >= ``low``.
        name: The study's parameter name.

    Raises:
        ValueError: ``low`` or ``high`` out of range.
    """
    for argument, value in (("low", low), ("high", high)):
        check_number(argument, value, minimum=0, min_inclusive=False, hint="a learning rate per sample, log scale")
    if low > high:
        raise ValueError(f"low must be <= high, got low={low!r}, high={high!r}")
    return float(low) if low == high else trial.suggest_float(name, float(low), float(high), log=True)


def suggest_minibatch_size(
    trial: Any,
    choices: Sequence[int] = (32, 64, 128, 256),
    *,
    name: str = "minibatch_size",
    world_size: int | None = None,
) -> int:
    """Suggest a global minibatch size (all workers together) among ``choices``.

    Args:
        trial: An Optuna-style trial.
        choices: Global minibatch sizes, each at least ``world_size`` (a worker
            takes ``minibatch // world_size`` samples, as ``TrainingSession`` does).
        name: The study's parameter name.
        world_size: Workers that share a minibatch; default the size of the
            job's world (1 without a process group).

    Raises:
        ValueError: A choice is not an int, or smaller than ``world_size``.
    """
    sizes = _choices("choices", choices)
    workers = comm.get_world_size() if world_size is None else world_size
    for size in sizes:
        check_int(
            "choices",
            size,
            minimum=max(workers, 1),
            hint=f"global minibatch sizes >= the {workers} worker(s): every worker needs a sample per step",
        )
    return int(_pick(trial, name, sizes))
