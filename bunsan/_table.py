"""The one plain-text table formatter of bunsan (benchmarks, ``bunsan doctor``, launch plans).

Cells are strings (format numbers before); columns are separated by two spaces, a rule of
dashes follows the header, trailing blanks are stripped. No torch import: ``bunsan.launch``
uses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["format_table", "format_transposed"]


def format_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    right: Iterable[str] = (),
    *,
    rule: bool = True,
) -> str:
    """Align ``rows`` under ``header``; the columns named in ``right`` are right-aligned.

    Args:
        header: column names.
        rows: one sequence of cells per row, as long as ``header``.
        right: names of the columns to right-align (numbers).
        rule: put a line of dashes under the header.

    Raises:
        ValueError: a row does not have one cell per column.
    """
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a table row has {len(row)} cells for {len(header)} columns: {list(row)!r}")
    right = set(right)
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if h in right else c.ljust(w) for c, w, h in zip(cells, widths, header, strict=True)
        ).rstrip()

    lines = [line(header)]
    if rule:
        lines.append(line(["-" * w for w in widths]))
    lines.extend(line(row) for row in rows)
    return "\n".join(lines)


def format_transposed(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The CNTK article's layout: one column per run, one line per quantity (the first is the header)."""
    lines = [[name, *(row[i] for row in rows)] for i, name in enumerate(header)]
    return format_table(lines[0], lines[1:], right=lines[0][1:])
