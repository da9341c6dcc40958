"""Batch normalization over the whole minibatch of a process group (Ioffe and Szegedy, 2015).

In data-parallel training every worker sees only its share of the minibatch, so a
plain :class:`torch.nn.BatchNorm2d` normalizes with the statistics of a few
samples and the result depends on the number of workers. :class:`SyncBatchNorm`
normalizes with the mean and variance of the *whole* minibatch of the group, as
ChainerMN's multi-node batch normalization does (Akiba et al. 2017, "ChainerMN:
Scalable Distributed Deep Learning Framework"): N workers x b samples normalize
exactly as one worker with N*b samples.

One collective per forward and one in backward, both on ``3C+1`` float64 values
(``C`` = channels). Each rank reduces its own samples to per-channel moments; the
moments are summed over the group by the differentiable all-reduce of
:func:`bunsan.comm.autograd.all_reduce_sum`, and autograd derives the backward
(itself one all-reduce) from that.

Numerics: the moments are combined as Chan, Golub and LeVeque (1979, "Updating
formulae and a pairwise algorithm for computing sample variances") combine
partial variances. Rank ``r`` computes its mean ``m_r`` and ``M2_r = sum (x -
m_r)^2`` in float32 (two passes), and the group sums ``(n_r m_r, n_r m_r^2, M2_r,
n_r)`` in float64; then ``mean = sum n_r m_r / N`` and ``N var = sum M2_r + (sum
n_r m_r^2 - N mean^2)``, where the second term, the spread between the ranks'
means, is a small difference taken in float64. The textbook one-pass form
``E[x^2] - E[x]^2`` over float32 sums cancels catastrophically when ``|mean| >>
std``; the combination above stays accurate where that form fails (the error
measured per ``|mean| / std`` is in docs/experiments/design-notes.md, "nn/, parallel/:
measurements moved from docstrings").

Half-precision inputs are normalized in float32 (float64 inputs in float64) and
the output is cast back to the input's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.modules.batchnorm import _BatchNorm

from bunsan._validate import check_int, check_number
from bunsan.comm.autograd import all_reduce_sum
from bunsan.comm.collectives import Traffic

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "global_moments", "local_moments"]


def _reduce_dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def local_moments(x: Tensor) -> Tensor:
    """This rank's per-channel moments, ready to be summed over ranks. Pure.

    Args:
        x: Input of shape ``(N, C, ...)``; may have ``N = 0``.

    Returns:
        A float64 tensor of ``3C+1`` values ``[n m, n m^2, M2, n]``: per channel
        ``n`` times the mean, ``n`` times the squared mean, the sum of squared
        deviations from the mean, and last the number of values per channel. Sums
        of such vectors over disjoint parts of a batch give the moments of the whole
        batch through :func:`global_moments`. Differentiable in ``x``.
    """
    count = x.numel() // x.shape[1] if x.shape[1] else 0
    dims = _reduce_dims(x)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    # sum / max(n, 1) rather than mean(): an empty batch gives zeros that are still
    # part of the graph, so this rank joins the backward all-reduce like the others.
    mean = x.sum(dims) / max(count, 1)
    m2 = (x - mean.view(shape)).square().sum(dims)
    mean64 = mean.double()
    n = torch.full((1,), float(count), dtype=torch.float64, device=x.device)
    return torch.cat([count * mean64, count * mean64.square(), m2.double(), n])


def global_moments(stats: Tensor, num_features: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, biased variance and count from summed :func:`local_moments`. Pure.

    Args:
        stats: The sum over ranks of :func:`local_moments` (``3C+1`` float64 values).
        num_features: ``C``.

    Returns:
        ``(mean, var, count)``: float64 per-channel mean and biased variance
        (divided by the count), and the 0-dim total count per channel.
    """
    c = num_features
    count = stats[3 * c]
    safe = count.clamp(min=1.0)
    mean = stats[:c] / safe
    # N var = sum_r M2_r + sum_r n_r (m_r - mean)^2, the second sum written as
    # sum_r n_r m_r^2 - N mean^2 (in float64 it loses nothing that matters).
    between = stats[c : 2 * c] - count * mean.square()
    var = ((stats[2 * c : 3 * c] + between) / safe).clamp(min=0.0)
    return mean, var, count


class SyncBatchNorm(_BatchNorm):
    """Batch normalization with statistics over the whole minibatch of ``group``.

    A drop-in for :class:`torch.nn.BatchNorm1d`, :class:`~torch.nn.BatchNorm2d`
    and :class:`~torch.nn.BatchNorm3d` (inputs ``(N, C)``, ``(N, C, L)``, ``(N, C,
    H, W)``, ``(N, C, D, H, W)``), with the same parameters, buffers and
    ``state_dict`` keys. In training mode the mean and variance are those of all
    samples of all ranks of ``group`` together; ranks may hold different numbers
    of samples (even zero), since counts are summed too. Gradients are those of
    the sum of the ranks' losses: with data-parallel gradient averaging, training
    equals single-process training on the concatenated batch.

    The running statistics are updated from the group's statistics (the running
    variance with the unbiased variance over the group's total count, as torch
    does), so they stay identical on every rank. In eval mode the running
    statistics are used and nothing is communicated. In eval mode *without*
    running statistics (``track_running_stats=False``) each rank normalizes with
    its own batch's statistics, as torch's SyncBatchNorm does: evaluation loops
    often run different numbers of batches on different ranks, and a collective
    there would hang.

    Communication: the forward is collective in training mode (every rank of
    ``group`` must call it, in the same order as the group's other collectives),
    and so is the backward. Works with Gloo on CPU and NCCL on CUDA.

    Args:
        num_features: ``C``, the channels (dimension 1 of the input).
        eps: Added to the variance for numerical stability.
        momentum: Weight of the new statistics in the running averages; ``None``
            for a cumulative average over all batches.
        affine: Learn a per-channel scale and shift.
        track_running_stats: Keep running averages for eval mode.
        group: Process group whose minibatch is normalized together; ``None`` means the world.
        traffic: Optional :class:`bunsan.comm.Traffic` counting this layer's bytes.
        device, dtype: Of the parameters and buffers.

    Raises:
        ValueError: In training, when the group's minibatch holds a single value
            per channel (no variance to normalize with).

    Example:
        >>> model = bunsan.nn.convert_sync_batchnorm(model)   # every BatchNorm*d
        >>> model, optimizer = bunsan.distribute(model, optimizer)
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        group: ProcessGroup | None = None,
        *,
        traffic: Traffic | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        check_int("num_features", num_features, minimum=1, hint="the input's channels")
        check_number("eps", eps, minimum=0, min_inclusive=False)
        check_number("momentum", momentum, minimum=0, maximum=1, allow_none=True, hint="None: cumulative average")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.group = group
        self.traffic = traffic

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, ...), got shape {tuple(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm was built for num_features={self.num_features} channels but the input has "
                f"{input.shape[1]} (shape {tuple(input.shape)}); channels are dimension 1"
            )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        compute = torch.promote_types(input.dtype, torch.float32)  # half inputs: float32 math
        x = input.to(compute)
        weight = None if self.weight is None else self.weight.to(compute)
        bias = None if self.bias is None else self.bias.to(compute)
        running_mean, running_var = self.running_mean, self.running_var

        if not self.training and running_mean is not None and running_var is not None:
            # Eval: fixed statistics, no communication.
            out = F.batch_norm(x, running_mean.to(compute), running_var.to(compute), weight, bias, False, 0.0, self.eps)
            return out.to(input.dtype)

        stats = local_moments(x)
        if self.training:
            # The only collective of the forward (and, through autograd, of the
            # backward). Every rank reaches it once per call, whatever its batch size.
            stats = all_reduce_sum(stats, self.group, self.traffic)
        mean, var, count = global_moments(stats, self.num_features)
        total = float(count.detach())  # one host sync per call, to refuse a batch with no variance on every rank alike
        if self.training and total <= 1:
            raise ValueError(
                f"SyncBatchNorm needs more than 1 value per channel in training, got {total:.0f} over the "
                f"whole group (input shape on this rank {tuple(input.shape)}); use a larger batch"
            )

        if self.training and self.track_running_stats and running_mean is not None and running_var is not None:
            factor = self._update_factor()
            with torch.no_grad():
                # From the group's (identical) statistics: the replicas stay equal.
                unbiased = var.detach() * (total / (total - 1))
                running_mean.mul_(1.0 - factor).add_(mean.detach().to(running_mean.dtype), alpha=factor)
                running_var.mul_(1.0 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)

        shape = [1, self.num_features] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + self.eps)
        out = (x - mean.to(compute).view(shape)) * invstd.to(compute).view(shape)
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        return out.to(input.dtype)

    def _update_factor(self) -> float:
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked) if self.num_batches_tracked is not None else 0.0
        return float(self.momentum)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.group is None else ", group=<subgroup>")


def convert_sync_batchnorm(module: nn.Module, group: ProcessGroup | None = None) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``module`` by a :class:`SyncBatchNorm`.

    The new layers take over the old ones' parameter objects (so an optimizer
    built before the conversion still updates them), their running statistics and
    their training mode. Not collective.

    Args:
        module: A model, or a single batch-norm layer.
        group: Process group to normalize over; ``None`` means the world.

    Returns:
        ``module`` with its batch-norm layers replaced in place, or the new layer
        when ``module`` itself is a batch-norm layer.
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            group,
            device=_device_of(module),
        )
        if module.affine:
            sync.weight = module.weight
            sync.bias = module.bias
        if module.track_running_stats:
            sync.running_mean = module.running_mean
            sync.running_var = module.running_var
            sync.num_batches_tracked = module.num_batches_tracked
        sync.train(module.training)
        return sync
    for name, child in list(module.named_children()):
        converted = convert_sync_batchnorm(child, group)
        if converted is not child:
            setattr(module, name, converted)
    return module


def _device_of(module: nn.Module) -> torch.device | None:
    for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        return tensor.device
    return None
