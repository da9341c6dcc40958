"""Synchronous data-parallel SGD: gradients averaged over all workers every step.

``bits=32`` is exact synchronous SGD (Dean et al. 2012's synchronous baseline;
the same arithmetic as PyTorch's DistributedDataParallel). Gradients are packed
into buckets of about ``bucket_size_mb``; a bucket's all-reduce starts during
``loss.backward()`` as soon as its last gradient is ready, so communication
overlaps the rest of the backward pass (as in Horovod, Sergeev & Del Balso 2018,
and DDP, Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training").

Distributed invariants kept here:

* Buckets are launched strictly in index order on every rank (a bucket whose
  gradients are ready waits for its predecessors), so the ranks' collectives
  match even when gradients become ready in different orders.
* The exchange completes before ``loss.backward()`` returns: the first gradient
  hook of a backward queues a callback on the autograd engine, which launches
  the buckets still waiting (parameters this backward did not reach), waits for
  every bucket and sets ``p.grad`` to the average. Code between backward and
  ``optimizer.step()`` (clipping, ``GradScaler``) sees the global gradient, as
  with DDP.
* Unused parameters need no flag: a parameter without a gradient on a rank
  contributes zeros and a flag 0; the flags are summed with the gradients. A
  parameter no rank used keeps ``grad = None`` (so momentum and weight decay do
  not move it, as in one process); one used by some ranks gets the average over
  all ranks, as DDP does.
* Every step also sums ``(samples, active ranks, gradient flags, buffer flags)``:
  slots at the end of the last bucket (or a separate float64 all-reduce when that
  bucket is compressed). The global sample count is exact, and a rank that has
  run out of data (:meth:`join`) contributes zeros without biasing the average,
  which is taken over the active ranks only. Buffers that changed on any rank
  (BatchNorm statistics) are then averaged (:mod:`bunsan.algorithms.buffers`).
* After the step a parameter's ``.grad`` is a view of its bucket: the reduced
  gradient is not copied back, and the next backward's gradient is copied in
  with the division by the world size fused into the copy.
* Gradients are divided by the world size before the sum, so a half-precision
  sum cannot overflow where the mean would not.

The quantized exchange also runs inside plain DistributedDataParallel as a
communication hook (:mod:`bunsan.algorithms.data_parallel.ddp_hook`), with the same
per-bucket functions (:mod:`bunsan.algorithms.data_parallel.quantized`); its local
momentum and 1-bit Adam there need the optimizer wrapper
:class:`~bunsan.algorithms.data_parallel.hook_optimizer.HookOptimizer`.
"""

from __future__ import annotations

from bunsan.algorithms.data_parallel.algorithm import DataParallelSGD
from bunsan.algorithms.data_parallel.ddp_hook import QuantizedHookState, quantized_hook
from bunsan.algorithms.data_parallel.hook_optimizer import HookOptimizer
from bunsan.algorithms.data_parallel.momentum import HEAVY_MOMENTUM_1BIT, QUANTIZED_MOMENTUM_1BIT
from bunsan.algorithms.data_parallel.stripes import plan_stripes

__all__ = [
    "HEAVY_MOMENTUM_1BIT",
    "QUANTIZED_MOMENTUM_1BIT",
    "DataParallelSGD",
    "HookOptimizer",
    "QuantizedHookState",
    "plan_stripes",
    "quantized_hook",
]
