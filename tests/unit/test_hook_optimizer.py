"""HookOptimizer's argument checks (single process: no process group is needed to refuse)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from bunsan.algorithms import HookOptimizer, QuantizedHookState
from bunsan.compression.rotation import RotatedQuantizer
from bunsan.errors import CheckpointError


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_refuses_other_optimizers():
    model = nn.Linear(2, 2)
    state = QuantizedHookState(model, bits=1, warmup_steps=0)
    with pytest.raises(TypeError, match="SGD .* Adam/AdamW .* got RMSprop"):
        HookOptimizer(torch.optim.RMSprop(model.parameters()), state)
    with pytest.raises(TypeError, match="optimizer"):
        HookOptimizer("sgd", state)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="state"):
        HookOptimizer(_sgd(model), object())  # type: ignore[arg-type]


def test_refuses_an_exact_state():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="bits=32"):
        HookOptimizer(_sgd(model), QuantizedHookState(model, bits=32))


def test_refuses_wrapping_twice():
    model = nn.Linear(2, 2)
    state = QuantizedHookState(model, bits=4)
    wrapped = HookOptimizer(_sgd(model), state)
    assert state._momentum is wrapped._local
    with pytest.raises(TypeError, match="HookOptimizer already"):
        HookOptimizer(wrapped, QuantizedHookState(model, bits=4))
    with pytest.raises(ValueError, match="has a HookOptimizer already"):
        HookOptimizer(_sgd(model), state)


def test_adam_needs_a_warm_up_rotates_by_default_and_is_told_to_rotate_otherwise():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="warm-up"):
        HookOptimizer(torch.optim.Adam(model.parameters()), QuantizedHookState(model, bits=1, warmup_steps=0))
    default = QuantizedHookState(model, bits=1, warmup_steps=5)
    assert not isinstance(default._quantizer, RotatedQuantizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HookOptimizer(torch.optim.AdamW(model.parameters()), default)
    assert isinstance(default._quantizer, RotatedQuantizer) and default._quantizer.chunk_size == 1024
    sgd = QuantizedHookState(model, bits=1, warmup_steps=5)
    HookOptimizer(_sgd(model), sgd)
    assert not isinstance(sgd._quantizer, RotatedQuantizer)  # SGD keeps plain chunks, as DataParallelSGD
    with pytest.warns(UserWarning, match="rotate=True"):
        HookOptimizer(
            torch.optim.AdamW(model.parameters()), QuantizedHookState(model, bits=1, warmup_steps=5, rotate=False)
        )
    rotated = QuantizedHookState(model, bits=1, warmup_steps=5, rotate=True)
    assert HookOptimizer(torch.optim.Adam(model.parameters()), rotated).quantized_momentum == 0.5


def test_quantized_momentum_argument():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="quantized_momentum"):
        HookOptimizer(_sgd(model), QuantizedHookState(model, bits=4), quantized_momentum=1.0)
    with pytest.raises(ValueError, match="quantized_momentum"):
        HookOptimizer(_sgd(model), QuantizedHookState(model, bits=4), quantized_momentum="max")
    assert HookOptimizer(_sgd(model), QuantizedHookState(model, bits=4)).quantized_momentum is None
    one_bit = QuantizedHookState(model, bits=1, warmup_steps=0)
    assert HookOptimizer(_sgd(model), one_bit).quantized_momentum == 0.5  # one process: not 2 ranks
    capped = HookOptimizer(_sgd(model), QuantizedHookState(model, bits=4), quantized_momentum=0.7)
    assert capped.quantized_momentum == 0.7


def test_is_an_optimizer_over_the_wrapped_ones_groups():
    model = nn.Linear(2, 2)
    inner = _sgd(model)
    wrapped = HookOptimizer(inner, QuantizedHookState(model, bits=4))
    assert isinstance(wrapped, torch.optim.Optimizer)
    assert wrapped.param_groups is inner.param_groups and wrapped.state is inner.state
    torch.optim.lr_scheduler.StepLR(wrapped, step_size=1)  # schedulers accept it
    assert "local_momentum" in wrapped.state_dict()
    with pytest.raises(CheckpointError):
        wrapped.load_state_dict({"local_momentum": {}})
    with pytest.raises(NotImplementedError):
        wrapped.add_param_group({"params": []})
