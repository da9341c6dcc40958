"""Training on synthetic data: the input each model takes, and the timed loop of a throughput job.

Every worker trains the model on one fixed random batch of its own (so no data
loading is measured), first ``warmup`` steps untimed, then ``iters`` timed
iterations of ``batches_per_iter`` steps each; rank 0 writes every worker's
iteration times and the bytes each sent per step (``algorithm.stats()``).
:mod:`bunsan.bench.throughput` turns them into images/s and scaling efficiency;
:mod:`bunsan.bench.plan` and ``tools/predict.py`` size their models with
:func:`model_inputs`.

This module imports no torch at the top.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bunsan._validate import check_int

__all__ = ["model_inputs", "time_steps", "train_timed"]

# model name -> (default input shape, which constructor argument takes the image side)
_INPUTS: dict[str, tuple[tuple[int, ...], str | None]] = {
    "cifar_convnet": ((3, 32, 32), "image_size"),
    "resnet20": ((3, 32, 32), None),
    "resnet110": ((3, 32, 32), None),
    "bn_inception_cifar": ((3, 32, 32), None),
    "mnist_convnet": ((1, 28, 28), "image_size"),
    "digits_cnn": ((1, 8, 8), "fixed"),
    "mnist1d_cnn": ((1, 40), "length"),
    "mlp": ((1, 28, 28), "in_features"),
    "mlp_10m": ((1, 32, 32), "in_features"),  # 1024 inputs: 10.5M parameters
}


def model_inputs(name: str, image_size: int | None, num_classes: int) -> tuple[dict[str, Any], tuple[int, ...]]:
    """Constructor arguments of model ``name`` and the shape of one input, for images of side ``image_size``.

    ``None`` keeps the model's own size (32 for the CIFAR models, 28 for
    ``mnist_convnet`` and ``mlp``, 32 (1024 inputs) for ``mlp_10m``, 8 for ``digits_cnn``, 40 for ``mnist1d_cnn``).
    A model not listed here gets ``num_classes`` and 3-channel square images.

    Raises:
        TypeError: ``image_size`` is not an int.
        ValueError: a size the model cannot take.
    """
    shape, takes = _INPUTS.get(name, ((3, 32, 32), None))
    if image_size is not None:
        check_int("--image-size", image_size, minimum=4)
        if takes == "fixed" and image_size != shape[-1]:
            raise ValueError(f"model {name} takes {shape[-1]}x{shape[-1]} images only; drop --image-size")
        shape = (*shape[:-2], image_size, image_size) if len(shape) == 3 else (*shape[:-1], image_size)
    if takes == "in_features":
        return {"in_features": math.prod(shape), "out_features": num_classes}, shape
    kwargs: dict[str, Any] = {"num_classes": num_classes}
    if takes in ("image_size", "length"):
        kwargs[takes] = shape[-1]
    return kwargs, shape


def time_steps(model: Any, optimizer: Any, batches: Sequence[tuple[Any, Any]]) -> float:
    """Seconds per training step (zero_grad, cross-entropy forward and backward, ``optimizer.step()``) over ``batches``."""
    import torch.nn.functional as F

    start = time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return (time.perf_counter() - start) / len(batches)


def train_timed(spec: dict[str, Any]) -> int:
    """Run the timed loop on this worker; rank 0 writes the result to ``spec["out"]``. Collective."""
    import torch
    import torch.nn.functional as F

    import bunsan
    from bunsan import algorithms, comm, models

    bunsan.init()
    rank = bunsan.rank()
    kwargs, shape = model_inputs(spec["model"], spec["image_size"], spec["num_classes"])
    torch.manual_seed(spec["seed"])
    model = models.create(spec["model"], **kwargs)
    parameters = sum(p.numel() for p in model.parameters())
    local = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])
    algorithm = algorithms.create(spec["algorithm"], **spec["options"])
    model, optimizer = bunsan.distribute(model, local, algorithm)
    generator = torch.Generator().manual_seed(spec["seed"] + rank)  # each worker its own batch, as with real data
    x = torch.randn(spec["batch"], *shape, generator=generator)
    y = torch.randint(spec["num_classes"], (spec["batch"],), generator=generator)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(spec["warmup"]):
        step()
    comm.barrier()  # the timed iterations start together
    before = algorithm.stats()
    times: list[float] = []
    for _ in range(spec["iters"]):
        start = time.perf_counter()
        for _ in range(spec["batches_per_iter"]):
            step()
        times.append(time.perf_counter() - start)
    after = algorithm.stats()
    optimizer.join()  # block algorithms end their last block; not timed
    steps = max(after["steps"] - before["steps"], 1)
    mine = {
        "times": times,
        "bytes_per_step": (after["bytes_sent"] - before["bytes_sent"]) / steps,
        "threads": torch.get_num_threads(),
    }
    everyone = comm.all_gather_object(mine)
    if rank == 0:
        result = {
            "workers": bunsan.size(),
            "times_s": [r["times"] for r in everyone],
            "bytes_sent_per_step": statistics.fmean(r["bytes_per_step"] for r in everyone),
            "threads": everyone[0]["threads"],
            "parameters": parameters,
            "input_shape": list(shape),
            "algorithm_repr": repr(algorithm),
            "torch": torch.__version__,
        }
        Path(spec["out"]).write_text(json.dumps(result, indent=1))
    bunsan.finalize()
    return 0
