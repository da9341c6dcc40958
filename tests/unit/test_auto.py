"""Auto's pure parts: candidates by risk, the block-size rule, the choice, the compute inversion."""

import pytest
import torch

from bunsan.algorithms import auto
from bunsan.algorithms import cost_model as cm


def test_candidates_by_risk():
    profile = cm.Profile(compute_s=0.1, params=1_000_000, batch=32)
    net = cm.Network(1e-5, 1e9)
    low = [c.label for c in auto.candidates_for("low", profile, net, 4)]
    assert low == ["exact", "fp16"]
    medium = [c.label for c in auto.candidates_for("medium", profile, net, 4, warm_start=640)]
    assert medium == ["exact", "fp16", "8-bit", "2-bit"]
    high = auto.candidates_for("high", profile, net, 4, momentum=0.9)
    assert high[4].label == "1-bit rotated" and high[4].options["rotate"] is True
    assert auto.candidates_for("high", profile, net, 4, momentum=0.5)[4].label == "1-bit"
    with pytest.raises(ValueError, match="risk"):
        auto.candidates_for("reckless", profile, net, 4)


def test_block_size_is_the_smallest_block_within_budget():
    # all-reduce of 4 MB at 4 workers, 1 GB/s, no latency: 2 * 3/4 * 4e6 / 1e9 = 6 ms; compute 10 ms.
    # 6 ms / k <= 5% of 10 ms needs k >= 12: the smallest allowed is 16 steps of 32 samples
    profile = cm.Profile(compute_s=0.01, params=1_000_000, batch=32)
    found = auto.candidates_for("high", profile, cm.Network(0.0, 1e9), 4)
    assert found[5].label == "block_momentum:512" and found[5].options["block_size"] == 512
    assert found[6].label == "model_averaging:512" and found[6].options["block_size"] == 512


def test_choose_keeps_exact_unless_the_gain_is_enough():
    def p(label, step):
        return cm.Prediction(label, 2, 0.1, step, 0.0, 0.0, 0.0, 0.0)

    assert auto.choose([p("exact", 0.10), p("fp16", 0.095)], 0.1)[0] == 0  # 5% < 10%
    index, why = auto.choose([p("exact", 0.10), p("fp16", 0.05)], 0.1)
    assert index == 1 and "100.0% faster" in why
    assert auto.choose([p("exact", 0.05), p("fp16", 0.06)], 0.0)[0] == 0


def test_infer_compute_inverts_the_exact_prediction():
    profile = cm.Profile(compute_s=0.08, params=2_000_000, batch=32)
    net = cm.Network(5e-5, 1e8)
    step = cm.predict(profile, net, cm.Candidate("data_parallel"), 4).step_s
    assert step > 0.09  # the exchange is partly exposed
    assert auto.infer_compute(step, profile, net, 4) == pytest.approx(0.08, rel=1e-3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="measure_steps"):
        auto.Auto(measure_steps=1)
    with pytest.raises(ValueError, match="risk"):
        auto.Auto(risk="none")
    with pytest.raises(TypeError, match="network"):
        auto.Auto(network="1gbit")
    with pytest.raises(ValueError, match="measure_budget_s"):
        auto.Auto(measure_budget_s=-0.1)
    with pytest.raises(TypeError, match="measure_budget_s"):
        auto.Auto(measure_budget_s="0.1")
    assert auto.Auto(measure_budget_s=None).measure_budget_s is None  # always measure_steps
    with pytest.raises(ValueError, match="on_resume"):
        auto.Auto(on_resume="redecide")
    assert auto.Auto().on_resume == "keep"
    # One rule (bunsan._validate): a wrong type is a TypeError, a bad value of the right type a ValueError.
    with pytest.raises(TypeError, match="measure_steps must be an int >= 2"):
        auto.Auto(measure_steps=2.5)
    with pytest.raises(TypeError, match="warm_start must be an int >= 0"):
        auto.Auto(warm_start=1.5)
    with pytest.raises(ValueError, match="warm_start must be an int >= 0"):
        auto.Auto(warm_start=-1)
    with pytest.raises(ValueError, match="min_gain must be a number >= 0"):
        auto.Auto(min_gain=-0.1)


def test_block_size_is_capped_at_thirty_two_steps():
    # 100 MB at 2 workers over 100 Mbit/s: about 8 s per exchange against 10 ms of compute; no
    # block is within budget, and the block stays at 32 steps (the accuracy cap), not longer
    profile = cm.Profile(compute_s=0.01, params=25_000_000, batch=32)
    found = auto.candidates_for("high", profile, cm.Network(1e-4, 1.25e7), 2)
    assert [c.options["block_size"] for c in found[5:]] == [32 * 32, 32 * 32]
    # 4 MB at 4 workers, 0.5 GB/s: 2 * 3/4 * 4e6 / 5e8 = 12 ms per exchange against 10 ms of compute;
    # 5% (0.5 ms) needs 24 steps: 0.75 ms at 16, 0.375 ms at 32, the first within budget
    one_mb = cm.Profile(compute_s=0.01, params=1_000_000, batch=32)
    found = auto.candidates_for("high", one_mb, cm.Network(0.0, 5e8), 4)
    assert [c.options["block_size"] for c in found[5:]] == [32 * 32, 32 * 32]


def test_one_fixed_cost_probe_per_family():
    # every bit width shares one quantized probe and both block algorithms one block probe
    probes, shared = auto.probes_for("high", momentum=0.0)
    assert [p.label for p in probes] == ["exact", "fp16", "1-bit", "block_momentum"]
    assert shared == {"8-bit": "1-bit", "2-bit": "1-bit", "model_averaging": "block_momentum"}
    probes, shared = auto.probes_for("medium", momentum=0.0)
    assert [p.label for p in probes] == ["exact", "fp16", "2-bit"] and shared == {"8-bit": "2-bit"}
    probes, shared = auto.probes_for("low", momentum=0.0)
    assert [p.label for p in probes] == ["exact", "fp16"] and shared == {}


def test_a_tie_between_the_block_algorithms_goes_by_the_optimizers_momentum():
    # a slow link of high latency: a block algorithm wins, and the two are predicted alike (same bytes,
    # one fixed cost), but for block momentum's Nesterov start: a third of a pass over the parameters a round
    profile = cm.Profile(
        compute_s=0.01,
        params=1_000_000,
        batch=32,
        copy_s_per_element=1e-9,
        fixed_s=(("block_momentum", 0.002), ("model_averaging", 0.002)),
    )
    net = cm.Network(1e-2, 1.25e7)
    for momentum, expected in (
        (0.0, "block_momentum"),
        (0.4, "block_momentum"),
        (0.5, "model_averaging"),
        (0.9, "model_averaging"),
    ):
        found = auto.candidates_for("high", profile, net, 4, momentum=momentum)
        predictions = [cm.predict(profile, net, c, 4) for c in found]
        steps = {p.label.split(":")[0]: p.step_s for p in predictions[5:]}
        assert (
            steps["model_averaging"]
            < steps["block_momentum"]
            <= (1 + auto.DEFAULT_POLICY.block_tie) * steps["model_averaging"]
        )
        index, _ = auto.choose(predictions, 0.1)
        assert found[index].algorithm == expected, momentum


def test_a_block_algorithm_more_than_the_tie_faster_wins_whatever_the_momentum():
    def p(label, step):
        return cm.Prediction(label, 2, 0.1, step, 0.0, 0.0, 0.0, 0.0)

    listed = [p("exact", 0.10), p("fp16", 0.09), p("block_momentum:1024", 0.0505), p("model_averaging:1024", 0.05)]
    assert auto.choose(listed, 0.1)[0] == 2  # within 1%: the first listed
    listed[2] = p("block_momentum:1024", 0.0506)
    assert auto.choose(listed, 0.1)[0] == 3  # 1.2% slower: the faster one
    listed[1] = p("fp16", 0.0501)
    assert auto.choose(listed, 0.1)[0] == 3  # the tie is between block algorithms only


# exact and fp16 per step, and a block at the cap (32 steps of 32 samples), predicted 10, 9 and 6 ms
PER_STEP = [("exact", "data_parallel", {}, 0.0100), ("fp16", "data_parallel", {"compression": "fp16"}, 0.0090)]
AT_CAP = ("model_averaging:1024", "model_averaging", {"block_size": 1024}, 0.0060)


def _predicted(rows):
    """Candidates and predictions from (label, algorithm, options, step seconds)."""
    candidates = [cm.Candidate(algorithm, options, label) for label, algorithm, options, _ in rows]
    predictions = [cm.Prediction(label, 4, 0.001, step, 0.0, 0.0, 0.0, 0.0) for label, _, _, step in rows]
    return candidates, predictions


def test_probes_needed_by_what_the_decision_without_them_hinges_on():
    batch, per_step = 32, PER_STEP  # the cap: 32 steps of 32 samples = 1024
    # model averaging at the cap, 1.5x faster than fp16 and 1.67x than exact: no probe at all
    rows = [*per_step, AT_CAP]
    mode, why = auto.probes_needed(*_predicted(rows), 0.1, batch)
    assert mode == "none" and "model_averaging:1024" in why and "32-step cap" in why
    # below the cap (16 steps): exact's and the block probe, which may lengthen the block
    rows = [*per_step, ("model_averaging:512", "model_averaging", {"block_size": 512}, 0.0060)]
    assert auto.probes_needed(*_predicted(rows), 0.1, batch)[0] == "exact+block"
    # fp16 within 10% of the block algorithm (0.0065 < 1.1 * 0.0060): its probe could swap them
    rows = [
        per_step[0],
        ("fp16", "data_parallel", {"compression": "fp16"}, 0.0065),
        ("block_momentum:512", "block_momentum", {"block_size": 512}, 0.0060),
    ]
    mode, why = auto.probes_needed(*_predicted(rows), 0.1, batch)
    assert mode == "exact+fp16+block" and why.startswith("fp16 within 10%")
    # 1 bit within 10% of the block algorithm but slower: its probe can only slow it further (two
    # collectives per bucket against exact's one), so no probe runs at the cap
    rows = [
        *per_step,
        ("1-bit", "data_parallel", {"bits": 1}, 0.0062),
        ("8-bit", "data_parallel", {"bits": 8}, 0.0061),
        ("block_momentum:1024", "block_momentum", {"block_size": 1024}, 0.0060),
    ]
    mode, why = auto.probes_needed(*_predicted(rows), 0.1, batch)
    assert mode == "none" and "beats exact and fp16 by 10%" in why
    # a bit width predicted fastest: its probe (which may slow it past the block) and exact's and the
    # block's run; fp16 is 2.25x the fastest, no probe can bring it near
    rows = [
        *per_step,
        ("1-bit", "data_parallel", {"bits": 1}, 0.0040),
        ("block_momentum:512", "block_momentum", {"block_size": 512}, 0.0060),
    ]
    mode, why = auto.probes_needed(*_predicted(rows), 0.1, batch)
    assert mode == "exact+quantized+block" and why == "1-bit predicted fastest without them"
    # exact kept (the block algorithm only 5% faster): the probes may take exact's fixed cost off the
    # block (exact's and the block's), fp16 is within 10% of the fastest (its own may be under exact's);
    # the quantized widths, slower, only fall further behind
    rows = [
        per_step[0],
        ("fp16", "data_parallel", {"compression": "fp16"}, 0.0098),
        ("2-bit", "data_parallel", {"bits": 2}, 0.0120),
        ("block_momentum:512", "block_momentum", {"block_size": 512}, 0.0095),
    ]
    mode, why = auto.probes_needed(*_predicted(rows), 0.1, batch)
    assert mode == "exact+fp16+block" and why.startswith("exact kept without them (block_momentum:512")
    # risk "low" (no block, no bit width) with exact fastest and fp16 far behind: no probe can change it
    rows = [per_step[0], ("fp16", "data_parallel", {"compression": "fp16"}, 0.0130)]
    mode, why = auto.probes_needed(*_predicted(rows), 0.1, batch)
    assert mode == "none" and why.startswith("exact predicted fastest")
    # ... but with fp16 within 10%, exact's and fp16's
    rows = [per_step[0], ("fp16", "data_parallel", {"compression": "fp16"}, 0.0105)]
    assert auto.probes_needed(*_predicted(rows), 0.1, batch)[0] == "exact+fp16"


def test_later_probes_only_where_they_can_still_change_the_decision():
    # after exact's probe (fixed cost 6.9 ms) and the block probe: the MNIST-1D CNN at 4 workers on 2 cores,
    # model averaging predicted at 2.4 ms, fp16 and 1 bit charged exact's fixed cost (9.2 and 10.4 ms)
    rows = [
        ("exact", "data_parallel", {}, 0.0091),
        ("fp16", "data_parallel", {"compression": "fp16"}, 0.0092),
        ("1-bit", "data_parallel", {"bits": 1}, 0.0104),
        ("model_averaging:1024", "model_averaging", {"block_size": 1024}, 0.0024),
    ]
    mode, why = auto.later_probes_needed(*_predicted(rows), {"fp16", "quantized"}, 0.0069, 0.1)
    # fp16 at 90% of exact's fixed cost: 9.2 - 0.69 = 8.5 ms, still far above 2.4: neither probe runs
    assert mode == "none"
    assert "fp16's probe skipped" in why and "quantized's probe skipped" in why
    # fp16 0.5 ms behind the block algorithm: 10% of exact's fixed cost (0.69 ms) could put it ahead
    rows[1] = ("fp16", "data_parallel", {"compression": "fp16"}, 0.0029)
    mode, why = auto.later_probes_needed(*_predicted(rows), {"fp16", "quantized"}, 0.0069, 0.1)
    assert mode == "fp16" and why == "quantized's probe skipped (at its lowest fixed cost still not the fastest)"
    # ... but not 1 ms behind (0.69 ms short of it)
    rows[1] = ("fp16", "data_parallel", {"compression": "fp16"}, 0.0034)
    assert auto.later_probes_needed(*_predicted(rows), {"fp16"}, 0.0069, 0.1)[0] == "none"
    # a bit width already fastest at exact's fixed cost: its probe runs (it can only slow it, past the block)
    rows[2] = ("1-bit", "data_parallel", {"bits": 1}, 0.0020)
    assert auto.later_probes_needed(*_predicted(rows), {"fp16", "quantized"}, 0.0069, 0.1)[0] == "quantized"


def test_probe_families():
    assert auto.probe_family(cm.Candidate("data_parallel", {}, "exact")) == "exact"
    assert auto.probe_family(cm.Candidate("data_parallel", {"compression": "bf16"}, "bf16")) == "fp16"
    assert auto.probe_family(cm.Candidate("data_parallel", {"bits": 8, "warm_start": 0}, "8-bit")) == "quantized"
    assert auto.probe_family(cm.Candidate("model_averaging", {"block_size": 64}, "model_averaging:64")) == "block"
    assert auto.probe_family(cm.Candidate("block_momentum", {"block_size": 64}, "block_momentum")) == "block"


def test_the_printed_table_says_which_probes_ran_and_why():
    decision = {
        "label": "block_momentum:512",
        "step": 4,
        "workers": 2,
        "why": "predicted 470.0% faster than exact (>= min_gain 10%)",
        "measured": {
            "exact_step_s": 0.0599,
            "compute_s": 0.0072,
            "bandwidth": 0.094e9 / 8,
            "latency_s": 138e-6,
            "decide_s": 0.48,
            "network_s": 0.25,
            "fixed_probe_s": 0.19,
        },
        "predictions": [
            {"label": "exact", "step_s": 0.0599},
            {"label": "block_momentum:512", "step_s": 0.0105},
        ],
    }
    table = auto.format_decision(decision)
    assert "fixed-cost probes" not in table.splitlines()[-1]  # not measured (e.g. a given network): no line
    chosen = [line for line in table.splitlines() if line.endswith("<- chosen")]
    assert len(chosen) == 1 and chosen[0].split()[1:3] == ["block_momentum:512", "10.50"]
    assert "measured and decided in 0.48 s (network 0.25 s, fixed-cost probes 0.19 s)" in table
    for mode, said in (
        ("all", "every family"),  # records written before the families were named
        ("blocks", "exact and block momentum only"),
        ("none", "none"),
        ("exact+fp16+block", "exact, fp16, block"),
    ):
        decision["measured"]["probes"] = [mode, "the reason"]
        assert auto.format_decision(decision).splitlines()[-1] == f"[bunsan]   fixed-cost probes: {said}: the reason"
    # the first line names the step it timed: an exact step, the first step, or the first step before its exchange
    assert "workers: exact step 59.90 ms (compute 7.20 ms)" in table
    decision["measured"]["first_step"] = True
    assert "workers: first step (from distribute() on) 59.90 ms (compute" in auto.format_decision(decision)
    decision["measured"]["first_step_before_exchange_s"] = 0.0072
    assert (
        "workers: first step before its exchange 7.20 ms (from distribute() on), as an exact step 59.90 ms (compute"
        in auto.format_decision(decision)
    )
    # the second step before its exchange: its own time and the margin it was taken at
    del decision["measured"]["first_step"], decision["measured"]["first_step_before_exchange_s"]
    decision["measured"].update(second_step_before_exchange_s=0.0036, bound_margin=2.0)
    assert (
        "workers: second step before its exchange 3.60 ms, taken at 2 times as a bound, as an exact step 59.90 ms"
        in auto.format_decision(decision)
    )


def test_one_worker_keeps_exact_without_probing_a_network(monkeypatch):
    import torch.nn.functional as F

    import bunsan
    from bunsan.algorithms import auto as auto_module

    def no_probe(*args, **kwargs):
        raise AssertionError("a job of one worker has no network to measure")

    monkeypatch.setattr(auto_module.measuring, "measure_network", no_probe)
    monkeypatch.setattr(auto_module.measuring, "measure_fixed_costs", no_probe)
    torch.manual_seed(0)
    auto = bunsan.Auto(measure_steps=3, verbose=False)
    model = torch.nn.Linear(4, 2)
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), auto)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    for _ in range(4):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert auto.decision is not None and auto.decision["step"] == 4
    assert (auto.decision["label"], auto.decision["workers"]) == ("exact", 1)
    assert "one worker" in auto.decision["why"]


def test_a_block_algorithm_without_probes_is_settled_by_the_first_step_at_or_under_the_cap():
    batch, per_step = 32, PER_STEP
    rows = [*per_step, AT_CAP]
    mode, why = auto.settled_by_first_step(*_predicted(rows), 0.1, batch)
    assert mode == "none" and "32-step cap" in why and "settled by the first step" in why
    assert "4 ms a step slower" in why  # exact's lead at the bound: 10 - 6 ms, whatever it costs (no budget)
    # under the cap the block may lengthen at a shorter step, but a block algorithm stays the choice:
    # settled, its length left to the first block's timed steps
    rows = [*per_step, ("model_averaging:512", "model_averaging", {"block_size": 512}, 0.0060)]
    mode, why = auto.settled_by_first_step(*_predicted(rows), 0.1, batch)
    assert mode == "none" and "first block's timed steps set it" in why
    # a bit width or exact may change with the compute
    rows = [*per_step, ("1-bit", "data_parallel", {"bits": 1}, 0.0040)]
    assert auto.settled_by_first_step(*_predicted(rows), 0.1, batch) is None
    rows = [per_step[0], ("fp16", "data_parallel", {"compression": "fp16"}, 0.0130)]
    assert auto.settled_by_first_step(*_predicted(rows), 0.1, batch) is None
    # fp16 within min_gain of the block, at the cap or under it: its probe could still swap them
    for size in (1024, 256):
        rows = [
            per_step[0],
            ("fp16", "data_parallel", {"compression": "fp16"}, 0.0065),
            (f"block_momentum:{size}", "block_momentum", {"block_size": size}, 0.0060),
        ]
        assert auto.settled_by_first_step(*_predicted(rows), 0.1, batch) is None
    # a block algorithm less than min_gain ahead of exact: exact kept, which a shorter step may change
    rows = [per_step[0], ("model_averaging:256", "model_averaging", {"block_size": 256}, 0.0095)]
    assert auto.settled_by_first_step(*_predicted(rows), 0.1, batch) is None


def test_the_codec_is_measured_at_a_first_step_only_where_it_could_settle_the_block():
    batch, per_step = 32, PER_STEP
    block = ("model_averaging:1024", "model_averaging", {"block_size": 1024}, 0.0060)
    # 1-bit, priced without its codec, fastest: its codec cost could leave the block fastest
    rows = [*per_step, ("1-bit", "data_parallel", {"bits": 1}, 0.0040), block]
    assert auto.settled_by_first_step(*_predicted(rows), 0.1, batch) is None
    assert auto.codec_can_settle(*_predicted(rows), 0.1, batch)
    # fp16 within min_gain of the block: the codec could slow it out of that margin
    rows = [per_step[0], ("fp16", "data_parallel", {"compression": "fp16"}, 0.0065), block]
    assert auto.codec_can_settle(*_predicted(rows), 0.1, batch)
    # exact within min_gain of the block (MNIST-1D's first step at 4 workers): no codec cost changes that
    rows = [
        ("exact", "data_parallel", {}, 0.0065),
        ("1-bit", "data_parallel", {"bits": 1}, 0.0040),
        ("model_averaging:1024", "model_averaging", {"block_size": 1024}, 0.0061),
    ]
    assert not auto.codec_can_settle(*_predicted(rows), 0.1, batch)
    # exact fastest: nothing to settle
    rows = [("exact", "data_parallel", {}, 0.0050), ("fp16", "data_parallel", {"compression": "fp16"}, 0.0065)]
    assert not auto.codec_can_settle(*_predicted(rows), 0.1, batch)


@pytest.mark.parametrize(
    ("steps", "floor", "compute_s", "exchange_s", "growth", "expected"),
    [
        # the smallest block whose round amortized is within 5% of a local step: a round as long as a
        # step is within it from 20 steps, so no block under the cap: the cap stays (0.03 a step there)
        (32, 2, 1.0, 1.0, 15 / 13, 32),
        (32, 2, 1.0, 0.1, 15 / 13, 2),  # 0.05 a step at 2 steps: within 5%
        (32, 2, 1.0, 0.3, 15 / 13, 8),  # 0.15, 0.075, 0.0375 at 2, 4, 8
        (32, 16, 1.0, 0.1, 15 / 13, 16),  # never under the first step's block (a shorter step only lengthens it)
        (32, 2, 1.0, 0.8, 15 / 13, 16),  # 0.05 at 16
        # past the cap the check after a decision on timed steps decides: lengthened_block
        (32, 2, 1.0, 32 * 0.4, 15 / 13, 64),
        (32, 2, 1.0, 32 * 2.6, 14 / 9, 64),
        (32, 2, 1.0, 32 * 0.35, 15 / 13, 32),
        # MNIST-1D at 100 Mbit/s, 4 workers, seed 0 (run 44): 1.51 ms a local step, 24.5 ms a round
        (32, 4, 0.0015131, 0.024513, 15 / 13, 64),
    ],
)
def test_a_first_step_decisions_block_is_set_by_the_rule_on_its_first_blocks_times(
    steps, floor, compute_s, exchange_s, growth, expected
):
    assert auto.block_from_timed(steps, floor, compute_s, exchange_s, growth) == expected


def _decided_at(step_s, params, batch, network, workers, momentum, codec=True):
    """The pipeline of Auto's decision without probes, from a step time: its chosen label, whether settled
    and exact's lead over the choice; ``codec=False``: the codec's costs left out (Auto's first step)."""
    costs = dict(encode_s_per_element=2e-9, decode_s_per_element=1e-9, cast_s_per_element=5e-10, codec_call_s=2e-5)
    draft = cm.Profile(
        compute_s=step_s,
        params=params,
        batch=batch,
        update_s_per_element=1e-9,
        **(costs if codec else {}),
    )
    compute = auto.infer_compute(step_s, draft, network, workers)
    profile = cm.Profile(**{**vars(draft), "compute_s": compute})
    candidates = auto.candidates_for("high", profile, network, workers, momentum=momentum)
    predictions = [cm.predict(profile, network, c, workers) for c in candidates]
    index, _ = auto.choose(predictions, 0.1)
    lead = predictions[0].step_s - predictions[index].step_s  # exact's excess a step over the choice
    return candidates[index].label, auto.settled_by_first_step(candidates, predictions, 0.1, batch), lead


def test_a_decision_settled_by_a_long_first_step_holds_at_every_shorter_step():
    # The claim of settled_by_first_step, on the cost model itself: where the first step's time (an upper
    # bound of the step's) settles the decision, every step time below it leads to the same choice.
    settled = unsettled = lower = 0
    for params in (100_000, 2_600_000, 10_500_000):
        for bandwidth in (1.25e7, 1.25e8, 1.25e9):  # 100 Mbit/s, 1 Gbit/s, 10 Gbit/s
            for workers in (2, 4, 16):
                for momentum in (0.0, 0.9):
                    network = cm.Network(5e-5, bandwidth)
                    for first_s in (1.0, 4.0, 30.0):
                        label, found, lead = _decided_at(first_s, params, 32, network, workers, momentum)
                        # settled without the codec's costs (the first step's check before measuring it):
                        # settled with them too, on the same choice (they price only fp16 and quantized)
                        bare, bare_found, _ = _decided_at(first_s, params, 32, network, workers, momentum, codec=False)
                        if bare_found is not None:
                            assert found is not None and bare == label, (params, bandwidth, workers, momentum)
                            lower += 1
                        if found is None:
                            unsettled += 1
                            continue
                        settled += 1
                        algorithm, block = label.split(":")
                        for share in (0.5, 0.2, 0.05, 0.01, 0.001):
                            case = (params, bandwidth, workers, momentum, first_s, share)
                            shorter, _, shorter_lead = _decided_at(
                                first_s * share, params, 32, network, workers, momentum
                            )
                            # the same block algorithm, its block as long or longer (the bound's is the floor)
                            assert shorter.split(":")[0] == algorithm and int(shorter.split(":")[1]) >= int(block), case
                            # exact's lead over the block only grows as the step shrinks: the lead the decision
                            # states at the bound is the least that measuring on with exact steps would cost
                            assert shorter_lead >= lead * (1 - 1e-9), case
    assert settled >= 10 and unsettled >= 10, (settled, unsettled)  # the grid holds both cases
    assert lower >= 10, lower  # and settled without the codec's costs


@pytest.mark.parametrize(
    ("steps", "compute_s", "exchange_s", "growth", "expected"),
    [
        # a doubling pays where the exchange a step exceeds (g - 1) / (1 - g/2) times the compute:
        # 0.625 / 0.1875 = 3.33 at g = 1.625 (the one factor before 2026-11-28)
        (32, 1.0, 32 * 4.0, 1.625, 64),  # 4 a step at 32: doubled; 2 a step at 64: kept
        (32, 1.0, 32 * 3.0, 1.625, 32),  # 3 a step: a doubling saves 1.5 of 4, less than 1.625 times
        (32, 1.0, 32 * 3.4, 1.625, 64),  # just over 3.33: 1.625 * (1 + 1.7) = 4.39 < 4.4
        (32, 1.0, 1000.0, 1.625, 256),  # 31, 15.6, 7.8 a step: doubled up to the longest block swept
        (32, 0.0, 1.0, 1.625, 256),  # no compute to hide behind: as long as measured
        (32, 1.0, 0.0, 1.625, 32),  # nothing to save
        (256, 1.0, 1000.0, 1.625, 256),  # at the longest already
        (64, 0.01, 64 * 0.05, 1.625, 128),  # 0.05 a step at 64 (> 0.033): doubled; 0.025 at 128 (< 0.033): kept
        # block momentum, 14/9: from (5/9) / (2/9) = 2.5 times
        (32, 1.0, 32 * 2.6, 14 / 9, 64),  # 14/9 * 2.3 = 3.58 < 3.6; then 1.3 a step: kept
        (32, 1.0, 32 * 2.4, 14 / 9, 32),  # 14/9 * 2.2 = 3.42 > 3.4
        # the 10.5M MLP at 100 Mbit/s, 4 workers (run 43): 57.79 ms a local step, 5.82 s a 32-step round
        (32, 0.05779, 5.8206, 14 / 9, 64),
        (32, 0.05779, 5.8206, 1.625, 32),  # 3.15 times: kept under the one factor
        # model averaging, 15/13: from (2/13) / (11/26) = 4/11 = 0.364 times
        (32, 1.0, 32 * 0.4, 15 / 13, 64),  # 15/13 * 1.2 = 1.385 < 1.4; then 0.2 a step: kept
        (32, 1.0, 32 * 0.35, 15 / 13, 32),  # 15/13 * 1.175 = 1.356 > 1.35
        (32, 1.0, 32 * 1.2, 15 / 13, 128),  # 1.2, 0.6 a step: doubled twice; 0.3 at 128: kept
        # MNIST-1D at 100 Mbit/s, 4 workers, seed 0 (run 44): 1.51 ms a local step, 24.5 ms a round: 0.51 times
        (32, 0.0015131, 0.024513, 15 / 13, 64),
        (32, 0.0015131, 0.024513, 14 / 9, 32),
        (32, 1.0, 1000.0, 2.0, 32),  # a doubling that may double the epochs never pays
    ],
)
def test_lengthened_block_doubles_only_while_a_doubling_beats_the_epochs_it_may_cost(
    steps, compute_s, exchange_s, growth, expected
):
    assert auto.lengthened_block(steps, compute_s, exchange_s, growth) == expected


def test_epoch_growth_is_given_for_every_block_algorithm_and_orders_them_by_the_sweeps():
    policy = auto.DEFAULT_POLICY
    growth = {name: policy.growth(name) for name in auto.BLOCK_ALGORITHMS}
    # block momentum's epochs grew more with its blocks than model averaging's in every sweep
    assert growth["model_averaging"] < growth["block_momentum"] < 2
    with pytest.raises(ValueError, match="no block growth"):
        policy.growth("data_parallel")
    with pytest.raises(ValueError, match="growth"):
        auto.lengthened_block(32, 1.0, 1.0, 0.9)


def test_the_span_check_takes_a_choice_as_the_same_whatever_its_block_length():
    ma = cm.Candidate("model_averaging", {"block_size": 1024, "warm_start": 0}, "model_averaging:1024")
    longer = cm.Candidate("model_averaging", {"block_size": 2048, "warm_start": 0}, "model_averaging:2048")
    bm = cm.Candidate("block_momentum", {"block_size": 1024, "warm_start": 0}, "block_momentum:1024")
    one = cm.Candidate("data_parallel", {"bits": 1, "warm_start": 0, "rotate": False}, "1-bit")
    rotated = cm.Candidate("data_parallel", {"bits": 1, "warm_start": 0, "rotate": True}, "1-bit rotated")
    assert auto.same_choice(ma, longer) and auto.same_choice(one, one)
    assert not auto.same_choice(ma, bm) and not auto.same_choice(one, rotated)
    assert not auto.same_choice(cm.Candidate("data_parallel", {}, "exact"), one)


def test_split_compute_takes_the_measured_local_compute_and_counts_the_rest_as_waiting():
    # 1000 float32 parameters at 2 workers, 100 us latency, 1 GB/s, the exchange after backward: exact's exchange
    # is a ring all-reduce of 4000 bytes, 2 (N - 1) / N * 4000 / 1e9 + 2 (N - 1) * 1e-4 = 4e-6 + 2e-4 = 204 us
    profile = cm.Profile(compute_s=1.0, params=1000, batch=32)
    network = cm.Network(latency_s=1e-4, bandwidth=1e9)
    inferred = auto.split_compute(10e-3, None, profile, network, 2, overlap=False)
    assert inferred == pytest.approx((10e-3 - 204e-6, 0.0))
    # the ranks spent 6 ms each outside the exchange: 6 ms of compute, 10 - 6 - 0.204 ms of waiting a step
    compute, straggler = auto.split_compute(10e-3, 6e-3, profile, network, 2, overlap=False)
    assert (compute, straggler) == pytest.approx((6e-3, 3.796e-3))
    split = cm.Profile(compute_s=compute, params=1000, batch=32, straggler_s=straggler)
    exact = cm.predict(split, network, cm.Candidate("data_parallel", {}, "exact"), 2, overlap=False)
    assert exact.step_s == pytest.approx(10e-3)  # exact's prediction stays the measured step
    # a block of 32 steps waits once, for a skew of straggler * sqrt(32), and all-reduces once
    block = cm.predict(split, network, cm.Candidate("model_averaging", {"block_size": 32 * 32}), 2, overlap=False)
    assert block.step_s == pytest.approx(6e-3 + (204e-6 + 3.796e-3 * 32**0.5) / 32)
    # a local compute not under the inferred one, or none measured: the inferred compute, no waiting
    assert auto.split_compute(10e-3, 9.9e-3, profile, network, 2, overlap=False) == pytest.approx(inferred)
    assert auto.split_compute(10e-3, 0.0, profile, network, 2, overlap=False) == pytest.approx(inferred)


@pytest.mark.parametrize("bad", [0, -5, 2.5, "32k"])
def test_the_network_probe_refuses_a_job_size_that_is_not_a_positive_int(bad):
    from bunsan.algorithms.measure import measure_network

    with pytest.raises((TypeError, ValueError), match="enough_bytes"):
        measure_network(enough_bytes=bad)  # refused before any collective: no process group needed


def test_a_trial_is_asked_only_where_exact_is_kept_and_a_block_is_within_the_window():
    def rows(block_s, fp16_s=0.0095):
        return _predicted(
            [
                ("exact", "data_parallel", {}, 0.0100),
                ("fp16", "data_parallel", {"compression": "fp16"}, fp16_s),
                ("model_averaging:1024", "model_averaging", {"block_size": 1024}, block_s),
                ("block_momentum:1024", "block_momentum", {"block_size": 1024}, block_s * 1.005),
            ]
        )

    # 5% faster than exact: under min_gain (10%), within the window (down to 0%): a trial of the tie's winner
    assert auto.trial_candidate(*rows(0.0100 / 1.05), 0.1) == 2
    # exactly as fast as exact: the window's lower end (min_gain - TRIAL_WINDOW = 0) still asks for one
    assert auto.trial_candidate(*rows(0.0100), 0.1) == 2
    assert auto.trial_candidate(*rows(0.0100 * 1.02), 0.1) is None  # slower than exact: no trial
    assert auto.trial_candidate(*rows(0.0100 / 1.2), 0.1) is None  # 20% faster: chosen outright, no trial
    # exact kept with fp16 predicted fastest: the block's own gain decides
    assert auto.trial_candidate(*rows(0.0100 / 1.04, fp16_s=0.0093), 0.1) == 2
    # risk "medium": no block candidate, no trial
    candidates, predictions = rows(0.0100 / 1.05)
    assert auto.trial_candidate(candidates[:2], predictions[:2], 0.1) is None
    # a larger min_gain moves the window with it
    assert auto.trial_candidate(*rows(0.0100 / 1.05), 0.3) is None
    assert auto.trial_candidate(*rows(0.0100 / 1.25), 0.3) == 2


def test_a_trials_verdict_is_its_timed_step_at_the_cap_against_exacts_measured_step():
    growth = auto.DEFAULT_POLICY.growth("model_averaging")
    # 10 ms local steps, a 4 ms round: at the 32-step cap 10.125 ms a step (the 5% rule would take 8 steps)
    keep, steps, block_s, gain = auto.trial_verdict(0.0111, 0.010, 0.004, 0.1, growth)
    assert steps == 32 and block_s == pytest.approx(0.010125)
    assert gain == pytest.approx(0.0111 / 0.010125 - 1) and not keep  # 9.6% faster: under min_gain
    keep, steps, block_s, gain = auto.trial_verdict(0.0112, 0.010, 0.004, 0.1, growth)
    assert keep and steps == 32 and gain == pytest.approx(0.0112 / 0.010125 - 1)  # 10.6%
    # a round that dominates: the block past the cap, by the lengthening rule
    keep, steps, block_s, gain = auto.trial_verdict(0.2, 0.010, 1.0, 0.1, growth)
    assert steps == auto.lengthened_block(32, 0.010, 1.0, growth) > 32
    assert block_s == pytest.approx(0.010 + 1.0 / steps) and keep
    keep, *_ = auto.trial_verdict(0.010, 0.0099, 0.0001, 0.1, growth)
    assert not keep  # 1% faster: back to exact
