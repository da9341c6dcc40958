"""The sentences that name out-of-step collectives and forgotten joins, from the ranks' records. Pure.

:mod:`bunsan.comm.inspector` records each rank's recent collectives and state and
publishes them; this module compares the records and says what went wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "FINALIZE_JOIN",
    "IN_FINALIZE",
    "TRAINING",
    "describe_mismatch",
    "describe_state",
    "forgotten_join",
    "skipped_step",
]

TRAINING = "training"
FINALIZE_JOIN = "in join called by finalize()"
IN_FINALIZE = "in finalize()"

States = Mapping[int, "dict[str, Any] | None"]


def describe_state(state: dict[str, Any] | None) -> str:
    """What a rank's published state says it is doing, e.g. ``"in join (last started world collective #3 ...)"``."""
    if state is None:
        return "has published nothing yet"
    last = state.get("last")
    where = f"last started {last[0]} collective #{last[1]} {last[2]}" if last else "has started no collective"
    doing = "waiting in it" if state.get("waiting") else state.get("activity", TRAINING)
    if state.get("activity") not in (TRAINING, None) and state.get("waiting"):
        doing = f"{state['activity']}, waiting in it"
    return f"{doing} ({where})"


def describe_mismatch(
    rings: Mapping[int, list[list[Any]]],
    states: States,
    steps_of: Callable[[int], list[list[int]] | None] | None = None,
) -> str | None:
    """The sentence for ranks whose recent collectives differ under one number, or None.

    Pure: ``rings`` maps a rank to its recent ``[group, number, op, steps]``
    entries, ``states`` to its published state. The first difference wins: the
    operation (a collective skipped or added), else the step tag (the same
    collective made after different numbers of optimizer steps: a rank skipped
    ``optimizer.step()``). Finished ranks answering the others' exchanges from
    ``finalize()`` get the fix for a forgotten ``join()``. ``steps_of(rank)``, read
    only for a step difference, gives a rank's ``[steps, first collective]``
    pairs, which name the skipped step when the rings no longer reach back to it.
    """
    ranks = sorted(rings)
    found: tuple[int, str] | None = None
    for i, a in enumerate(ranks):
        by_number = {(e[0], e[1]): e for e in rings[a]}
        for b in ranks[i + 1 :]:
            for entry_b in rings[b]:
                entry_a = by_number.get((entry_b[0], entry_b[1]))
                if entry_a is None:
                    continue
                g, n = entry_b[0], entry_b[1]
                if entry_a[2] != entry_b[2]:
                    text = _op_mismatch(g, n, a, entry_a, b, entry_b, states)
                elif (
                    len(entry_a) > 3
                    and len(entry_b) > 3
                    and min(entry_a[3], entry_b[3]) >= 0
                    and entry_a[3] != entry_b[3]
                ):
                    earlier_b = {(e[0], e[1]): e for e in rings[b]}
                    exact = any(
                        e[0] == g
                        and e[1] < n
                        and len(e) > 3
                        and (g, e[1]) in earlier_b
                        and e[3] == earlier_b[(g, e[1])][3] >= 0
                        for e in rings[a]
                    )
                    skipped = None if exact or steps_of is None else skipped_step(steps_of(a), steps_of(b))
                    text = _step_mismatch(g, n, a, entry_a, b, entry_b, exact, skipped)
                else:
                    continue
                if found is None or n < found[0]:
                    found = (n, text)
                break
    return found[1] if found else None


def _op_mismatch(g: str, n: int, a: int, entry_a: list[Any], b: int, entry_b: list[Any], states: States) -> str:
    forgot = forgotten_join(states)
    if forgot is not None:
        return forgot
    return (
        f"collectives out of step at {g} collective #{n}: rank {a} called {entry_a[2]} but rank {b} "
        f"called {entry_b[2]} (a rank skipped or added a collective, e.g. skipped optimizer.step() on one "
        f"rank only); rank {a} is {describe_state(states.get(a))}, rank {b} is "
        f"{describe_state(states.get(b))}"
    )


def skipped_step(steps_a: list[list[int]] | None, steps_b: list[list[int]] | None) -> int | None:
    """The step count after which two ranks' collectives diverge, from their ``[steps, first collective]`` pairs.

    In step, every step count begins at the same collective on both ranks. A
    rank that skipped step ``s`` begins count ``s + 1`` later than the others;
    returns ``s``, or None when the pairs do not reach back to an agreement.
    """
    if not steps_a or not steps_b:
        return None
    first_b = {int(t): int(n) for t, n in steps_b}
    agreed = False
    for t, n in steps_a:
        if int(t) not in first_b:
            continue
        if first_b[int(t)] == int(n):
            agreed = True
        elif agreed:
            return int(t) - 1
        else:
            return None
    return None


def _step_mismatch(
    g: str, n: int, a: int, entry_a: list[Any], b: int, entry_b: list[Any], exact: bool, skipped: int | None = None
) -> str:
    (lo, lo_steps), (hi, hi_steps) = sorted([(a, entry_a[3]), (b, entry_b[3])], key=lambda t: t[1])
    # Exact when the rings also hold an earlier collective both ranks made after
    # the same number of steps, or when the step counts' first collectives say where
    # they parted; otherwise the skip happened before the recent window.
    if skipped is not None:
        when = f"at its step {skipped}"
    else:
        when = f"at its step {lo_steps}" if exact else f"at or before its step {lo_steps}"
    return (
        f"optimizer steps out of step at {g} collective #{n} ({entry_a[2]}): rank {hi} made it after "
        f"{hi_steps} optimizer steps, rank {lo} after {lo_steps}, so rank {lo} skipped optimizer.step() {when} "
        "(0-based) while the others stepped; every rank must call optimizer.step() after every backward "
        "(skip the update on all ranks alike, as GradScaler does after its all-reduced inf check)"
    )


def forgotten_join(states: States) -> str | None:
    """The fix when some ranks called finalize() while others were still training, or None."""
    finished = [
        r
        for r, s in sorted(states.items())
        if s is not None and s.get("activity") in (FINALIZE_JOIN, IN_FINALIZE, "finished")
    ]
    training = [r for r, s in sorted(states.items()) if s is not None and s.get("activity") == TRAINING]
    if not finished or not training:
        return None
    who = f"rank {finished[0]}" if len(finished) == 1 else f"ranks {finished}"
    was = "was" if len(training) == 1 else "were"
    still = f"rank {training[0]}" if len(training) == 1 else f"ranks {training}"
    return (
        f"{who} finished its data and called finalize() while {still} {was} still training: "
        "call optimizer.join() on every rank after the loop"
    )
