"""bunsan.parallel.pipeline on gloo ranks: the stages' gradients equal the single-process ones.

Rank r runs stage r of a small MLP; the twin is the whole MLP in the same worker
with the same weights (every rank builds all stages from the same seed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bunsan.parallel import pipeline


def _stages(world_size: int) -> list[nn.Module]:
    """One Linear(+ReLU) per stage: 4 -> 6 -> ... -> 3."""
    widths = [4] + [6] * (world_size - 1) + [3]
    stages: list[nn.Module] = []
    for i in range(world_size):
        layers: list[nn.Module] = [nn.Linear(widths[i], widths[i + 1])]
        if i < world_size - 1:
            layers.append(nn.ReLU())
        stages.append(nn.Sequential(*layers))
    return stages


def _body_pipeline_equals_full_batch(
    rank: int, world_size: int, schedule: str, microbatches: int, steps: int
) -> float | None:
    stages = _stages(world_size)
    twin = nn.Sequential(*[nn.Sequential(*s) for s in _stages(world_size)])
    twin.load_state_dict(nn.Sequential(*stages).state_dict())
    pipe = pipeline(stages, microbatches=microbatches, schedule=schedule)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    loss = None
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        loss = pipe.step(x, y, F.cross_entropy)  # every rank passes both; each reads what it needs
        twin_opt.zero_grad()
        twin_loss = F.cross_entropy(twin(x), y)
        twin_loss.backward()
        if rank == world_size - 1:
            torch.testing.assert_close(loss, twin_loss.detach(), rtol=0, atol=1e-6)
        else:
            assert loss is None
        for p, q in zip(stages[rank].parameters(), twin[rank].parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5)
        opt.step()
        twin_opt.step()
    for p, q in zip(stages[rank].parameters(), twin[rank].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    return None if loss is None else loss.item()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_equal_single_process(workers, schedule):
    losses = workers.run(f"{__name__}:_body_pipeline_equals_full_batch", schedule=schedule, microbatches=4, steps=2)
    assert losses[0] is None and losses[1] is not None


def _body_gradients_accumulate(rank: int, world_size: int) -> None:
    """Two steps without zero_grad add up, as two backward passes would (no rescaling of old gradients)."""
    stages = _stages(world_size)
    twin = nn.Sequential(*[nn.Sequential(*s) for s in _stages(world_size)])
    twin.load_state_dict(nn.Sequential(*stages).state_dict())
    pipe = pipeline(stages, microbatches=2, schedule="gpipe", loss_fn=F.mse_loss)
    for _ in range(2):
        x, y = torch.randn(4, 4), torch.randn(4, 3)
        pipe.step(x, y)
        F.mse_loss(twin(x), y).backward()
    for p, q in zip(stages[rank].parameters(), twin[rank].parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5)


def test_gradients_accumulate_across_steps(workers):
    workers.run(f"{__name__}:_body_gradients_accumulate")


def _body_wrong_stage_count(rank: int, world_size: int) -> str:
    try:
        pipeline(_stages(world_size + 1), microbatches=2)
    except ValueError as e:
        return str(e)
    return "no error"


def test_stage_count_must_match_group(workers):
    for message in workers.run(f"{__name__}:_body_wrong_stage_count"):
        assert "stages has 3 modules but the group has 2 ranks" in message
