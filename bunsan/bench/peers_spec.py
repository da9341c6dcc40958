"""The communication settings of ``bunsan bench peers``: their syntax, their checks, their defaults. Pure.

A setting is ``NAME[:KEY=VALUE,...]``, and a bare ``KEY`` is ``KEY=true`` (``powersgd:rank=2,batched``):

* ``exact``: DDP's all-reduce, as torch's ``default_hooks.allreduce_hook`` (so its bytes are counted like the others').
* ``fp16``: torch's ``default_hooks.fp16_compress_hook``.
* ``powersgd:rank=R[,batched][,start=S]``: torch's ``powerSGD_hook`` (``batched_powerSGD_hook`` with
  ``batched``), ``PowerSGDState(matrix_approximation_rank=R, start_powerSGD_iter=S)``; ``S`` defaults to a
  tenth of the training's steps (torch's advice), at least 2 (torch refuses less with error feedback). Always one
  DDP bucket: on Gloo with 2+ buckets PowerSGD aborts with a collective mismatch or hangs (its collectives are
  launched from future callbacks, in different orders on different ranks). On torch 2.13 the batched hook
  fails at its first compressed step (``_orthogonalize`` asserts a 3-D batch and is given a matrix).
* ``postlocal:period=K[,warmup=S]``: torch's ``post_localSGD_hook`` (no gradient exchange after ``S`` steps,
  ``post_local_gradient_allreduce=False``: on CPU torch's default subgroup needs CUDA) with
  ``PeriodicModelAverager(period=K, warmup_steps=S)`` in a ``PostLocalSGDOptimizer``.
* ``bunsan:bits=B[,warmup=S,plain]``: :func:`bunsan.algorithms.quantized_hook` with its optimizer wrapper
  :class:`~bunsan.algorithms.HookOptimizer` (local momentum, as ``DataParallelSGD(bits=B)``; ``plain``: the hook
  alone); without ``warmup`` the :class:`~bunsan.algorithms.QuantizedHookState` default (a third of training at
  1 bit, none above).
* ``bunsan-ma:period=K[,warmup=S]`` and ``bunsan-bmuf:period=K[,warmup=S,block_momentum=M,block_lr=L,nesterov=B]``:
  bunsan's ``ModelAverager`` / ``BlockMomentumAverager`` in an ``AveragingOptimizer``, gradients exchanged
  exactly during the ``S`` warm-up steps only.

This module imports no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from bunsan.bench.specs import format_value, parse_value

__all__ = [
    "KINDS",
    "PeerSetting",
    "expected_bytes_per_step",
    "parse_seeds",
    "parse_setting",
    "powersgd_elements",
    "powersgd_start",
]

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# kind -> (required options, optional options)
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "exact": ((), ()),
    "fp16": ((), ()),
    "powersgd": (("rank",), ("batched", "start")),
    "postlocal": (("period",), ("warmup",)),
    "bunsan": (("bits",), ("warmup", "plain")),
    "bunsan-ma": (("period",), ("warmup",)),
    "bunsan-bmuf": (("period",), ("warmup", "block_momentum", "block_lr", "nesterov")),
}
_COUNTS = {"rank": 1, "period": 1, "start": 2, "warmup": 0}  # integer options and their minimum
_BOOLS = ("batched", "nesterov", "plain")
_FLOATS = ("block_momentum", "block_lr")


@dataclass(frozen=True)
class PeerSetting:
    """One checked setting: its kind and options (module docstring)."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The setting written back, options in their given order, a true flag bare: ``powersgd:rank=2,batched``."""
        items = [k if v is True and k in _BOOLS else f"{k}={format_value(v)}" for k, v in self.options.items()]
        return self.kind + (":" + ",".join(items) if items else "")

    @property
    def averages_models(self) -> bool:
        """Whether the replicas differ between averagings (the test error is then their average's)."""
        return self.kind in ("postlocal", "bunsan-ma", "bunsan-bmuf")

    def __hash__(self) -> int:
        return hash(self.label)


def _check_option(text: str, kind: str, key: str, value: Any) -> None:
    where = f"setting {text!r}"
    if key in _COUNTS and (isinstance(value, bool) or not isinstance(value, int) or value < _COUNTS[key]):
        raise ValueError(f"{where}: {key} must be an integer >= {_COUNTS[key]}, got {value!r}")
    if key in _BOOLS and not isinstance(value, bool):
        raise ValueError(f"{where}: {key} is a flag: write it bare ({key}) or {key}=true/false, got {value!r}")
    if key in _FLOATS and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0):
        raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}")
    if key == "bits" and (isinstance(value, bool) or value not in (32, *range(1, 17))):
        raise ValueError(f"{where}: bits must be 1..16 (quantized) or 32 (exact), got {value!r}")


def parse_setting(text: str) -> PeerSetting:
    """Parse and check one setting (module docstring), e.g. ``powersgd:rank=2,batched``.

    Raises:
        ValueError: one sentence naming the setting and what is wrong: an unknown kind, a malformed
            or unknown option, a missing required option, a value of the wrong type or range.
    """
    kind, colon, rest = text.strip().partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise ValueError(f"setting {text!r}: unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    if colon and not rest.strip():
        raise ValueError(f"setting {text!r} has nothing after ':'; drop the ':' or add KEY=VALUE")
    required, optional = KINDS[kind]
    options: dict[str, Any] = {}
    for item in rest.split(",") if colon else []:
        key, equals, value = (part.strip() for part in item.partition("="))
        if not _KEY.fullmatch(key) or (equals and not value):
            raise ValueError(f"option {item.strip()!r} of setting {text!r} is not KEY=VALUE or a bare flag")
        if key not in required + optional:
            known = ", ".join(required + optional) or "none"
            raise ValueError(f"setting {text!r}: {kind} takes no option {key!r} (its options: {known})")
        if key in options:
            raise ValueError(f"setting {text!r} sets {key!r} twice")
        parsed = parse_value(value) if equals else True
        _check_option(text, kind, key, parsed)
        options[key] = parsed
    missing = [k for k in required if k not in options]
    if missing:
        raise ValueError(f"setting {text!r} needs {missing[0]}=..., e.g. {kind}:{missing[0]}=4")
    return PeerSetting(kind, options)


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``: distinct integers >= 0; ValueError in one sentence otherwise."""
    items = [item.strip() for item in text.split(",")]
    if not all(re.fullmatch(r"\d+", item) for item in items):
        raise ValueError(f"--seeds {text!r} is not a comma-separated list of integers >= 0, e.g. 0,1,2")
    seeds = [int(item) for item in items]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r} lists a seed twice")
    return seeds


def powersgd_start(setting: PeerSetting, total_steps: int) -> int:
    """The step PowerSGD starts compressing at: ``start``, else a tenth of ``total_steps``, at least 2."""
    return int(setting.options.get("start", max(2, total_steps // 10)))


def _ring(workers: int) -> float:
    """Bytes one rank sends per byte of an all-reduce, as bunsan counts it (an optimal ring): ``2 (N-1) / N``."""
    return 2 * (workers - 1) / workers


def powersgd_elements(shapes: list[tuple[int, ...]], rank: int, batched: bool) -> int:
    """Elements one compressed PowerSGD step all-reduces for one bucket of parameters of ``shapes``.

    Per tensor (``powerSGD_hook``): viewed as ``shape[0] x rest``, with rank ``r = min(n, m, rank)`` it sends
    P (``n r``) and Q (``m r``) when ``2 (n + m) r < n m`` (``min_compression_rate=2``), else the tensor itself.
    Batched (``batched_powerSGD_hook``): the whole bucket as one square matrix of side ``ceil(sqrt(numel))``.
    """
    if batched:
        side = math.isqrt(sum(math.prod(s) for s in shapes) - 1) + 1
        return 2 * side * rank
    total = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape) // n
        r = min(n, m, rank)
        total += (n + m) * r if 2 * (n + m) * r < n * m else n * m
    return total


def expected_bytes_per_step(
    setting: PeerSetting, shapes: list[tuple[int, ...]], workers: int, total_steps: int
) -> float | None:
    """What one rank sends per step on average over ``total_steps`` steps, by the formulas of torch's hooks, for
    fp32 parameters of ``shapes`` in one bucket, counted as bunsan counts an all-reduce (:func:`_ring`).

    ``None`` for bunsan's settings: their bytes (stripes, chunk scales, a flag per step) are their own counters'.
    """
    exact = _ring(workers) * 4 * sum(math.prod(s) for s in shapes)
    options = setting.options
    if setting.kind == "exact":
        return exact
    if setting.kind == "fp16":
        return exact / 2
    if setting.kind == "powersgd":
        start = min(powersgd_start(setting, total_steps), total_steps)
        compressed = _ring(workers) * 4 * powersgd_elements(shapes, options["rank"], bool(options.get("batched")))
        return (start * exact + (total_steps - start) * compressed) / total_steps
    if setting.kind == "postlocal":
        warmup, period = min(options.get("warmup", 0), total_steps), options["period"]
        averagings = len(range(warmup, total_steps, period))
        return (warmup + averagings) * exact / total_steps
    return None
