"""Argument checks shared by every public constructor and function.

One rule for every check (STYLE.md C.3 "Errors"): a value of the wrong *type* raises
``TypeError``; a value of the right type outside what is allowed raises ``ValueError``.
``bool`` is never accepted where a number is expected (``True`` is an ``int`` to Python,
never what the user meant). Each message names the argument, shows the value, says what
is allowed and, where a fix is not obvious, appends a hint::

    warm_start must be an int >= 0 (samples before 1-bit starts), got 1.5

This module imports nothing of torch so that ``bunsan.launch`` can use it too.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, TypeVar, cast

__all__ = ["check_choice", "check_int", "check_number", "check_type"]

T = TypeVar("T")


def _fail(exc: type[Exception], name: str, expected: str, value: Any, hint: str) -> Exception:
    suffix = f" ({hint})" if hint else ""
    return exc(f"{name} must be {expected}{suffix}, got {value!r}")


def _bounds(minimum: float | None, maximum: float | None, min_inclusive: bool, max_inclusive: bool) -> str:
    parts = []
    if minimum is not None:
        parts.append(f"{'>=' if min_inclusive else '>'} {minimum}")
    if maximum is not None:
        parts.append(f"{'<=' if max_inclusive else '<'} {maximum}")
    return " and ".join(parts)


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    hint: str = "",
    allow_none: bool = False,
) -> Any:
    """Return ``value`` if it is an int within ``[minimum, maximum]``.

    Raises:
        TypeError: ``value`` is not an int (a bool or float counts as wrong type).
        ValueError: ``value`` is outside the bounds.
    """
    if value is None and allow_none:
        return value
    bounds = _bounds(minimum, maximum, True, True)
    expected = f"an int {bounds}".rstrip() + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(TypeError, name, expected, value, hint)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise _fail(ValueError, name, expected, value, hint)
    return value


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    hint: str = "",
    allow_none: bool = False,
) -> Any:
    """Return ``float(value)`` if it is a finite real number within the bounds.

    ``min_inclusive=False`` makes the lower bound strict (``> 0`` for a learning rate).

    Raises:
        TypeError: ``value`` is not an int or float (a bool counts as wrong type).
        ValueError: ``value`` is NaN, infinite, or outside the bounds.
    """
    if value is None and allow_none:
        return value
    bounds = _bounds(minimum, maximum, min_inclusive, max_inclusive)
    expected = f"a number {bounds}".rstrip() + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(TypeError, name, expected, value, hint)
    number = float(value)
    if not math.isfinite(number):
        raise _fail(ValueError, name, f"a finite number {bounds}".rstrip(), value, hint)
    if minimum is not None and (number < minimum if min_inclusive else number <= minimum):
        raise _fail(ValueError, name, expected, value, hint)
    if maximum is not None and (number > maximum if max_inclusive else number >= maximum):
        raise _fail(ValueError, name, expected, value, hint)
    return number


def check_type(name: str, value: Any, types: type[T] | tuple[type, ...], *, hint: str = "") -> T:
    """Return ``value`` if it is an instance of ``types``, else raise ``TypeError`` naming the type."""
    if isinstance(value, types):
        return cast(T, value)
    names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
    suffix = f" ({hint})" if hint else ""
    raise TypeError(f"{name} must be a {names}{suffix}, got {type(value).__name__}")


def check_choice(name: str, value: Any, choices: Collection[Any], *, hint: str = "") -> Any:
    """Return ``value`` if it is one of ``choices``, else raise ``ValueError`` listing them."""
    if value in choices:
        return value
    listed = ", ".join(repr(c) for c in choices)
    raise _fail(ValueError, name, f"one of {listed}", value, hint)
