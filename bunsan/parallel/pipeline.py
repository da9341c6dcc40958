"""Layer pipelining: a model cut into stages, one per rank, fed with microbatches.

Built on :mod:`torch.distributed.pipelining` (``PipelineStage`` with
``ScheduleGPipe`` or ``Schedule1F1B``), which works on Gloo and CPU in torch 2.13
as well as on NCCL (docs/experiments/design-notes.md, "nn/, parallel/: measurements moved from
docstrings"). bunsan adds the argument checks, a loss function that may change from step to step,
gradients that accumulate across steps, and the average loss on the last stage.

Schedules (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks
using Pipeline Parallelism"; Narayanan et al. 2019, "PipeDream: Generalized
Pipeline Parallelism for DNN Training", for one-forward-one-backward):

* ``"gpipe"``: all microbatches forward, then all backward. Simple; holds the
  activations of every microbatch at once.
* ``"1f1b"``: after a warm-up, each stage alternates one forward and one backward,
  so at most ``stages`` microbatches' activations are alive. Needs at least as many
  microbatches as stages.

Both compute the same gradients: those of the loss averaged over microbatches,
which for a loss that averages over its samples (the default of torch's losses)
and equal microbatches is the loss of the whole batch. The pipeline divides each
microbatch's loss by the number of microbatches before its backward, instead of
torch's ``scale_grads`` (which divides the whole ``.grad``, including gradients
accumulated in earlier steps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from bunsan._validate import check_choice, check_int
from bunsan.comm.collectives import get_rank, get_world_size, is_initialized

__all__ = ["Pipeline", "pipeline"]

LossFn = Callable[[Tensor, Tensor], Tensor]
_SCHEDULES = ("gpipe", "1f1b")


class Pipeline:
    """Rank ``r`` of ``group`` runs ``stages[r]``; see :func:`pipeline`."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        microbatches: int,
        schedule: str = "gpipe",
        group: ProcessGroup | None = None,
        loss_fn: LossFn | None = None,
    ) -> None:
        n = get_world_size(group)
        if not isinstance(stages, Sequence) or not all(isinstance(s, nn.Module) for s in stages):
            raise TypeError("stages must be a list of torch.nn.Module, one per rank of the group")
        if len(stages) != n:
            raise ValueError(
                f"stages has {len(stages)} modules but the group has {n} ranks; pass one stage per rank "
                "(rank r runs stages[r])"
            )
        check_int("microbatches", microbatches, minimum=1)
        check_choice("schedule", schedule, _SCHEDULES)
        if schedule == "1f1b" and microbatches < n:
            raise ValueError(
                f"schedule='1f1b' needs at least as many microbatches as stages ({n}), got microbatches={microbatches}; "
                "use more microbatches or schedule='gpipe'"
            )
        self.group = group
        self.num_stages = n
        self.stage_index = get_rank(group)
        self.microbatches = microbatches
        self.schedule = schedule
        self.module = stages[self.stage_index]
        self.is_first = self.stage_index == 0
        self.is_last = self.stage_index == n - 1
        self._loss_fn = loss_fn
        self._step_loss_fn: LossFn | None = None
        self._calls: list[tuple[Tensor, Tensor]] = []  # (scaled, unscaled) loss of each loss_fn call
        self._batch_size: int | None = None
        self._torch_schedule: Any = None
        if is_initialized():
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
            stage = PipelineStage(self.module, self.stage_index, n, device, group=group)
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self._torch_schedule = cls(
                stage, n_microbatches=microbatches, loss_fn=self._microbatch_loss, scale_grads=False
            )

    def parameters(self) -> Any:
        """This rank's stage's parameters (for its optimizer)."""
        return self.module.parameters()

    def _microbatch_loss(self, output: Tensor, target: Tensor) -> Tensor:
        assert self._step_loss_fn is not None  # set by step() before the schedule runs
        loss = self._step_loss_fn(output, target)
        scaled = loss / self.microbatches  # the gradient of the microbatches' mean loss
        self._calls.append((scaled, loss.detach()))
        return scaled

    def _check_batch(self, tensor: Tensor | None, name: str) -> None:
        if tensor is None:
            return
        size = tensor.shape[0]
        if size % self.microbatches:
            raise ValueError(
                f"{name} has {size} samples, not divisible into microbatches={self.microbatches}; use a batch "
                "size that is a multiple of it (drop the last partial batch)"
            )
        if self._batch_size is None:
            self._batch_size = size
        elif size != self._batch_size:
            raise ValueError(
                f"{name} has {size} samples but the first step had {self._batch_size}: the pipeline's "
                "message shapes are fixed at the first step; keep the batch size (drop the last partial batch)"
            )

    def step(
        self, x: Tensor | None = None, target: Tensor | None = None, loss_fn: LossFn | None = None
    ) -> Tensor | None:
        """One forward and backward pass of the whole batch through the pipeline. Collective.

        Every rank of the group calls it. The gradients are *added* to each
        stage's ``.grad`` (call ``optimizer.zero_grad()`` as usual), so an ordinary
        ``optimizer.step()`` on each rank follows.

        Args:
            x: The batch; read on the first stage only (other ranks may pass ``None``).
            target: The targets; read on the last stage only.
            loss_fn: ``loss_fn(output, target)`` for one microbatch, averaging over its
                samples; overrides the one given to :func:`pipeline`.

        Returns:
            On the last stage the loss averaged over the microbatches (detached);
            ``None`` on the other stages.

        Raises:
            ValueError: No loss function, a missing ``x`` or ``target`` where it
                is read, or a batch not divisible into the microbatches.
        """
        loss_fn = loss_fn or self._loss_fn
        if loss_fn is None:
            raise ValueError("no loss function: pass loss_fn to step() or to bunsan.parallel.pipeline()")
        if self.is_first and x is None:
            raise ValueError("the first stage needs the batch: pass x to step()")
        if self.is_last and target is None:
            raise ValueError("the last stage needs the targets: pass target to step()")
        self._check_batch(x, "x")
        self._check_batch(target, "target")
        self._step_loss_fn = loss_fn
        self._calls = []
        losses: list[Tensor] = []
        try:
            if self._torch_schedule is None:
                self._local_step(x, target)
                losses = [scaled for scaled, _ in self._calls]
            else:
                args = (x,) if self.is_first else ()
                kwargs = {"target": target, "losses": losses} if self.is_last else {}
                self._torch_schedule.step(*args, **kwargs)
        finally:
            self._step_loss_fn = None
        if not self.is_last:
            return None
        # The losses of the microbatches, as torch's schedule reports them. It may
        # call the loss function once more than that at the first step (its shape
        # inference on placeholder values), so the calls are matched, not counted.
        unscaled = [next(loss for scaled, loss in self._calls if scaled is s) for s in losses]
        self._calls = []
        return torch.stack(unscaled).mean()

    def _local_step(self, x: Tensor | None, target: Tensor | None) -> None:
        # No process group: one stage, microbatches in turn (what GPipe does on one device).
        assert x is not None and target is not None
        for xm, tm in zip(x.chunk(self.microbatches), target.chunk(self.microbatches)):
            self._microbatch_loss(self.module(xm), tm).backward()

    def __repr__(self) -> str:
        return (
            f"Pipeline(stage {self.stage_index} of {self.num_stages}, schedule={self.schedule!r}, "
            f"microbatches={self.microbatches})"
        )


def pipeline(
    stages: Sequence[nn.Module],
    microbatches: int,
    schedule: str = "gpipe",
    group: ProcessGroup | None = None,
    loss_fn: LossFn | None = None,
) -> Pipeline:
    """Cut a model into ``stages`` run by the ranks of ``group``, fed with microbatches. Collective.

    Every rank passes the same list of stages (only ``stages[rank]`` is used
    on rank ``rank``, so the others may be cheap placeholders of the same type)
    and builds its optimizer over :meth:`Pipeline.parameters`. Each stage's
    parameters must already be on the device of the backend (CPU for Gloo, this
    rank's GPU for NCCL). Activations between stages travel point to point.

    Args:
        stages: One module per rank of ``group``; ``stages[r]``'s output is ``stages[r+1]``'s input.
        microbatches: Microbatches per batch; the batch size must be a multiple.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        group: Process group of the stages; ``None`` means the world.
        loss_fn: Default ``loss_fn(output, target)`` for :meth:`Pipeline.step`.

    Returns:
        A :class:`Pipeline` whose :meth:`~Pipeline.step` trains one batch.

    Example:
        >>> pipe = bunsan.parallel.pipeline([nn.Sequential(l1, relu), nn.Sequential(l2)], microbatches=4)
        >>> optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        >>> loss = pipe.step(x, y, F.cross_entropy)      # a tensor on the last stage, None elsewhere
        >>> optimizer.step()
    """
    return Pipeline(stages, microbatches, schedule, group, loss_fn)
