"""One training run of ``bunsan bench compare``, executed by every worker of a job.

It trains a named model on a named data set with one algorithm setting and
writes what the comparison table needs to a JSON file (rank 0)::

    bunsan run -np 4 python -m bunsan.bench.job --model mnist1d_cnn --dataset mnist1d \\
        --algorithm block_momentum:block_size=256 --epochs 30 --batch 128 --lr 0.05 --out result.json

or with everything in one JSON object, as the orchestrator calls it::

    python -m bunsan.bench.job --spec '{"model": "mnist1d_cnn", "dataset": "mnist1d", ...}'

What is fixed so that runs with different worker counts compare:

* ``--batch`` is the GLOBAL minibatch: each of N workers takes ``batch / N``
  samples per step (it must divide evenly), so every worker count takes the
  same number of optimizer steps per epoch with the same learning rate.
* The seed fixes the initial model (rank 0's, broadcast by ``distribute``)
  and the order of the data (reshuffled per epoch from it).

What is timed: ``wall_s`` runs from a barrier after the set-up (interpreter,
``import torch``, rendezvous, data, model, one throw-away warm-up step) to a
barrier after ``optimizer.join()``; ``startup_s`` is the set-up before it.

What is measured besides time:

* ``test_error``: the final model on the whole test set, evaluated by rank 0
  after ``join()`` (every replica is then equal; ``replicas_equal`` checks it).
* ``test_error_curve``: at the end of each epoch, the model the job would end
  with if it stopped there, saved as a copy by rank 0 and evaluated after the
  clock stopped. Where the replicas are equal after every step (exact and
  compressed data parallelism, a block algorithm's warm start) that is rank 0's
  replica. In the middle of a block the replicas differ and the model a user
  would take is the one the block algorithm's ``sync_replicas()`` (or ``join()``)
  makes of them: every rank synchronizes, rank 0 copies the result, and every
  rank then restores its model, the algorithm's state, the local optimizer's
  state and the traffic counters as they were, so training goes on exactly as
  without the curve (``tests/dist/test_block_momentum.py``); the time this
  takes is left out of ``epoch_end_s`` and ``wall_s`` (per epoch: ``paused_s``).
  The wait for the slowest rank before it is not: a barrier ends every rank's
  epoch first, on the clock, as the next exchange would have made the faster
  ranks wait for the slower ones without the copy. Until 2026-11-27 that wait fell
  inside the copy's collective and was left out too, which made a block
  algorithm's epochs look faster than they trained where the ranks run at
  different speeds (up to 0.6 s of a 3.4 s epoch for ResNet-20 at 2 workers on
  2 cores; an exact step's wait is in its exchange). Until ae02132 this was
  rank 0's own replica mid-block, which for model averaging is often worse than
  the average it ends with (a time-to-accuracy target then looked reached later
  than it was). AsyncSGD's curve is still rank 0's replica.
* ``train_loss``: per epoch, the mean training loss over the samples of all
  workers (each on its own replica).
* traffic: ``algorithm.stats()`` of every rank.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

_STARTED = time.perf_counter()  # before `import torch`: start-up counts from here

import torch  # noqa: E402 - imported after the start-up clock on purpose
import torch.nn.functional as F  # noqa: E402 - after the start-up clock
from torch import nn  # noqa: E402 - after the start-up clock
from torch.utils.data import TensorDataset  # noqa: E402 - after the start-up clock

import bunsan  # noqa: E402 - after the start-up clock
from bunsan import algorithms, comm, datasets, models  # noqa: E402 - after the start-up clock
from bunsan._validate import check_int, check_number, check_type  # noqa: E402 - after the start-up clock
from bunsan.bench.specs import parse_algorithm_spec, per_worker_batch  # noqa: E402 - after the start-up clock

__all__ = [
    "JobSpec",
    "build_model",
    "check_model_and_data",
    "evaluate",
    "main",
    "spec_from_args",
    "train",
    "with_recomputed_bn",
]

EVAL_BATCH = 1000  # evaluation batch: memory only, no effect on the result


@dataclass
class JobSpec:
    """One training run. ``batch`` is the global minibatch (all workers together).

    Attributes:
        model: A name of :func:`bunsan.models.create`.
        dataset: A name of :func:`bunsan.datasets.load`.
        algorithm: A registered algorithm name (:func:`bunsan.algorithms.names`).
        options: Keyword arguments of the algorithm's constructor.
        epochs: Passes over the training set.
        batch: Global minibatch; each of N workers takes ``batch / N``.
        lr: Learning rate of the local ``torch.optim.SGD``, the same for every worker count.
        momentum: Momentum of the local SGD.
        nesterov: Nesterov momentum in the local SGD.
        weight_decay: Weight decay of the local SGD.
        seed: Initial model and data order.
        out: Where rank 0 writes the JSON result; ``None`` prints it.
        curves: At the end of every epoch, keep a copy of the model the job would end with if it
            stopped there (module docstring) and evaluate it afterwards.
        recompute_bn: Evaluate every model (each epoch's and the final one) with its batch-norm
            statistics recomputed over the training set, on a copy (:func:`with_recomputed_bn`),
            instead of the running statistics training left; for every algorithm alike.
    """

    model: str = "mnist1d_cnn"
    dataset: str = "mnist1d"
    algorithm: str = "data_parallel"
    options: dict[str, Any] = field(default_factory=dict)
    epochs: int = 1
    batch: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    seed: int = 0
    out: str | None = None
    curves: bool = True
    recompute_bn: bool = False

    def __post_init__(self) -> None:
        check_int("epochs", self.epochs, minimum=1)
        check_int("batch", self.batch, minimum=1, hint="the global minibatch")
        check_number("lr", self.lr, minimum=0, min_inclusive=False)
        check_type("options", self.options, dict, hint="a JSON object of the algorithm's arguments")


def spec_from_args(argv: list[str] | None = None) -> JobSpec:
    """Build the spec from ``--spec JSON`` and/or flags; a flag overrides the JSON's field."""
    parser = argparse.ArgumentParser(prog="python -m bunsan.bench.job", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", metavar="JSON", help="a JSON object with the fields below")
    parser.add_argument("--model")
    parser.add_argument("--dataset")
    parser.add_argument("--algorithm", metavar="NAME[:KEY=VALUE,...]", help="algorithm and its options")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch", type=int, help="global minibatch, split evenly over the workers")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--momentum", type=float)
    parser.add_argument("--nesterov", action="store_const", const=True, default=None)
    parser.add_argument("--weight-decay", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out", help="JSON result file written by rank 0 (default: print it)")
    parser.add_argument(
        "--no-curves",
        dest="curves",
        action="store_false",
        default=None,
        help="skip the per-epoch test error (no model copies kept)",
    )
    parser.add_argument(
        "--recompute-bn",
        action="store_const",
        const=True,
        default=None,
        help="evaluate with batch-norm statistics recomputed over the training set",
    )
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if args.spec is not None:
        try:
            values = json.loads(args.spec)
        except json.JSONDecodeError as err:
            parser.error(f"--spec is not valid JSON: {err}")
        if not isinstance(values, dict):
            parser.error("--spec must be a JSON object")
        unknown = sorted(set(values) - {f.name for f in fields(JobSpec)})
        if unknown:
            parser.error(f"--spec has unknown fields {unknown}")
    for name in (
        "model",
        "dataset",
        "epochs",
        "batch",
        "lr",
        "momentum",
        "nesterov",
        "weight_decay",
        "seed",
        "out",
        "curves",
        "recompute_bn",
    ):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.algorithm is not None:
        try:
            setting = parse_algorithm_spec(args.algorithm)
        except ValueError as err:
            parser.error(str(err))
        values["algorithm"], values["options"] = setting.name, dict(setting.options)
    try:
        return JobSpec(**values)
    except (TypeError, ValueError) as err:
        parser.error(str(err))


def check_model_and_data(model: str, dataset: str) -> None:
    """Refuse, before any job starts, a model or data set that does not exist or do not fit together.

    Also generates the data set once (it is cached on disk), not by every rank of the first job at once.

    Raises:
        ValueError: one sentence naming the model or data set and what is wrong.
    """
    if dataset not in datasets.names():
        raise ValueError(f"unknown data set {dataset!r}; choose one of {', '.join(datasets.names())}")
    if model not in models.names():
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(models.names())}")
    try:
        build_model(model, datasets.info(dataset))
        datasets.load(dataset, "train")
    except (TypeError, ValueError, ImportError) as err:
        raise ValueError(f"model {model!r} on data set {dataset!r}: {err}") from None


def build_model(name: str, info: datasets.DatasetInfo) -> nn.Module:
    """Model ``name`` sized for data set ``info``.

    Of the size arguments ``num_classes``, ``out_features``, ``in_features`` and
    ``length``, only those its constructor takes are passed. The registry maps
    names to classes privately, so each exported model class is tried with the
    arguments it takes until ``create(name)`` builds an instance of exactly it.
    """
    sizes = {
        "num_classes": info.num_classes,
        "out_features": info.num_classes,
        "in_features": math.prod(info.input_shape),
        "length": info.input_shape[-1],
        "image_size": info.input_shape[-1],
    }
    if name not in models.names():
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(models.names())}")
    with torch.random.fork_rng(devices=[]):  # the probes must not move the seeded generator
        for exported in models.__all__:
            cls = getattr(models, exported)
            if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
                continue
            parameters = inspect.signature(cls).parameters
            arguments = {k: v for k, v in sizes.items() if k in parameters}
            try:
                probe = models.create(name, **arguments)
            except TypeError:
                continue  # `name` is another class, which does not take these arguments
            if type(probe) is cls:
                break
        else:
            arguments = {}
    return models.create(name, **arguments)


def _warm_up(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of a throw-away copy with a throw-away optimizer, before the clock starts.

    The first optimizer step of a process pays one-time costs (lazy imports,
    allocator growth) that belong to start-up, not to the algorithm.
    """
    scratch = copy.deepcopy(model)
    optimizer = torch.optim.SGD(scratch.parameters(), lr=0.0, momentum=0.9)
    F.cross_entropy(scratch(x), y).backward()
    optimizer.step()


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TensorDataset, batch: int = EVAL_BATCH) -> tuple[float, float]:
    """``(error, loss)`` of ``model`` on all of ``dataset``: the fraction misclassified, the mean cross entropy."""
    was_training = model.training
    model.eval()
    wrong, loss, total = 0, 0.0, 0
    for start in range(0, len(dataset), batch):
        x, y = dataset[start : start + batch]  # a TensorDataset slices into whole tensors
        logits = model(x)
        wrong += int((logits.argmax(dim=1) != y).sum())
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        total += len(y)
    model.train(was_training)
    return wrong / total, loss / total


@torch.no_grad()
def with_recomputed_bn(model: nn.Module, dataset: TensorDataset, batch: int) -> nn.Module:
    """``model`` itself where it has no batch norm; else a copy whose batch-norm statistics are the
    cumulative average over ``dataset``'s inputs in batches of ``batch``, in training mode (Wu and
    Johnson 2021, "Rethinking 'Batch' in BatchNorm": the running statistics, an average over the last
    steps' batches, lag the weights; on ResNet-20 with 16-32-image local batches one epoch's test
    error read 42.5% with them and 9.7% recomputed, docs/experiments/plan.md). The random state is left alone."""
    norms = (nn.modules.batchnorm._BatchNorm,)
    if not any(isinstance(m, norms) for m in model.modules()):
        return model
    copied = copy.deepcopy(model)
    for m in copied.modules():
        if isinstance(m, norms):
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over every batch below
    copied.train()
    with torch.random.fork_rng(devices=[]):  # a dropout in training mode draws from it
        for start in range(0, len(dataset), batch):
            copied(dataset[start : start + batch][0])
    return copied


def _digest(model: nn.Module) -> str:
    """A hash of the parameters' bytes: equal on two ranks only if the replicas are bit for bit equal."""
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _mid_block(optimizer: Any) -> Any:
    """The block algorithm whose replicas may differ now (past its warm start), or ``None``."""
    from bunsan.algorithms.blockwise import BlockwiseSGD

    algorithm = optimizer.algorithm
    inner = getattr(algorithm, "inner", algorithm)  # Auto runs its decision as .inner
    return inner if isinstance(inner, BlockwiseSGD) and not inner.in_warm_start else None


def _model_if_stopped(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Collective. A copy of the model this rank would end with if training stopped now, training untouched.

    Block algorithms past their warm start synchronize (a block round, as ``join()``
    ends with), the copy is taken, and the model, the algorithm's state, the local
    optimizer's state and the traffic counters go back to what they were.
    """
    inner = _mid_block(optimizer)
    if inner is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    local = inner.optimizer
    saved_model = copy.deepcopy(model.state_dict())
    saved_state = copy.deepcopy(inner.state_dict())
    saved_local = copy.deepcopy(local.state_dict()) if local is not None else None
    traffic = (inner.traffic.sent, inner.traffic.received, inner.traffic.calls)
    inner.sync_replicas()
    stopped = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(saved_model)
    inner.load_state_dict(saved_state)
    if local is not None and saved_local is not None:
        local.load_state_dict(saved_local)
    inner.traffic.sent, inner.traffic.received, inner.traffic.calls = traffic
    return stopped


def train(spec: JobSpec) -> dict[str, Any] | None:
    """Run ``spec`` on this worker. Collective; returns the result on rank 0, ``None`` elsewhere."""
    bunsan.init()
    world_size, rank = bunsan.size(), bunsan.rank()
    local_batch = per_worker_batch(spec.batch, world_size)
    info = datasets.info(spec.dataset)
    train_set, test_set = datasets.load(spec.dataset, "train"), datasets.load(spec.dataset, "test")
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, info)
    local = torch.optim.SGD(
        model.parameters(), lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov, weight_decay=spec.weight_decay
    )
    algorithm = algorithms.create(spec.algorithm, **spec.options)
    x0, y0 = train_set[:local_batch]
    _warm_up(model, x0, y0)
    model, optimizer = bunsan.distribute(model, local, algorithm)
    loader = bunsan.data.loader(train_set, batch_size=local_batch, shuffle=True, seed=spec.seed)

    comm.barrier()  # every rank is set up: the clock starts together
    start = time.perf_counter()
    startup_s = start - _STARTED
    epoch_loss: list[tuple[float, int]] = []  # this rank's (sum of losses, samples) per epoch
    epoch_end_s: list[float] = []
    snapshots: list[dict[str, torch.Tensor]] = []
    paused = 0.0  # seconds spent taking the curve's copies, left out of the times
    paused_s: list[float] = []  # per epoch
    for _ in range(spec.epochs):
        loss_sum = torch.zeros((), dtype=torch.float64)
        samples = 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * len(y)
            samples += len(y)
        epoch_loss.append((float(loss_sum), samples))
        if spec.curves and _mid_block(optimizer) is not None:
            # on the clock: without the copy the faster ranks would wait for the slowest at the next
            # exchange; inside the copy's collective that wait would be left out (module docstring)
            comm.barrier()
        epoch_end_s.append(time.perf_counter() - start - paused)
        if spec.curves:
            pause = time.perf_counter()
            stopped = _model_if_stopped(model, optimizer)  # collective for block algorithms
            if rank == 0:
                snapshots.append(stopped)
            paused_s.append(time.perf_counter() - pause)
            paused += paused_s[-1]
    optimizer.join()  # block algorithms finish their last block; every replica is then equal
    comm.barrier()
    wall_s = time.perf_counter() - start - paused

    mine = {"epoch_loss": epoch_loss, "stats": algorithm.stats(), "digest": _digest(model)}
    everyone = comm.all_gather_object(mine)  # after the clock: costs nothing measured
    if rank != 0:
        return None

    def test(m: nn.Module) -> tuple[float, float]:
        return evaluate(with_recomputed_bn(m, train_set, spec.batch) if spec.recompute_bn else m, test_set)

    test_error, test_loss = test(model)
    curve = []
    if snapshots:
        final = copy.deepcopy(model.state_dict())
        for state in snapshots:
            model.load_state_dict(state)
            curve.append(test(model)[0])
        model.load_state_dict(final)
    train_loss = [
        sum(r["epoch_loss"][e][0] for r in everyone) / max(sum(r["epoch_loss"][e][1] for r in everyone), 1)
        for e in range(spec.epochs)
    ]
    stats = [r["stats"] for r in everyone]
    samples = sum(int(s["local_samples"]) for s in stats)
    return {
        "spec": asdict(spec),
        "algorithm_repr": repr(algorithm),
        "workers": world_size,
        "per_worker_batch": local_batch,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "startup_s": startup_s,
        "wall_s": wall_s,
        "epoch_end_s": epoch_end_s,
        "paused_s": paused_s,
        "train_loss": train_loss,
        "test_error": test_error,
        "test_loss": test_loss,
        "test_error_curve": curve,
        "samples": samples,
        "samples_per_s": samples / wall_s,
        "steps": int(stats[0]["steps"]),
        "bytes_sent_per_sample": sum(s["bytes_sent_per_sample"] for s in stats) / len(stats),
        "bytes_sent_per_step": sum(s["bytes_sent_per_step"] for s in stats) / len(stats),
        "replicas_equal": len({r["digest"] for r in everyone}) == 1,
        "stats": stats,
        # Auto's record: what it measured (step span, network, fixed costs, codec) and predicted, and why
        **({"auto_decision": getattr(algorithm, "decision", None)} if algorithm.name == "auto" else {}),
    }


def main(argv: list[str] | None = None) -> int:
    spec = spec_from_args(argv)
    result = train(spec)
    if result is not None:
        text = json.dumps(result, indent=1)
        if spec.out is None:
            print(text)
        else:
            path = Path(spec.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    bunsan.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
