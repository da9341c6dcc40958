"""torch's join protocol: ``with Join([optimizer])`` on uneven data, alone and beside a DDP model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import bunsan


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(steps)]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _body_join_context(rank, world_size, bits):
    """Rank 1 has 2 batches fewer and leaves the loop inside ``Join([optimizer])``; no optimizer.join()."""
    model, reference = _net(), _net()
    reference.load_state_dict(model.state_dict())
    algorithm = bunsan.DataParallelSGD(bits=bits)
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm)
    data = _data(5, 8)
    mine = data if rank == 0 else data[:3]
    with Join([optimizer]):
        for x, y in mine:
            optimizer.zero_grad()
            half = slice(0, 4) if rank == 0 else slice(4, 8)
            F.cross_entropy(model(x[half]), y[half]).backward()
            optimizer.step()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i, (x, y) in enumerate(data):
        ref_opt.zero_grad()
        rows = slice(0, 8) if i < 3 else slice(0, 4)  # both halves (the mean of both ranks), then rank 0's alone
        F.cross_entropy(reference(x[rows]), y[rows]).backward()
        ref_opt.step()
    return (_flat(model) - _flat(reference)).abs().max().item(), optimizer.algorithm.step, _flat(model).tolist()


@pytest.mark.parametrize("bits", [32, 8])
def test_join_context_on_uneven_data_averages_active_ranks_and_equalizes(workers, bits):
    (diff0, steps0, params0), (diff1, steps1, params1) = workers.run(f"{__name__}:_body_join_context", bits=bits)
    assert (steps0, steps1) == (5, 3)
    assert params0 == params1  # rank 1 ends with the model of rank 0, which trained longest
    if bits == 32:  # exact: the same steps as one process on the active ranks' data
        assert diff0 <= 1e-5 and diff1 <= 1e-5


def _body_beside_ddp(rank, world_size):
    """One loop trains a DDP model and a bunsan model; ``Join([ddp, optimizer])`` shadows both."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_net())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    model = _net()
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = _data(5 if rank == 0 else 3, 4)
    with Join([ddp, optimizer]):
        for x, y in data:
            ddp_opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            ddp_opt.step()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return _flat(ddp.module).tolist(), _flat(model).tolist(), optimizer.algorithm.step


def test_join_context_composes_with_a_ddp_model(workers):
    (ddp0, ours0, steps0), (ddp1, ours1, steps1) = workers.run(f"{__name__}:_body_beside_ddp")
    assert (steps0, steps1) == (5, 3)
    assert ours0 == ours1  # bunsan's post-hook equalized the replicas
    assert ddp0 == ddp1  # and DDP's its own: both joinables shadowed each other's collectives in one context


def _body_block_algorithm_refuses_join_context(rank, world_size):
    model = _net()
    algorithm = bunsan.BlockMomentumSGD(block_size=8)
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm)
    with pytest.raises(TypeError, match=r"optimizer\.join"):
        Join([optimizer])
    optimizer.join()  # the spelling that serves block algorithms


def test_block_algorithm_says_to_call_join_instead(workers):
    workers.run(f"{__name__}:_body_block_algorithm_refuses_join_context")
