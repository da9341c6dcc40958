"""``algorithm="auto"``: measure the job, predict every candidate, switch every rank to the fastest.

Three parts, as DESIGN.md asks of Auto: a policy (:mod:`.policy`, every tuned number as data), a pure
decision (:mod:`.decision` and :mod:`.bounds`: plain functions of what was measured) and a switcher
(:mod:`.switcher`: :class:`Auto`, a state machine over the algorithms' public lifecycle, whose
collective decision point is :mod:`.deciding` and whose block phases are :mod:`.blocks`). What it
measures is :mod:`.measuring`; what it decides is a record (:mod:`.record`).
"""

from __future__ import annotations

from bunsan.algorithms.auto.bounds import codec_can_settle, later_probes_needed, probes_needed, settled_by_first_step
from bunsan.algorithms.auto.decision import (
    BLOCK_ALGORITHMS,
    PROBE_FAMILIES,
    RISKS,
    block_from_timed,
    candidates_for,
    choose,
    infer_compute,
    lengthened_block,
    probe_family,
    probes_for,
    same_choice,
    split_compute,
    trial_candidate,
    trial_verdict,
)
from bunsan.algorithms.auto.policy import DEFAULT_POLICY, AutoPolicy
from bunsan.algorithms.auto.record import format_decision, record_line
from bunsan.algorithms.auto.switcher import CHOICES, Auto, Phase

__all__ = [
    "BLOCK_ALGORITHMS",
    "CHOICES",
    "DEFAULT_POLICY",
    "PROBE_FAMILIES",
    "RISKS",
    "Auto",
    "AutoPolicy",
    "Phase",
    "block_from_timed",
    "candidates_for",
    "choose",
    "codec_can_settle",
    "format_decision",
    "infer_compute",
    "later_probes_needed",
    "lengthened_block",
    "probe_family",
    "probes_for",
    "probes_needed",
    "record_line",
    "same_choice",
    "settled_by_first_step",
    "split_compute",
    "trial_candidate",
    "trial_verdict",
]
