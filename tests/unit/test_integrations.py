"""The trainer integrations' single-process parts: arguments refused early, each rank's entry of a checkpoint."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from bunsan.integrations._hook_checkpoint import check_arguments, own_state, rank_state


def _entry(rank: int, world_size: int) -> dict:
    return {
        "bits": 1,
        "world_size": world_size,
        "step": 7,
        "quantized_steps": 5,
        "skipped_steps": 0,
        "scale": None,
        "residuals": {"residual": {"w": torch.full((2,), float(rank))}, "owner_residual": {}},
    }


def test_each_rank_takes_its_own_entry():
    saved = {"world_size": 2, "ranks": [_entry(0, 2), _entry(1, 2)]}
    for rank in (0, 1):
        mine = own_state(saved, rank, 2, "ckpt")
        assert torch.equal(mine["residuals"]["residual"]["w"], torch.full((2,), float(rank)))


@pytest.mark.parametrize("saved_size, world_size", [(2, 4), (4, 2)])
def test_another_world_size_resets_the_residuals_keeps_the_steps_and_warns(saved_size, world_size):
    saved = {"world_size": saved_size, "ranks": [_entry(r, saved_size) for r in range(saved_size)]}
    with pytest.warns(UserWarning, match=f"saved by a job of {saved_size} ranks and this job has {world_size}"):
        mine = own_state(saved, 1, world_size, "ckpt")
    assert mine["step"] == 7 and mine["world_size"] == world_size
    assert mine["residuals"] == {"residual": {}, "owner_residual": {}}
    assert rank_state(_entry(0, world_size), world_size, "ckpt")["residuals"]["residual"]  # same size: kept


def test_a_checkpoint_without_bunsans_form_is_refused():
    with pytest.raises(ValueError, match="holds no hook state of bunsan's form"):
        own_state({"ranks": []}, 0, 2, "ckpt")


def test_arguments_are_checked_by_quantized_hook_state():
    assert check_arguments("X", {"bits": 4}) == {"bits": 4}
    with pytest.raises(ValueError, match="bits must be 32"):
        check_arguments("X", {"bits": 40})
    with pytest.raises(ValueError, match="needs total_steps="):
        check_arguments("X", {"bits": 1})
    with pytest.raises(TypeError, match="X sets 'module' itself"):
        check_arguments("X", {"bits": 4, "module": torch.nn.Linear(1, 1)})


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning (the lightning extra)")
def test_lightning_strategy_refuses_bad_arguments_when_made():
    from bunsan.integrations.lightning import QuantizedDDPStrategy

    with pytest.raises(ValueError, match="needs total_steps="):
        QuantizedDDPStrategy(bits=1)
    with pytest.raises(ValueError, match="do not pass ddp_comm_hook as well"):
        QuantizedDDPStrategy(bits=4, ddp_comm_hook=lambda state, bucket: None)
    strategy = QuantizedDDPStrategy(bits=8, chunk_size=256, bucket_cap_mb=1)
    assert strategy.hook_arguments == {"bits": 8, "total_steps": None, "warmup_steps": None, "chunk_size": 256}
    assert strategy.hook_state is None
