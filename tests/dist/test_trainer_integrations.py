"""quantized_hook under the real Accelerate and Lightning (2 gloo ranks; skipped without the packages).

The workers already share a process group; torch's launcher variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT) tell both frameworks that the processes exist, so neither starts
its own. The pool of this module is its own, so the variables stay in its workers.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bunsan
from bunsan.algorithms import DataParallelSGD, QuantizedHookState, quantized_hook

STEPS = 6
BUCKET_MB = 0.0002


def _launcher_environment(rank: int, world_size: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29555",  # never dialled: the process group exists already
    )


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 37), nn.Tanh(), nn.Linear(37, 3))


def _data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(16 * world_size, 20, generator=g), torch.randn(16 * world_size, 3, generator=g)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _reference(rank: int, world_size: int, bits: int, steps: int = STEPS) -> torch.Tensor:
    """bunsan.distribute with the same arithmetic: DataParallelSGD(bits, local_momentum=False), plain SGD."""
    model = _mlp()
    algorithm = DataParallelSGD(bits=bits, local_momentum=False, bucket_size_mb=BUCKET_MB)
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm)
    x, y = _data(world_size)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
    return _flat(model)


def _body_accelerate(rank, world_size, bits):
    from accelerate import Accelerator

    _launcher_environment(rank, world_size)
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world_size
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, DDP)
    model.register_comm_hook(state := QuantizedHookState(model, bits=bits, warmup_steps=0), quantized_hook)
    x, y = _data(world_size)
    for step in range(STEPS):
        if step == STEPS // 2:  # a checkpoint mid-training: the hook's state goes with it
            saved = _deep_clone({"model": model.module.state_dict(), "hook": state.state_dict()})
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(model(x[rank::world_size]), y[rank::world_size]))
        optimizer.step()
    assert state.quantized_steps == STEPS
    straight = _flat(model)
    # resume from the checkpoint in a fresh prepared model
    resumed = _mlp()
    resumed.load_state_dict(saved["model"])
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1)
    resumed, optimizer = accelerator.prepare(resumed, optimizer)
    fresh = QuantizedHookState(resumed, bits=bits, warmup_steps=0)
    fresh.load_state_dict(saved["hook"])
    assert fresh.step == STEPS // 2
    resumed.register_comm_hook(fresh, quantized_hook)
    for _ in range(STEPS - STEPS // 2):
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(resumed(x[rank::world_size]), y[rank::world_size]))
        optimizer.step()
    return torch.equal(straight, _flat(resumed)), straight.tolist(), _reference(rank, world_size, bits).tolist()


def _deep_clone(value):
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _deep_clone(v) for k, v in value.items()}
    return value


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate (the accelerate extra)")
def test_accelerate_trains_resumes_and_equals_distribute(workers):
    results = workers.run(f"{__name__}:_body_accelerate", bits=1)
    for resumed_equal, hooked, reference in results:
        assert resumed_equal
        torch.testing.assert_close(torch.tensor(hooked), torch.tensor(reference), rtol=0, atol=1e-6)
    assert results[0][1] == results[1][1]


def _lightning_module():
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, _):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module()


def _lightning_fit(rank, world_size, steps, ckpt_path=None, **hook):
    """Fit the MLP for ``steps`` steps with the shipped strategy; returns (module, strategy, trainer)."""
    import lightning.pytorch as pl

    from bunsan.integrations.lightning import QuantizedDDPStrategy

    x, y = _data(world_size)
    # this rank's half, as the reference takes it (Lightning's own sampler would shuffle): one batch per epoch
    shard = torch.utils.data.TensorDataset(x[rank::world_size], y[rank::world_size])
    loader = torch.utils.data.DataLoader(shard, batch_size=16)
    strategy = QuantizedDDPStrategy(**hook, bucket_cap_mb=BUCKET_MB)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = _lightning_module()
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, strategy, trainer


def _body_lightning(rank, world_size, bits):
    _launcher_environment(rank, world_size)
    module, strategy, _ = _lightning_fit(rank, world_size, STEPS, bits=bits, warmup_steps=0)
    assert strategy.hook_state.quantized_steps == STEPS
    return _flat(module.net).tolist(), _reference(rank, world_size, bits).tolist()


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning (the lightning extra)")
def test_lightning_strategy_registers_the_hook_and_equals_distribute(workers):
    results = workers.run(f"{__name__}:_body_lightning", bits=1)
    for hooked, reference in results:
        torch.testing.assert_close(torch.tensor(hooked), torch.tensor(reference), rtol=0, atol=1e-6)
    assert results[0][0] == results[1][0]


def _body_lightning_resume(rank, world_size, folder, first, then):
    _launcher_environment(rank, world_size)
    hook = {"bits": 1, "warmup_steps": 1}
    straight, _, _ = _lightning_fit(rank, world_size, first + then, **hook)
    _, strategy, trainer = _lightning_fit(rank, world_size, first, **hook)
    path = os.path.join(folder, "hook.ckpt")
    trainer.save_checkpoint(path)  # every rank: the hook states are gathered, rank 0 writes
    residual = torch.cat([r.reshape(-1) for r in strategy.hook_state.residuals()["residual"].values()])
    resumed, strategy, _ = _lightning_fit(rank, world_size, first + then, ckpt_path=path, **hook)
    assert strategy.hook_state.step == first + then and strategy.hook_state.quantized_steps == first + then - 1
    return torch.equal(_flat(straight.net), _flat(resumed.net)), residual.tolist()


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning (the lightning extra)")
def test_lightning_checkpoint_resumes_every_ranks_residuals_bit_for_bit(workers, tmp_path):
    results = workers.run(f"{__name__}:_body_lightning_resume", folder=str(tmp_path), first=4, then=3)
    (equal0, residual0), (equal1, residual1) = results
    assert equal0 and equal1
    residual0, residual1 = torch.tensor(residual0), torch.tensor(residual1)
    assert residual0.abs().sum() > 0 and residual1.abs().sum() > 0
    assert not torch.equal(residual0, residual1)  # per rank: a rank-0-only checkpoint would lose rank 1's


@pytest.mark.timeout(90)
def test_lightning_ddp_strategy_takes_the_averager(workers):
    # bunsan.algorithms.ModelAverager in Lightning (body in tests/dist/test_averagers.py): here, where the pool
    # has imported lightning already.
    results = workers.run("tests.dist.test_averagers:_body_lightning")
    for r in results:
        assert r["steps"] == 9 and r["rounds"] == 3  # 2 warm-up steps, blocks of 3, the last one partial
        assert r["diff"] <= 1e-6, r["diff"]


def _fabric_train(rank, world_size, steps, *, save=None, load=None, **hook):
    """Train the MLP ``steps`` steps under Fabric with the shipped strategy; returns (module, strategy)."""
    from lightning.fabric import Fabric

    from bunsan.integrations.fabric import QuantizedFabricStrategy

    strategy = QuantizedFabricStrategy(**hook, bucket_cap_mb=BUCKET_MB)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    module = _mlp()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    if load is not None:
        fabric.load(load, {"model": model, "optimizer": optimizer})
    x, y = _data(world_size)
    for _ in range(steps):
        optimizer.zero_grad()
        fabric.backward(F.mse_loss(model(x[rank::world_size]), y[rank::world_size]))
        optimizer.step()
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": optimizer})  # every rank: the hook states are gathered
    return module, strategy


def _body_fabric(rank, world_size, folder, first, then):
    _launcher_environment(rank, world_size)
    hook = {"bits": 1, "warmup_steps": 0}
    straight, strategy = _fabric_train(rank, world_size, first + then, **hook)
    assert strategy.hook_state.quantized_steps == first + then
    path = os.path.join(folder, "fabric.ckpt")
    _, strategy = _fabric_train(rank, world_size, first, save=path, **hook)
    residual = torch.cat([r.reshape(-1) for r in strategy.hook_state.residuals()["residual"].values()])
    resumed, strategy = _fabric_train(rank, world_size, then, load=path, **hook)
    assert strategy.hook_state.step == first + then
    reference = _reference(rank, world_size, 1, steps=first + then)
    return torch.equal(_flat(straight), _flat(resumed)), residual.tolist(), _flat(straight).tolist(), reference.tolist()


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning (the lightning extra)")
def test_fabric_strategy_trains_resumes_every_ranks_residuals_and_equals_distribute(workers, tmp_path):
    results = workers.run(f"{__name__}:_body_fabric", folder=str(tmp_path), first=4, then=3)
    for equal, _, hooked, reference in results:
        assert equal  # save after 4 steps, load into a fresh Fabric, 3 more: the 7-step run bit for bit
        torch.testing.assert_close(torch.tensor(hooked), torch.tensor(reference), rtol=0, atol=1e-6)
    residual0, residual1 = torch.tensor(results[0][1]), torch.tensor(results[1][1])
    assert residual0.abs().sum() > 0 and residual1.abs().sum() > 0
    assert not torch.equal(residual0, residual1)  # per rank: a rank-0-only checkpoint would lose rank 1's
