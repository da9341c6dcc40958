"""Issue 15, items 5, 6, 9 and 10, in real 2-rank jobs (torch, gloo) under bunsan run, torchrun and by hand.

Each job takes 5-20 s here (two interpreters importing torch on a loaded
2-core machine); ``python -m tests.launch.edges --runs 20 SCENARIO`` repeats a
scenario for the acceptance figures.
"""

from __future__ import annotations

import sys

import pytest

from tests.launch import edges

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, prctl and pidfds: Linux only")


@pytest.mark.timeout(150)
def test_a_local_job_listens_on_loopback_only(tmp_path):
    """Item 5: rank 0's store and Gloo's sockets, as `ss -ltnp` would list them."""
    outcome = edges.bunsan_run(tmp_path, "listen", -1)
    assert outcome.code == 0, outcome.output
    assert len(outcome.listeners) >= 2, outcome.listeners  # the store, and Gloo's sockets
    assert {address.rsplit(":", 1)[0] for address in outcome.listeners} == {"127.0.0.1"}, outcome.listeners
    assert outcome.left == []


@pytest.mark.timeout(150)
def test_an_intruder_on_the_store_cannot_end_a_torchrun_job(tmp_path):
    """Item 5: the abort key is named from a secret the ranks share, not from the job id."""
    outcome = edges.torchrun(tmp_path, "attack", -1)
    assert outcome.code == 0, outcome.output
    assert "rank 0 survived the intruder" in outcome.output
    assert "forged" not in outcome.output
    assert outcome.left == []


@pytest.mark.timeout(300)
def test_bunsan_run_names_rank_0_when_rank_0_raises(tmp_path):
    """Item 9: rank 0 lingers a second in its exception hook while rank 1, told to stop, exits first."""
    for attempt in range(3):
        directory = tmp_path / str(attempt)
        directory.mkdir()
        outcome = edges.bunsan_run(directory, "raise", 0)
        assert outcome.code == 1, outcome.output
        assert outcome.launcher_line.startswith(
            "bunsan run: rank 0 exited with code 1 (it failed first: RuntimeError: boom on rank 0)"
        ), outcome.output
        assert outcome.elapsed_s < 30
        assert outcome.left == []


@pytest.mark.timeout(150)
def test_bunsan_run_names_rank_1_when_rank_1_raises(tmp_path):
    outcome = edges.bunsan_run(tmp_path, "raise", 1)
    assert outcome.code == 1, outcome.output
    assert outcome.launcher_line.startswith("bunsan run: rank 1 exited with code 1 (it failed first:"), outcome.output
    assert outcome.left == []


@pytest.mark.timeout(150)
def test_bunsan_run_names_a_silently_killed_rank(tmp_path):
    outcome = edges.bunsan_run(tmp_path, "kill9", 1)
    assert outcome.code == 137, outcome.output
    # The launcher's own line; rank 0 may be stopped before its collective even fails.
    assert outcome.launcher_line.startswith("bunsan run: rank 1 was killed by SIGKILL (exit code 137)"), outcome.output
    assert outcome.left == []


@pytest.mark.timeout(150)
def test_kill_9_under_torchrun_names_the_dead_rank_and_leaves_no_process(tmp_path):
    """Items 6 and 10: DataLoader workers, children and detached children of both ranks all end."""
    outcome = edges.torchrun(tmp_path, "kill9", 1)
    assert outcome.code != 0
    assert "rank 0 of 2" in outcome.output and "because rank 1 died without a word" in outcome.output, outcome.output
    assert outcome.left == [], outcome.left


@pytest.mark.timeout(150)
def test_kill_9_in_a_job_started_by_hand(tmp_path):
    """Items 6 and 10 without any launcher: rank 0 names rank 1, ends its own children and exits 1."""
    rank0, rank1 = edges.by_hand(tmp_path, "kill9", 1)
    assert rank1.code == -9
    assert rank0.code == 1, rank0.output
    assert "rank 0 of 2: stopping because rank 1 died without a word" in rank0.output
    assert rank0.left == [], rank0.left


@pytest.mark.timeout(150)
def test_a_raising_rank_in_a_job_started_by_hand_leaves_no_process(tmp_path):
    """Item 6: the survivor ends its own tree before it exits; the failed rank's janitor ends the rest."""
    rank0, rank1 = edges.by_hand(tmp_path, "raise", 1)
    assert (rank0.code, rank1.code) == (1, 1), rank0.output + rank1.output
    assert "stopping because rank 1 failed" in rank0.output
    assert rank0.left == [], rank0.left


@pytest.mark.timeout(200)
def test_every_rank_that_raised_is_named_as_having_raised(tmp_path):
    """Issue 67, item 5: both ranks raise the same error at the same step. Neither is said to have died
    without a word (a survivor's watch once took the other's exit for a silent death), each prints its
    own traceback, and the launcher names both: the earliest first. Three runs: the order is a race."""
    for attempt in range(3):
        (directory := tmp_path / str(attempt)).mkdir()
        outcome = edges.bunsan_run(directory, "raise_all", -1)
        assert outcome.code == 1, outcome.output
        assert "died without a word" not in outcome.output and "stopping because" not in outcome.output, outcome.output
        assert "rank 0 of 2 failed" in outcome.output and "rank 1 of 2 failed" in outcome.output, outcome.output
        assert "raised too (the same error)" in outcome.launcher_line, outcome.launcher_line
        assert outcome.left == [], outcome.left
