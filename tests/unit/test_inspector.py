"""Pure parts of bunsan.comm.inspector: the sentences for collectives out of step, a forgotten join, a stall."""

from __future__ import annotations

import pytest
import torch

from bunsan.comm import inspector


@pytest.fixture(autouse=True)
def fresh_inspector():
    inspector.configure(rank=0, world_size=2)
    yield
    inspector.configure(rank=0, world_size=1)


def _state(activity: str = inspector.TRAINING, last=None, waiting: bool = False) -> dict:
    return {"rank": 0, "activity": activity, "last": last, "waiting": waiting}


def test_rings_in_step_say_nothing():
    ring = [["world", 1, "all_reduce [20 x float32]", 0], ["world", 2, "all_reduce [3 x float64]", 0]]
    assert inspector.describe_mismatch({0: ring, 1: list(ring)}, {0: _state(), 1: _state()}) is None


def test_rings_that_only_partly_overlap_compare_the_overlap():
    a = [["world", n, "all_reduce [20 x float32]", 0] for n in range(1, 9)]
    b = [["world", n, "all_reduce [20 x float32]", 0] for n in range(5, 12)]
    assert inspector.describe_mismatch({0: a, 1: b}, {0: _state(), 1: _state()}) is None


def test_different_ops_under_one_number_name_the_number_the_ops_and_the_ranks():
    a = [["world", 7, "all_reduce [20 x float32]", 3]]
    b = [["world", 6, "all_reduce [20 x float32]", 3], ["world", 7, "barrier []", 3]]
    text = inspector.describe_mismatch({0: a, 1: b}, {0: _state(), 1: _state()})
    assert text is not None
    assert "world collective #7: rank 0 called all_reduce [20 x float32] but rank 1 called barrier []" in text


def test_the_same_op_after_different_step_counts_names_the_rank_that_skipped_and_its_step():
    a = [["world", 5, "all_reduce [20 x float32]", 2], ["world", 6, "all_reduce [20 x float32]", 3]]
    b = [["world", 5, "all_reduce [20 x float32]", 2], ["world", 6, "all_reduce [20 x float32]", 2]]
    text = inspector.describe_mismatch({0: a, 1: b}, {0: _state(), 1: _state()})
    assert text is not None and "rank 1 skipped optimizer.step() at its step 2 " in text and "#6" in text


def test_a_skip_older_than_the_rings_is_named_as_a_bound():
    a = [["world", n, "all_reduce [20 x float32]", n + 1] for n in range(100, 110)]
    b = [["world", n, "all_reduce [20 x float32]", n] for n in range(100, 110)]
    text = inspector.describe_mismatch({0: a, 1: b}, {0: _state(), 1: _state()})
    assert text is not None and "rank 1 skipped optimizer.step() at or before its step 100 " in text


def test_collectives_inside_join_are_not_compared_by_step():
    # A joined rank answers the others' exchanges: its entries carry -1.
    a = [["world", 9, "all_reduce [20 x float32]", 7]]
    b = [["world", 9, "all_reduce [20 x float32]", -1]]
    assert inspector.describe_mismatch({0: a, 1: b}, {0: _state(), 1: _state("in join")}) is None


def test_a_rank_in_finalize_gets_the_forgotten_join_sentence():
    a = [["world", 12, "all_reduce [1 x float32]", 8]]
    b = [["world", 12, "all_reduce [20 x float32]", -1]]
    text = inspector.describe_mismatch({0: a, 1: b}, {0: _state(), 1: _state(inspector.FINALIZE_JOIN)})
    assert text == (
        "rank 1 finished its data and called finalize() while rank 0 was still training: "
        "call optimizer.join() on every rank after the loop"
    )


def test_collectives_are_numbered_per_group_and_tagged_with_steps():
    class Algorithm:
        step = 4

    algorithm = Algorithm()
    inspector.count_steps_of(algorithm)
    assert inspector.started("all_reduce", None, torch.zeros(3)) == 1
    assert inspector.started("barrier", None) == 2
    assert inspector.collectives_in_world() == 2
    with inspector.activity("in join"):  # no store in this process: nothing is published
        inspector.started("all_reduce", None, torch.zeros(3, dtype=torch.float64))
    assert inspector._ring() == [
        ["world", 1, "all_reduce [3 x float32]", 4],
        ["world", 2, "barrier []", 4],
        ["world", 3, "all_reduce [3 x float64]", -1],
    ]


def test_stall_report_names_the_ranks_that_have_not_arrived_and_what_they_do():
    inspector.configure(rank=0, world_size=3)
    inspector.started("all_reduce", None, torch.zeros(20))
    states = {
        0: _state(last=["world", 1, "all_reduce [20 x float32]", 0], waiting=True),
        1: _state("in checkpoint save", last=["world", 0, "x", 0]),
        2: _state(last=["world", 1, "all_reduce [20 x float32]", 0], waiting=True),
    }
    text = inspector.stall_report(61.0, states)
    assert text.startswith(
        "world collective #1 all_reduce [20 x float32] has waited 61 s for 1 rank(s), still waiting: "
        "rank 1 is in checkpoint save (last started world collective #0"
    ), text
    assert "rank 2" not in text


def test_stall_threshold_must_be_positive():
    with pytest.raises(ValueError, match="stall_s"):
        inspector.configure(rank=0, world_size=2, stall_s=0)


def test_the_first_collectives_of_each_step_name_a_skip_older_than_the_rings():
    # Two collectives per step; rank 1 skipped step 50, so from count 51 on it begins later.
    rank0 = [[t, 1 + 2 * t] for t in range(40, 120)]
    rank1 = [[t, 1 + 2 * t] for t in range(40, 51)] + [[t, 3 + 2 * t] for t in range(51, 120)]
    assert inspector.skipped_step(rank0, rank1) == 50
    assert inspector.skipped_step(rank0[20:], rank1[20:]) is None  # nothing agreed in the window: unknown
    a = [["world", n, "all_reduce [20 x float32]", (n - 1) // 2] for n in range(200, 210)]
    b = [["world", n, "all_reduce [20 x float32]", (n - 3) // 2] for n in range(200, 210)]
    text = inspector.describe_mismatch({0: a, 1: b}, {0: _state(), 1: _state()}, {0: rank0, 1: rank1}.get)
    assert text is not None and "rank 1 skipped optimizer.step() at its step 50 " in text


def test_step_counts_begin_where_the_tag_changes():
    class Algorithm:
        step = 0

    algorithm = Algorithm()
    inspector.count_steps_of(algorithm)
    for _ in range(3):
        inspector.started("all_reduce", None, torch.zeros(2))
        inspector.started("all_reduce", None, torch.zeros(2))
        algorithm.step += 1
    assert list(inspector._local.transitions) == [(0, 1), (1, 3), (2, 5)]
