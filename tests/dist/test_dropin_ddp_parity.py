"""The DDP parity benchmark on 2 gloo ranks: both trainers do the same arithmetic, and its models are as claimed."""

from __future__ import annotations

import pytest

from bunsan.bench import ddp_overhead


def _body_measure(rank: int, world_size: int, name: str) -> dict:
    return ddp_overhead.measure(name, batch=4, steps=2, rounds=2)


@pytest.mark.parametrize(("name", "tensors"), [("many-small", 200), ("digits-cnn", 8)])
def test_bunsan_and_ddp_end_with_identical_parameters(workers, name, tensors):
    first, second = workers.run(f"{__name__}:_body_measure", name=name)
    assert first["model"] == name and first["tensors"] == tensors
    assert first["max_param_diff"] == 0.0 == second["max_param_diff"]  # bit for bit the same model as DDP's
    assert first["ratio_min"] <= first["ratio"] <= first["ratio_max"]
    assert first["ddp_ms"] > 0 and first["bunsan_ms"] > 0


def test_resnet20_case_is_the_reference_model():
    case = ddp_overhead.cases()["resnet20"]
    model = case.build()
    assert sum(p.numel() for p in model.parameters()) == 272_474
    assert (case.batch, case.input_shape) == (32, (3, 32, 32))


def test_unknown_model_is_refused_before_joining(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ddp_overhead.main(["--models", "vgg"])
    assert exit_info.value.code == 2
    assert "unknown models ['vgg']" in capsys.readouterr().err
