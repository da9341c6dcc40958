"""Golden runs: short trainings must end exactly where values.json says (see tests/golden/runs.py).

Regenerate after an intended change in training dynamics: ``python -m tests.golden --update``.
"""

from __future__ import annotations

import copy
import json

import pytest

from tests.golden import runs


@pytest.fixture(scope="module")
def stored():
    return json.loads(runs.VALUES.read_text())


def test_stored_values_cover_every_run(stored):
    assert sorted(stored["runs"]) == sorted(runs.run_names())
    assert stored["settings"] == dict(runs.SETTINGS, async_lr=runs.ASYNC_LR, async_reruns=runs.ASYNC_RERUNS)


def test_compare_demands_bits_except_for_async(stored):
    assert runs.compare(stored, copy.deepcopy(stored)) == []
    moved = copy.deepcopy(stored)
    moved["runs"]["np2:data_parallel"]["train_loss"][1] += 1e-12  # the smallest change fails an exact run
    assert any("np2:data_parallel: train_loss changed" in p for p in runs.compare(stored, moved))
    jitter = copy.deepcopy(stored)
    jitter["runs"]["np2:async"]["test_error"] += 0.01  # within the async tolerance
    assert runs.compare(stored, jitter) == []
    jitter["runs"]["np2:async"]["test_error"] += 0.1
    assert any("np2:async: test_error moved" in p for p in runs.compare(stored, jitter))
    exact_async = copy.deepcopy(stored)
    exact_async["runs"]["np1:async"]["test_loss"] += 1e-9  # one worker: async is deterministic
    assert runs.compare(stored, exact_async)
    elsewhere = copy.deepcopy(stored)
    elsewhere["fingerprint"]["torch"] = "9.9"
    assert any("environment differs" in p for p in runs.compare(stored, elsewhere))


def test_golden_runs_end_where_they_ended(stored):
    # ~40 s on 2 loaded cores: two warm pools (1 and 2 workers) and 10 two-epoch runs.
    problems = runs.compare(stored, runs.measure())
    assert not problems, "\n".join(problems) + "\nIf the change is intended: python -m tests.golden --update"


def test_async_is_checked_on_the_median_of_its_reruns():
    reruns = [
        {"train_loss": [2.2, 1.90], "test_loss": 1.78, "test_error": 0.74, "replicas_equal": True},
        {"train_loss": [2.3, 1.88], "test_loss": 1.88, "test_error": 0.73, "replicas_equal": True},  # an outlier
        {"train_loss": [2.1, 1.95], "test_loss": 1.79, "test_error": 0.75, "replicas_equal": True},
    ]
    assert runs.median_run(reruns) == {
        "train_loss": [2.2, 1.90],
        "test_loss": 1.79,
        "test_error": 0.74,
        "replicas_equal": True,
    }
    assert runs.median_run(reruns[:1]) is reruns[0]  # exact runs run once
    reruns[1]["replicas_equal"] = False
    assert runs.median_run(reruns)["replicas_equal"] is False
