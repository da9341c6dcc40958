"""One run of ``bunsan bench peers``: plain ``DistributedDataParallel`` with one communication setting.

Run by every worker of a job, under ``bunsan run`` or the shaped-network launcher::

    bunsan run -np 4 python -m bunsan.bench.peers_job --spec '{"model": "mnist1d_cnn", "dataset": "mnist1d",
        "setting": "powersgd:rank=2", "epochs": 2, "batch": 128, "lr": 0.05, "seed": 0, "out": "r.json"}'

The same for every setting (:mod:`bunsan.bench.peers_spec`): the model (:func:`bunsan.bench.job.build_model`,
seeded), the data of :mod:`bunsan.datasets`, partitioned as ``DistributedSampler(drop_last=True)`` does and
reshuffled per epoch from the seed, a GLOBAL minibatch split evenly over the workers, ``torch.optim.SGD`` with
momentum, DDP with its default buckets (PowerSGD: one bucket, see there) and a communication hook for every
setting, exact included (torch's ``allreduce_hook``, the arithmetic of DDP's built-in all-reduce).

Measured (rank 0 writes the JSON record):

* ``epoch_end_s``: training seconds at the end of each epoch, from a barrier after the set-up to a barrier
  ending the epoch, without the evaluation copies; ``wall_s`` ends after the averagers' ``join()``.
* ``test_error_curve``: at each epoch's end, the test error of the model the job would end with if it
  stopped there: for the exchanges that keep the replicas equal rank 0's, for post-local SGD and the
  averagers the average of the replicas (a collective, off the clock and uncounted), evaluated after the
  clock stopped, the ranks sharing the evaluations. ``test_error``: the final model, the same way (after
  ``join()``).
* ``bytes_sent_per_step``: what each rank sent per optimizer step, averaged over the ranks. Counted, not
  computed: every ``torch.distributed.all_reduce`` a hook or averager of torch makes passes through a
  counter while training runs, which counts an all-reduce of ``M`` bytes over ``N`` ranks as ``2 (N-1)/N M``
  (bunsan's count, :mod:`bunsan.comm.collectives`); bunsan's hook and averagers count their own
  (``stats()``). DDP's broadcast of buffers (batch-norm statistics) before each forward is not counted.
* ``step_ms_median``: rank 0's median step (forward, backward with its exchange, optimizer step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

_STARTED = time.perf_counter()  # before `import torch`: start-up counts from here

import torch  # noqa: E402 - imported after the start-up clock on purpose
import torch.nn.functional as F  # noqa: E402 - after the start-up clock
from torch import nn  # noqa: E402 - after the start-up clock
from torch.nn.parallel import DistributedDataParallel  # noqa: E402 - after the start-up clock
from torch.utils.data.distributed import DistributedSampler  # noqa: E402 - after the start-up clock

import bunsan  # noqa: E402 - after the start-up clock
from bunsan import comm, datasets  # noqa: E402 - after the start-up clock
from bunsan.bench.job import _digest, _warm_up, build_model, evaluate, with_recomputed_bn  # noqa: E402
from bunsan.bench.peers_spec import PeerSetting, parse_setting, powersgd_start  # noqa: E402
from bunsan.bench.specs import per_worker_batch  # noqa: E402

__all__ = ["ByteCounter", "main", "train"]

ONE_BUCKET_MB = 1024  # PowerSGD's bucket cap: the whole model in one bucket (bunsan.bench.peers_spec)
DEFAULTS = {"momentum": 0.9, "recompute_bn": False, "out": None}


class ByteCounter:
    """Bytes this rank hands to ``torch.distributed.all_reduce`` while :attr:`counting` (module docstring).

    Hooks run collectives from future callbacks on other threads: the count takes a lock.
    """

    def __init__(self) -> None:
        self.sent = 0.0
        self.calls = 0
        self.counting = False
        self._lock = threading.Lock()
        self._original: Callable[..., Any] | None = None

    def install(self) -> None:
        original = self._original = torch.distributed.all_reduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.counting:
                group = kwargs.get("group", args[1] if len(args) > 1 else None)
                n = comm.get_world_size(group)
                with self._lock:
                    self.sent += 2 * (n - 1) / n * tensor.numel() * tensor.element_size()
                    self.calls += 1
            return original(tensor, *args, **kwargs)

        torch.distributed.all_reduce = counted

    def uninstall(self) -> None:
        if self._original is not None:
            torch.distributed.all_reduce = self._original
            self._original = None


class Exchange(NamedTuple):
    """A setting put in place: the optimizer to step, its own byte count, what ends training."""

    optimizer: Any
    own_bytes: Callable[[], float]
    finish: Callable[[], None]
    details: dict[str, Any]


def _nothing() -> None:
    return None


def _zero() -> float:
    return 0.0


def _warmup_then_local(warmup: int) -> Callable[[Any, Any], torch.futures.Future[torch.Tensor]]:
    """A DDP hook: torch's ``allreduce_hook`` for the first ``warmup`` steps, then the local gradient (no exchange)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    steps = [0]

    def hook(state, bucket):  # unannotated: DDP refuses a hook whose annotations are strings
        exact = steps[0] < warmup
        if bucket.is_last():
            steps[0] += 1
        if exact:
            return default_hooks.allreduce_hook(state, bucket)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    return hook


def _bunsan_averaging(setting: PeerSetting, ddp: Any, local: torch.optim.Optimizer) -> Exchange:
    # bunsan's collectives bypass torch.distributed.all_reduce (ByteCounter): the averager counts its own bytes.
    from bunsan.algorithms import AveragingOptimizer, BlockMomentumAverager, ModelAverager

    options = setting.options
    warmup = int(options.get("warmup", 0))
    if setting.kind == "bunsan-ma":
        averager: ModelAverager = ModelAverager(options["period"], warmup_steps=warmup)
    else:
        averager = BlockMomentumAverager(
            options["period"],
            block_momentum=options.get("block_momentum"),
            block_learning_rate=options.get("block_lr"),
            nesterov=options.get("nesterov", True),
            warmup_steps=warmup,
        )
    ddp.register_comm_hook(None, _warmup_then_local(warmup))
    return Exchange(AveragingOptimizer(local, averager), lambda: float(averager.traffic.sent), averager.join, {})


def _exchange(setting: PeerSetting, ddp: Any, local: torch.optim.Optimizer, total_steps: int) -> Exchange:
    """Register the setting's hook on ``ddp`` and build its optimizer (module docstring of peers_spec)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

    options = setting.options
    if setting.kind in ("exact", "fp16"):
        hook = default_hooks.allreduce_hook if setting.kind == "exact" else default_hooks.fp16_compress_hook
        ddp.register_comm_hook(None, hook)
        return Exchange(local, _zero, _nothing, {})
    if setting.kind == "powersgd":
        start = powersgd_start(setting, total_steps)
        powersgd = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=options["rank"], start_powerSGD_iter=start
        )
        batched = bool(options.get("batched"))
        ddp.register_comm_hook(
            powersgd, powerSGD_hook.batched_powerSGD_hook if batched else powerSGD_hook.powerSGD_hook
        )
        return Exchange(local, _zero, _nothing, {"start_powerSGD_iter": start})
    if setting.kind == "postlocal":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        warmup = int(options.get("warmup", 0))
        state = post_localSGD_hook.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False
        )
        ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        averager = PeriodicModelAverager(period=options["period"], warmup_steps=warmup)
        return Exchange(PostLocalSGDOptimizer(optim=local, averager=averager), _zero, _nothing, {})
    if setting.kind == "bunsan":
        from bunsan.algorithms import HookOptimizer, QuantizedHookState, quantized_hook

        quantized = QuantizedHookState(
            ddp, bits=options["bits"], warmup_steps=options.get("warmup"), total_steps=total_steps
        )
        ddp.register_comm_hook(quantized, quantized_hook)
        paired = options["bits"] != 32 and not options.get("plain")  # the local momentum of DataParallelSGD
        return Exchange(
            HookOptimizer(local, quantized) if paired else local,
            lambda: float(quantized.traffic.sent),
            _nothing,
            {"warmup_steps": quantized.warmup_steps, "hook_optimizer": paired},
        )
    return _bunsan_averaging(setting, ddp, local)


@torch.no_grad()
def replica_average(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective. A copy of ``model``'s state with every floating-point tensor averaged over the ranks."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    floats = [v for v in state.values() if v.is_floating_point()]
    flat = torch.cat([v.reshape(-1) for v in floats])
    comm.all_reduce(flat)
    flat /= comm.get_world_size()
    offset = 0
    for v in floats:
        v.copy_(flat[offset : offset + v.numel()].view_as(v))
        offset += v.numel()
    return state


def _buckets(ddp: DistributedDataParallel) -> int | None:
    """DDP's bucket count after its rebuild, from its logging data (torch's private accessor); None without it."""
    logging_data = getattr(ddp, "_get_ddp_logging_data", None)
    return None if logging_data is None else logging_data().get("num_buckets_reduced")


def _evaluator(epoch: int) -> int:
    """The rank that evaluates epoch ``epoch``'s snapshot after training: the ranks share the evaluations
    (rank 0 also evaluates the final model), so a job's tail costs about one evaluation per rank."""
    return (epoch + 1) % comm.get_world_size()


def _from_rank_0(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as rank 0 holds it, on every rank (off the clock): a snapshot is rank 0's model even where
    an exchange left the replicas different."""
    comm.broadcast_tensors(list(state.values()), src=0)
    return state


def _stopped_model(model: nn.Module, setting: PeerSetting) -> dict[str, torch.Tensor]:
    """Collective for the averaging settings: the model the job would end with now (module docstring)."""
    if setting.averages_models:
        return replica_average(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Run(NamedTuple):
    """What the training loop needs, set up alike on every rank."""

    spec: dict[str, Any]
    setting: PeerSetting
    model: nn.Module
    ddp: DistributedDataParallel
    sampler: DistributedSampler
    local_batch: int
    steps_per_epoch: int
    train_set: Any
    test_set: Any


def _set_up(spec: dict[str, Any]) -> _Run:
    world_size, rank = comm.get_world_size(), comm.get_rank()
    setting = parse_setting(spec["setting"])
    local_batch = per_worker_batch(spec["batch"], world_size)
    train_set, test_set = datasets.load(spec["dataset"], "train"), datasets.load(spec["dataset"], "test")
    torch.manual_seed(spec["seed"])
    model = build_model(spec["model"], datasets.info(spec["dataset"]))
    x0, y0 = train_set[:local_batch]
    _warm_up(model, x0, y0)
    sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=spec["seed"], drop_last=True
    )
    steps_per_epoch = len(sampler) // local_batch
    if steps_per_epoch < 1:
        raise ValueError(f"{len(sampler)} samples per worker make no step of {local_batch}: lower --batch")
    bucket_cap = ONE_BUCKET_MB if setting.kind == "powersgd" else None
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap)
    return _Run(spec, setting, model, ddp, sampler, local_batch, steps_per_epoch, train_set, test_set)


def _train_loop(run: _Run, exchange: Exchange, counter: ByteCounter) -> dict[str, Any]:
    """The timed epochs: per-epoch times, losses, the step times, and the snapshots of the epochs this rank
    evaluates (:func:`_evaluator`); collective."""
    x_all, y_all = run.train_set.tensors
    optimizer, b = exchange.optimizer, run.local_batch
    step_s: list[float] = []
    epoch_end_s: list[float] = []
    epoch_loss: list[tuple[float, int]] = []
    snapshots: list[dict[str, torch.Tensor]] = []
    paused = 0.0
    comm.barrier()  # every rank is set up: the clock starts together
    start = time.perf_counter()
    counter.counting = True
    for epoch in range(run.spec["epochs"]):
        run.sampler.set_epoch(epoch)
        order = torch.tensor(list(run.sampler))
        loss_sum, samples = 0.0, 0
        for step in range(run.steps_per_epoch):
            began = time.perf_counter()
            index = order[step * b : (step + 1) * b]
            optimizer.zero_grad()
            loss = F.cross_entropy(run.ddp(x_all[index]), y_all[index])
            loss.backward()
            optimizer.step()
            step_s.append(time.perf_counter() - began)
            loss_sum += float(loss.detach()) * len(index)
            samples += len(index)
        epoch_loss.append((loss_sum, samples))
        comm.barrier()  # on the clock: the epoch ends when its slowest rank is done
        epoch_end_s.append(time.perf_counter() - start - paused)
        pause = time.perf_counter()
        counter.counting = False
        stopped = _from_rank_0(_stopped_model(run.model, run.setting))
        if _evaluator(epoch) == comm.get_rank():
            snapshots.append(stopped)
        counter.counting = True
        paused += time.perf_counter() - pause
    exchange.finish()
    comm.barrier()
    wall_s = time.perf_counter() - start - paused
    counter.counting = False
    return {
        "startup_s": start - _STARTED,
        "wall_s": wall_s,
        "epoch_end_s": epoch_end_s,
        "step_s": step_s,
        "epoch_loss": epoch_loss,
        "snapshots": snapshots,
    }


def train(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Run ``spec`` on this worker. Collective; returns the record on rank 0, ``None`` elsewhere."""
    spec = {**DEFAULTS, **spec}
    bunsan.init()
    run = _set_up(spec)
    local = torch.optim.SGD(run.ddp.parameters(), lr=spec["lr"], momentum=spec["momentum"])
    total_steps = run.steps_per_epoch * spec["epochs"]
    exchange = _exchange(run.setting, run.ddp, local, total_steps)
    counter = ByteCounter()
    counter.install()
    try:
        timed = _train_loop(run, exchange, counter)
    finally:
        counter.uninstall()
    digest = _digest(run.model)
    final = _stopped_model(run.model, run.setting)
    sent = counter.sent + exchange.own_bytes()

    def test(state: dict[str, torch.Tensor]) -> tuple[float, float]:
        run.model.load_state_dict(state)
        model = with_recomputed_bn(run.model, run.train_set, spec["batch"]) if spec["recompute_bn"] else run.model
        return evaluate(model, run.test_set)

    mine = {
        "sent": sent,
        "calls": counter.calls,
        "digest": digest,
        "epoch_loss": timed["epoch_loss"],
        "curve": [test(state)[0] for state in timed["snapshots"]],
    }
    final_test = test(final) if comm.get_rank() == 0 else None
    everyone = comm.all_gather_object(mine)
    if final_test is None:
        return None
    test_error, test_loss = final_test
    ranks: list[dict[str, Any]] = everyone
    curve = [ranks[_evaluator(e)]["curve"].pop(0) for e in range(spec["epochs"])]
    train_loss = [
        sum(r["epoch_loss"][e][0] for r in ranks) / max(sum(r["epoch_loss"][e][1] for r in ranks), 1)
        for e in range(spec["epochs"])
    ]
    return {
        "spec": spec,
        "setting": run.setting.label,
        "kind": run.setting.kind,
        "workers": comm.get_world_size(),
        "per_worker_batch": run.local_batch,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "startup_s": timed["startup_s"],
        "wall_s": timed["wall_s"],
        "epoch_end_s": timed["epoch_end_s"],
        "steps": total_steps,
        "steps_per_epoch": run.steps_per_epoch,
        "buckets": _buckets(run.ddp),
        "parameter_shapes": [list(p.shape) for p in run.model.parameters()],
        "step_ms_median": 1000 * statistics.median(timed["step_s"]),
        "step_ms_mean": 1000 * timed["wall_s"] / total_steps,
        "train_loss": train_loss,
        "test_error": test_error,
        "test_loss": test_loss,
        "test_error_curve": curve,
        "bytes_sent_per_step": sum(r["sent"] for r in ranks) / len(ranks) / total_steps,
        "bytes_sent_per_step_by_rank": [r["sent"] / total_steps for r in ranks],
        "counted_all_reduce_calls": [r["calls"] for r in ranks],
        "replicas_equal": len({r["digest"] for r in ranks}) == 1,
        **exchange.details,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bunsan.bench.peers_job", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", metavar="JSON", required=True, help="model, dataset, setting, epochs, batch, ...")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec)
    result = train(spec)
    if result is not None:
        text = json.dumps(result, indent=1)
        if spec.get("out") is None:
            print(text)
        else:
            Path(spec["out"]).parent.mkdir(parents=True, exist_ok=True)
            Path(spec["out"]).write_text(text)
    bunsan.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
