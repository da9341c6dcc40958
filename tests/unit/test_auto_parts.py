"""Auto's policy, its record and the algorithms' lifecycle: values worked out by hand, no processes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from bunsan.algorithms import auto
from bunsan.algorithms import cost_model as cm
from bunsan.algorithms.auto import AutoPolicy
from bunsan.algorithms.base import Algorithm, Observer, RoundReport


def test_the_policy_holds_bunsans_numbers_and_refuses_bad_ones():
    policy = AutoPolicy()
    assert policy.block_steps == (2, 4, 8, 16, 32) and policy.block_cap == 32
    assert (policy.block_budget, policy.block_tie, policy.trial_window, policy.trial_steps) == (0.05, 0.01, 0.1, 8)
    assert (policy.min_timed, policy.min_agreeing, policy.second_step_margin) == (3, 2, 2.0)
    assert (policy.probe_steps, policy.probe_warmup, policy.probe_repeats) == (4, 2, 3)
    assert policy.growth("block_momentum") == 14 / 9 and policy.growth("model_averaging") == 15 / 13
    with pytest.raises(ValueError, match="block_budget"):
        AutoPolicy(block_budget=1.5)
    with pytest.raises(ValueError, match="block_steps must be increasing"):
        AutoPolicy(block_steps=(8, 4))
    with pytest.raises(ValueError, match="max_block_steps"):
        AutoPolicy(block_steps=(2, 4, 64), max_block_steps=32)
    with pytest.raises(ValueError, match="growth_block_momentum"):
        AutoPolicy(growth_block_momentum=0.5)
    with pytest.raises(ValueError, match="min_timed"):
        AutoPolicy(min_timed=1)
    with pytest.raises(TypeError, match="second_step_check"):
        AutoPolicy(second_step_check=1)
    with pytest.raises(TypeError, match="policy"):
        auto.Auto(policy={"block_budget": 0.1})
    assert auto.Auto(policy=AutoPolicy(trial_steps=4)).policy.trial_steps == 4
    with pytest.raises(AttributeError):
        policy.block_budget = 0.1  # type: ignore[misc]  # frozen: a job changes it by building another


def test_the_block_rule_follows_the_policys_budget_and_steps():
    # as test_auto's: an exchange of 6 ms a block against 10 ms of compute at 4 workers.
    # 5%: 6 ms / k <= 0.5 ms needs k >= 12: 16 steps; 10%: k >= 6: 8 steps; 20%: k >= 3: 4 steps
    profile = cm.Profile(compute_s=0.01, params=1_000_000, batch=32)
    net = cm.Network(0.0, 1e9)
    for budget, steps in ((0.05, 16), (0.1, 8), (0.2, 4)):
        policy = AutoPolicy(block_budget=budget)
        assert auto.decision.block_size(profile, net, 4, "model_averaging", policy=policy) == steps * 32
    # no block within the budget: the policy's own cap
    policy = AutoPolicy(block_steps=(2, 4, 8))
    assert auto.decision.block_size(profile, net, 4, "model_averaging", policy=policy) == 8 * 32


def test_the_lengthening_and_the_trial_follow_the_policy():
    # 1 a local step, 1000 a round: doubled while it pays, up to the policy's longest block
    assert auto.lengthened_block(32, 1.0, 1000.0, 1.625) == 256
    assert auto.lengthened_block(32, 1.0, 1000.0, 1.625, policy=AutoPolicy(max_block_steps=64)) == 64
    # a trial's verdict prices the policy's cap: 10 ms local steps and a 4 ms round at 16 steps are
    # 10.25 ms a step, against exact's 11.2 ms: 9.3% faster, under min_gain (at the 32-step cap: 10.6%, kept)
    policy = AutoPolicy(block_steps=(2, 4, 8, 16))
    keep, steps, block_s, gain = auto.trial_verdict(0.0112, 0.010, 0.004, 0.1, 15 / 13, policy=policy)
    assert (keep, steps) == (False, 16) and block_s == pytest.approx(0.01025)
    assert gain == pytest.approx(0.0112 / 0.01025 - 1)
    assert auto.trial_verdict(0.0112, 0.010, 0.004, 0.1, 15 / 13)[0]


def test_a_block_tie_and_the_trial_window_follow_the_policy():
    def p(label, step):
        return cm.Prediction(label, 2, 0.1, step, 0.0, 0.0, 0.0, 0.0)

    rows = [p("exact", 0.0100), p("block_momentum:512", 0.0050), p("model_averaging:512", 0.00497)]
    # model averaging 0.6% faster: within the 1% tie, block momentum (listed first) wins; not within 0.5%
    assert auto.choose(rows, 0.1)[0] == 1
    assert auto.choose(rows, 0.1, policy=AutoPolicy(block_tie=0.005))[0] == 2
    candidates = [
        cm.Candidate("data_parallel", {}, "exact"),
        cm.Candidate("block_momentum", {"block_size": 512}, "block_momentum:512"),
    ]
    near = [p("exact", 0.0100), p("block_momentum:512", 0.0100 / 1.05)]  # 5% faster: under min_gain 10%
    assert auto.trial_candidate(candidates, near, 0.1) == 1  # within the 10-point window
    assert auto.trial_candidate(candidates, near, 0.1, policy=AutoPolicy(trial_window=0.04)) is None


def test_a_record_is_one_json_line_that_plan_reads_back():
    decision = {
        "algorithm": "model_averaging",
        "options": {"block_size": 256},
        "label": "model_averaging:256",
        "why": "predicted 50.0% faster than exact (>= min_gain 10%)",
        "step": 0,
        "workers": 2,
        "measured": {"exact_step_s": 0.02, "compute_s": 0.01, "overlap": False},
        "predictions": [{"label": "exact", "step_s": 0.02, "bytes_per_step": 4000.0}],
    }
    line = auto.record_line({"event": "decision", **decision})
    assert "\n" not in line and json.loads(line) == {"event": "decision", **decision}
    from bunsan.bench.plan import find_auto_decision

    assert find_auto_decision(json.loads(line))["label"] == "model_averaging:256"


def test_a_trial_record_turns_a_kept_exact_into_short_blocks():
    decision = {
        "algorithm": "data_parallel",
        "options": {},
        "label": "exact",
        "why": "exact kept",
        "measured": {"exact_step_s": 0.0105, "batch": 16},
    }
    candidate = cm.Candidate("model_averaging", {"block_size": 512, "warm_start": 0}, "model_averaging:512")
    predictions = [
        cm.Prediction(label, 2, 0.1, s, 0.0, 0.0, 0.0, 0.0) for label, s in (("exact", 0.0105), ("ma", 0.01))
    ]
    auto.record.trial_record(decision, candidate, predictions, 1, AutoPolicy(trial_steps=4))
    # 4 steps of 16 samples; 0.0105 / 0.01 - 1 = 5% predicted
    assert decision["label"] == "model_averaging:64" and decision["options"] == {"block_size": 64, "warm_start": 0}
    assert decision["trial"] == {
        "of": "model_averaging:512",
        "predicted_gain": pytest.approx(0.05),
        "steps": 4,
        "exact_step_s": 0.0105,
    }
    assert "a trial: model_averaging:512 predicted 5.0% faster" in decision["why"]


def test_a_hand_over_carries_the_counters_and_the_step_under_way():
    old, new = Algorithm(), Algorithm()
    old.step, old.samples, old.local_samples = 5, 80, 40
    old.count_samples(8)  # counted by a forward, not yet part of a step
    old.note_forward(3)
    old.observer = Observer()
    old.hand_over(new)
    assert (new.step, new.samples, new.local_samples) == (5, 80, 40)
    assert old.observer is None
    assert (new._pending_samples, new._unconfirmed_samples) == (0, 0)  # between steps: nothing moves
    old2, new2 = Algorithm(), Algorithm()
    old2.count_samples(8)
    old2.note_forward(3)
    old2.hand_over(new2, mid_step=True)  # the step under way: its samples become the successor's
    assert (new2._pending_samples, new2._unconfirmed_samples) == (8, 3)
    assert (old2._pending_samples, old2._unconfirmed_samples) == (0, 0)


def test_the_base_observer_does_nothing_and_holds_nothing():
    observer = Observer()
    assert observer.holds_exchange() is False and observer.before_exchange() is False
    assert observer.report_width() == 0 and observer.report_values() is None
    observer.after_exchange(0.1)
    observer.after_round(RoundReport(0.1, 2))


def test_auto_is_a_state_machine_that_starts_measuring():
    chooser = auto.Auto(verbose=False)
    assert chooser.phase is auto.Phase.MEASURING and chooser.decision is None and chooser.records == []
    assert chooser.report_width() == 0 and chooser.measured_steps == 0
    model = torch.nn.Linear(4, 2)
    chooser.setup(list(model.named_parameters()))
    chooser.apply_decision({"algorithm": "data_parallel", "options": {}, "label": "exact", "step": 0})
    assert chooser.phase is auto.Phase.DECIDED and [r["event"] for r in chooser.records] == ["decision"]
    assert replace(chooser.policy, block_budget=0.1).block_budget == 0.1
