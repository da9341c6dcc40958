"""Quote user input in error messages, cut to a readable length. Pure.

A message that echoes what the user wrote helps, until what they wrote is a
5 MB line of a corrupted hostfile: then the one sentence that says what is
wrong is buried under megabytes. Every message of the launcher that quotes
input goes through :func:`quoted`.
"""

from __future__ import annotations

from bunsan._validate import check_int

__all__ = ["MAX_QUOTED", "MAX_QUOTED_PATH", "quoted"]

MAX_QUOTED = 80  # characters of user input shown in a message
# A path is shown whole up to Linux's PATH_MAX: cut at 80 characters, a script's or hostfile's
# path loses its last part, the name the user must check (a pytest tmp_path under xdist is
# already longer than 80).
MAX_QUOTED_PATH = 4096


def quoted(value: object, limit: int = MAX_QUOTED) -> str:
    """Return ``repr(str(value))``, or its first ``limit`` characters and the full length.

    Example:
        ``quoted("x" * 5_000_000)`` is ``'xxxx...x'... (5,000,000 characters)``
        with 80 ``x`` between the quotes.

    Raises:
        ValueError: ``limit`` < 1.
    """
    check_int("limit", limit, minimum=1)
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"
