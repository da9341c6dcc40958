"""Schedule arithmetic in samples: pure functions, no processes."""

from __future__ import annotations

import math

import pytest

from bunsan.train.schedules import (
    Schedule,
    as_schedule,
    learning_rate,
    local_minibatch_size,
    momentum_from_time_constant,
    plan_minibatches,
    schedule,
    time_constant_from_momentum,
)


def test_list_entries_hold_for_epoch_size_samples_and_the_last_holds_forever():
    mb = schedule([256] * 6 + [512] * 9 + [1024], epoch_size=100)
    assert mb.pairs == ((6, 256), (9, 512), (1, 1024))  # repeats merged
    assert [mb(s) for s in (0, 599, 600, 1499, 1500, 10**12)] == [256, 256, 512, 512, 1024, 1024]
    assert mb.boundaries() == [600, 1500]


def test_pairs_and_numbers_give_the_same_schedule():
    assert schedule([(2, 0.1), (1, 0.05)], epoch_size=10) == schedule([0.1, 0.1, 0.05], epoch_size=10)


def test_a_number_is_constant_and_needs_no_epoch_size():
    lr = schedule(0.001)
    assert lr.is_constant and lr(0) == lr(10**9) == 0.001 and lr.boundaries() == []


def test_cntk_momentum_time_constant_schedule():
    tau = schedule([0] * 5 + [1024], epoch_size=54000)
    assert tau(5 * 54000 - 1) == 0 and tau(5 * 54000) == 1024
    assert tau.next_change(0) == 5 * 54000 and tau.next_change(5 * 54000) is None


@pytest.mark.parametrize(
    ("values", "epoch_size", "error", "match"),
    [
        ([], 10, ValueError, "at least one value"),
        ([(0, 1.0)], 10, ValueError, "counts must be an int >= 1"),
        ([(1.5, 1.0)], 10, TypeError, "must be an integer"),
        (["a"], 10, TypeError, "neither a number nor"),
        ("0.1", 10, TypeError, "a number or a list"),
        ([1.0, 2.0], 0, ValueError, "epoch_size must be"),
        ([1.0, 2.0], 1.5, TypeError, "epoch_size must be an int"),
        ([float("nan")], 10, ValueError, "values must be a finite number"),
        ([(1, "x")], 10, TypeError, "values must be real numbers"),
    ],
)
def test_bad_schedules_name_the_problem(values, epoch_size, error, match):
    # bunsan._validate's rule: the wrong type is a TypeError, a bad value of the right type a ValueError.
    with pytest.raises(error, match=match):
        schedule(values, epoch_size=epoch_size)


def test_several_values_without_epoch_size_need_resolving():
    s = schedule([1, 2])
    with pytest.raises(ValueError, match="no epoch_size"):
        s(0)
    assert s.resolve(7)(6) == 1 and s.resolve(7)(7) == 2
    assert schedule([1, 2], epoch_size=3).resolve(7).epoch_size == 3  # an explicit size wins
    assert as_schedule("lr", None, 7) is None
    with pytest.raises(ValueError, match=r"^lr: "):
        as_schedule("lr", [], 7)


def test_state_dict_round_trip_and_scaling():
    s = schedule([(2, 0.1), (1, 0.05)], epoch_size=10)
    assert Schedule.from_state_dict(s.state_dict()) == s
    assert s.scaled(0.5)(25) == 0.025
    assert Schedule.constant(3.0)(5) == 3.0


def test_learning_rate_is_per_sample_times_the_global_minibatch():
    assert learning_rate(0.001, 256) == pytest.approx(0.256)
    assert learning_rate(0.001, 4096) == pytest.approx(4.096)


def test_momentum_from_time_constant():
    assert momentum_from_time_constant(0, 256) == 0.0  # tau = 0: no momentum
    assert momentum_from_time_constant(1024, 256) == pytest.approx(math.exp(-0.25))
    assert momentum_from_time_constant(math.inf, 256) == 1.0
    # The same time constant decays by 1/e after tau samples, whatever the minibatch.
    assert momentum_from_time_constant(1024, 512) == pytest.approx(momentum_from_time_constant(1024, 256) ** 2)
    assert time_constant_from_momentum(momentum_from_time_constant(1024, 256), 256) == pytest.approx(1024)
    assert time_constant_from_momentum(0.0, 256) == 0.0
    with pytest.raises(ValueError, match="time_constant must be >= 0"):
        momentum_from_time_constant(-1, 256)
    with pytest.raises(ValueError, match="momentum must be in"):
        time_constant_from_momentum(1.0, 256)


def test_global_minibatch_is_split_rounding_down_and_never_below_the_world_size():
    assert local_minibatch_size(256, 2) == 128
    assert local_minibatch_size(256, 3) == 85  # trains 255 samples per step
    assert local_minibatch_size(3, 3) == 1
    with pytest.raises(ValueError, match="minibatch_size=2 is smaller than the 3 workers"):
        local_minibatch_size(2, 3)
    with pytest.raises(ValueError, match="integer"):
        local_minibatch_size(2.5, 1)


def test_plan_cuts_the_epoch_and_changes_size_inside_it():
    # 2 workers, 33 samples each per epoch; the global minibatch grows from 16 to 24 at sample 40.
    mb = schedule([16, 24], epoch_size=40)
    assert plan_minibatches(33, 0, 0, mb, 2) == [8, 8, 8, 9]  # steps start at 0, 16, 32 (< 40), then 48: 12 > 9 left
    assert plan_minibatches(33, 0, 66, mb, 2) == [12, 12, 9]  # the next epoch, all at 24


def test_plan_from_a_checkpointed_position_is_the_rest_of_the_full_plan():
    mb = schedule([6, 10, 14], epoch_size=25)
    full = plan_minibatches(40, 0, 0, mb, 2)
    position, samples = 0, 0
    for i, local in enumerate(full):
        assert plan_minibatches(40, position, samples, mb, 2) == full[i:]
        position, samples = position + local, samples + 2 * local
    assert sum(full) == 40


def test_plan_stops_at_max_samples():
    mb = schedule(16)
    assert plan_minibatches(33, 0, 0, mb, 2, max_samples=40) == [8, 8, 4]
    assert plan_minibatches(33, 0, 0, mb, 2, max_samples=33) == [8, 8]  # 1 sample left cannot be split over 2
    assert plan_minibatches(33, 0, 40, mb, 2, max_samples=40) == []


@pytest.mark.parametrize("values", [[1, -2], [float("inf")], [(2, float("nan"))]])
def test_negative_or_non_finite_values_are_refused(values):
    with pytest.raises(ValueError, match="schedule values must be"):
        schedule(values, 10)
