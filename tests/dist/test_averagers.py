"""ModelAverager, BlockMomentumAverager and AveragingOptimizer with plain DDP on 2 gloo ranks.

The DDP runs use what a user of torch's post-local SGD writes on CPU: DDP with torch's
``post_localSGD_hook`` (gradients all-reduced for ``warmup`` steps, then none:
``post_local_gradient_allreduce=False``, since the default subgroup needs CUDA), and the
averager after every optimizer step. Steps map to bunsan's samples as ``block_size =
period * batch`` (per worker) and ``warm_start = warmup * batch * world_size`` (all workers).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector

import bunsan
from bunsan.algorithms import (
    AveragingOptimizer,
    BlockMomentumAverager,
    BlockMomentumSGD,
    ModelAverager,
    ModelAveragingSGD,
)

BATCH, LR = 4, 0.1
BMUF = {"block_momentum": 0.7, "block_learning_rate": 0.8, "nesterov": True}


def _data(rank: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 2, generator=g)) for _ in range(n_batches)]


def _flat(model: nn.Module) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach().clone()


def _averager(kind: str, period: int, warmup: int) -> ModelAverager:
    if kind == "ma":
        return ModelAverager(period, warmup_steps=warmup)
    return BlockMomentumAverager(period, warmup_steps=warmup, **BMUF)


def _ddp(warmup: int) -> tuple[DDP, PostLocalSGDState]:
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))
    state = PostLocalSGDState(
        process_group=None, subgroup=None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False
    )
    model.register_comm_hook(state, post_localSGD_hook)
    return model, state


def _train(model: nn.Module, optimizer, batches, after_step=None) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if after_step is not None:
            after_step()


def _body_equivalence(rank, world_size, kind, period, warmup, n_batches, momentum):
    """DDP + the averager against bunsan.distribute with the matching algorithm, same data."""
    data = _data(rank, n_batches[rank])
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    options = {"block_size": period * BATCH, "warm_start": warmup * BATCH * world_size}
    algorithm = ModelAveragingSGD(**options) if kind == "ma" else BlockMomentumSGD(**options, **BMUF)
    model, optimizer = bunsan.distribute(
        model, torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum), algorithm
    )
    _train(model, optimizer, data)
    optimizer.join()
    reference = _flat(model)

    ddp, _ = _ddp(warmup)
    averager = _averager(kind, period, warmup)
    wrapped = AveragingOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR, momentum=momentum), averager)
    _train(ddp, wrapped, data)
    wrapped.join()
    final = _flat(ddp)
    return {"diff": (final - reference).abs().max().item(), "params": final.tolist(), "steps": averager.step}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kind", "period", "warmup", "n_batches", "momentum"),
    [
        ("ma", 3, 0, [7, 7], 0.5),  # two full blocks and a partial one that join() averages
        ("ma", 2, 2, [9, 4], 0.0),  # warm-up, then uneven data: rank 1 joins early
        ("bm", 3, 0, [7, 7], 0.9),  # BMUF, local momentum reset, a partial last block
        ("bm", 2, 2, [9, 4], 0.9),  # BMUF after a warm-up, uneven data
    ],
    ids=["ma", "ma-warmup-uneven", "bmuf", "bmuf-warmup-uneven"],
)
def test_equals_bunsan_distribute(workers, kind, period, warmup, n_batches, momentum):
    results = workers.run(
        f"{__name__}:_body_equivalence", kind=kind, period=period, warmup=warmup, n_batches=n_batches, momentum=momentum
    )
    assert results[0]["params"] == results[1]["params"]  # join() leaves equal replicas
    for r, n in zip(results, n_batches):
        assert r["diff"] == 0.0, r["diff"]  # bit for bit
        assert r["steps"] == n


def _body_torch(rank, world_size, period, warmup, n_batches):
    """Bare averagers after every step: ours against torch's PeriodicModelAverager at the same steps."""
    data = _data(rank, n_batches)
    finals = []
    for make in (
        lambda: ModelAverager(period, warmup_steps=warmup),
        lambda: PeriodicModelAverager(period, warmup_steps=warmup + period - 1),
    ):
        ddp, _ = _ddp(warmup)
        averager = make()
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.5)
        _train(ddp, optimizer, data, after_step=lambda a=averager, o=optimizer: a.average_parameters(o.param_groups))
        finals.append(_flat(ddp))
    return (finals[0] - finals[1]).abs().max().item()


@pytest.mark.timeout(60)
def test_matches_torch_periodic_model_averager(workers):
    # 2 warm-up steps, then 3 blocks of 3: the last step ends a block, so no join() is needed
    # torch averages the parameters, bunsan their change since the block's start: rounding apart
    assert max(workers.run(f"{__name__}:_body_torch", period=3, warmup=2, n_batches=11)) <= 1e-6


def _body_resume(rank, world_size, save_after, n_batches=11, warmup=2, period=3):
    """BMUF: a run saved after ``save_after`` steps (mid-block) and resumed equals an uninterrupted one."""
    data = _data(rank, n_batches)

    def build():
        ddp, state = _ddp(warmup)
        averager = BlockMomentumAverager(period, warmup_steps=warmup, **BMUF)
        return ddp, state, AveragingOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9), averager)

    ddp, _, optimizer = build()
    _train(ddp, optimizer, data)
    optimizer.join()
    uninterrupted = _flat(ddp)

    ddp, _, optimizer = build()
    _train(ddp, optimizer, data[:save_after])
    buffer = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    del ddp, optimizer
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    ddp, state, optimizer = build()  # DDP broadcasts rank 0's model: load each rank's own after wrapping
    ddp.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    state.iter = optimizer.averager.step  # the hook's step count: no all-reduce again after the warm-up
    _train(ddp, optimizer, data[save_after:])
    optimizer.join()
    return torch.equal(_flat(ddp), uninterrupted), sorted(saved["optimizer"]["averager"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("save_after", [1, 6])  # during the warm-up; mid-block after two blocks
def test_state_dict_round_trip_resumes_bit_for_bit(workers, save_after):
    results = workers.run(f"{__name__}:_body_resume", save_after=save_after)
    assert all(equal for equal, _ in results)
    if save_after > 2:
        assert {"global_model", "block_momentum_buffer", "block_start"} <= set(results[0][1])


def _body_scaler(rank, world_size, inf_steps, n_batches=8, warmup=2, period=2):
    """GradScaler: an inf on rank 1 only skips the step and its count on every rank."""
    data = _data(rank, n_batches)
    ddp, _ = _ddp(warmup)
    averager = ModelAverager(period, warmup_steps=warmup)
    optimizer = AveragingOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR), averager)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scales, unchanged = [], []
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        if rank == 1 and i in inf_steps:
            loss = loss * float("inf")
        before = _flat(ddp)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        if i in inf_steps:
            unchanged.append(torch.equal(before, _flat(ddp)))
    optimizer.join()
    return {
        "step": averager.step,
        "skipped": optimizer.skipped_steps,
        "scales": scales,
        "unchanged": unchanged,
        "params": _flat(ddp).tolist(),
    }


@pytest.mark.timeout(60)
def test_grad_scaler_skip_does_not_count_on_any_rank(workers):
    inf_steps = [1, 4]  # one during the warm-up (DDP all-reduces the inf), one in the local phase
    results = workers.run(f"{__name__}:_body_scaler", inf_steps=inf_steps)
    for r in results:
        assert r["skipped"] == 2 and r["step"] == 8 - 2
        assert r["unchanged"] == [True, True]
    assert results[0]["params"] == results[1]["params"]
    # during the warm-up DDP's all-reduce gives every rank the inf: both scalers back off at step 1;
    # in the local phase only rank 1's scaler saw it, yet the wrapper skipped the step on both
    assert results[0]["scales"][1] == results[1]["scales"][1] == 2.0**7
    assert results[0]["scales"][4] == 2.0**7 and results[1]["scales"][4] == 2.0**6


def _body_lightning(rank, world_size, n_batches=9, warmup=2, period=3):
    """Lightning's DDPStrategy calls ``_model_averager.average_parameters(iter(params))``: ours there."""
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    class _Pool(ClusterEnvironment):  # the pool's ranks: Lightning starts no processes
        creates_processes_externally = True
        main_address, main_port = "127.0.0.1", 0
        detect = staticmethod(lambda: True)
        world_size, global_rank = staticmethod(lambda: world_size), staticmethod(lambda: rank)
        local_rank, node_rank = staticmethod(lambda: rank), staticmethod(lambda: 0)

        def set_world_size(self, size: int) -> None: ...

        def set_global_rank(self, rank: int) -> None: ...

    class _AveragingDDP(DDPStrategy):
        def configure_ddp(self) -> None:
            super().configure_ddp()  # Lightning registers DDP comm hooks only on CUDA: this one by hand
            state = PostLocalSGDState(None, None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False)
            self.model.register_comm_hook(state, post_localSGD_hook)
            self._model_averager = averager

    class _Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(4, 2)

        def training_step(self, batch, _):
            return F.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.5)

    data = _data(rank, n_batches)
    averager = BlockMomentumAverager(period, warmup_steps=warmup, **BMUF)
    module = _Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=_AveragingDDP(cluster_environment=_Pool()), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    averager.join(module.parameters())

    ddp, _ = _ddp(warmup)  # the same training as a plain loop
    plain = BlockMomentumAverager(period, warmup_steps=warmup, **BMUF)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.5)
    _train(ddp, optimizer, data, after_step=lambda: plain.average_parameters(optimizer.param_groups))
    plain.join()
    lightning, reference = _flat(module), _flat(ddp)
    return {"steps": averager.step, "rounds": averager.rounds, "diff": (lightning - reference).abs().max().item()}
