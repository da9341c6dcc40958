"""Asynchronous data-parallel SGD with a parameter server (CNTK's DataParallelASGD).

A parameter server holds the global model ``W``. Every worker trains its own
replica with the user's local optimizer and, each time it has trained
``sync_period`` samples since its last synchronization, it

1. *pushes* its accumulated update ``u = w_local - w_pulled`` (its model now
   minus the model it last pulled), and
2. *pulls* the current global model, which becomes its replica and its new
   ``w_pulled``,

without waiting for the other workers. The server applies every update as it
arrives, ``W = W + u`` (``W = W + u / max(staleness, 1)`` with
``staleness_aware=True``), one at a time, in arrival order, and records that
order. This is Downpour SGD (Dean et al. 2012, "Large Scale Distributed Deep
Networks", NIPS 2012) with accumulated pushes, as CNTK's DataParallelASGD
(whose server was Multiverso) does it; a slow worker delays only itself.

Learning rate and the number of workers. Every worker's update is applied in
full, so N workers move ``W`` about N times as far per unit of time as one
worker would; per *sample* it is plain SGD with the local minibatch, i.e. N
times the step of synchronous SGD that averages the N workers' gradients at the
same learning rate (``DataParallelSGD`` with the same global batch). Updates are
also *stale*: an update computed from ``W_t`` lands on ``W_{t+tau}``, with
``tau`` around ``N - 1`` when all workers run at one speed. Large steps on stale
models diverge where synchronous SGD would not. What to do:

* scale the local learning rate by ``1/N`` relative to ``DataParallelSGD`` at the
  same global batch (the usual starting point; :func:`scaled_lr`);
* ramp the learning rate up over the first ``lr_warmup`` samples from
  ``lr_warmup_start`` of its value (CNTK's ``AdjustLearningRateAtBeginning``):
  the first updates, when the model changes fastest and staleness hurts most,
  are small;
* or divide each update by its staleness (``staleness_aware=True``; Zhang et al.
  2016, "Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016),
  which is close to ``1/N`` at equal speeds and adapts when speeds differ;
* bound the staleness (``staleness_bound``): a worker more than that many pushes
  ahead of the slowest active worker waits (the stale synchronous parallel model
  of Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous
  Parallel Parameter Server", NIPS 2013).

Staleness also acts like extra momentum (Mitliagkas et al. 2016, "Asynchrony
begets momentum, with an application to deep learning"): with the local
optimizer's momentum on top, long sync periods become unstable: lower the local
momentum, or the period, when that happens (docs/explanation/block-algorithms.md).

Recht et al. 2011 ("Hogwild!", NIPS 2011) show that lock-free asynchronous SGD
converges at nearly the serial rate when updates are sparse and the delay is
bounded; dense neural-network updates are not sparse, which is why the step
size and the staleness matter here.

Units. ``sync_period`` is in samples *per worker* (CNTK's ``syncPeriod``);
``lr_warmup`` is in samples of all workers together, as this worker knows them:
the server's count at its last pull plus its own samples since.

Where the server runs (``server="rank0"``). Rank 0 hosts the server beside its
own worker. Rank 0's worker pushes and pulls by calling the server in-process
(no bytes on the wire); every other worker ``w`` talks to the server over a
two-rank gloo process group ``[0, w]`` of its own, created collectively in
:meth:`AsyncSGD.setup` (:func:`bunsan.comm.p2p.new_pair_groups`).

Threads. On rank 0 one daemon thread per remote worker serves that worker: it
receives the worker's push, applies it under the server's lock, and sends the
current model back. Each thread is the only user of its pair group on rank 0,
and the worker's main thread the only user on the worker, so no process group
is ever used by two threads at once; rank 0's main thread never touches the
pair groups, and the server threads never touch ``group`` (the main thread's
collectives in :meth:`AsyncSGD.join` and :meth:`AsyncSGD.sync_replicas`). The
threads are daemons: they never keep a process alive.

Messages. One message each way per synchronization
(:mod:`bunsan.algorithms.async_sgd.messages`): ``PUSH`` or ``DONE`` with the update,
answered by ``REPLY`` or ``FINAL`` with the model, ``WAIT`` keep-alives every
``timeout_s / 4`` while a reply is held back, or ``ABORT``.

Failures. A worker that dies closes its connections, and the server thread that
serves it fails at once; a worker that falls silent for ``timeout_s`` fails it
too. The server then answers every other worker ``ABORT`` and rank 0's worker
raises :class:`bunsan.errors.CommunicationError` naming the failed rank at its
next step; under ``bunsan run`` the failure watch (:mod:`bunsan.comm.group`)
then ends the whole job. A dead server (rank 0) closes its connections and every
worker's pending receive raises.

The package: :mod:`~bunsan.algorithms.async_sgd.rules` (pure arithmetic),
:mod:`~bunsan.algorithms.async_sgd.messages` (wire format),
:mod:`~bunsan.algorithms.async_sgd.server` (:class:`ParameterServer`, rank 0) and
:mod:`~bunsan.algorithms.async_sgd.worker` (:class:`AsyncSGD`).
"""

from __future__ import annotations

from bunsan.algorithms.async_sgd.rules import lr_warmup_factor, may_proceed, scaled_lr, staleness_scale
from bunsan.algorithms.async_sgd.server import ARRIVALS_KEPT, ParameterServer
from bunsan.algorithms.async_sgd.worker import AsyncSGD

__all__ = [
    "ARRIVALS_KEPT",
    "AsyncSGD",
    "ParameterServer",
    "lr_warmup_factor",
    "may_proceed",
    "scaled_lr",
    "staleness_scale",
]
