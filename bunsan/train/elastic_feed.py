"""A :class:`bunsan.TrainingSession` in an elastic job (``bunsan run --min-np``): one process on the global batch.

Started under ``bunsan run -np N --min-np M``, a session's script needs no change: the session counts as one
process training the global minibatch (``rank`` 0, ``world_size`` 1, every sample of the data set in each
epoch), and each of its steps is a step of the job's quorum (:mod:`bunsan.elastic.member`):

* **The data.** Each epoch has one permutation, fixed by ``(seed, epoch)`` and the same on every worker: a
  one-process session's (:class:`~bunsan.train.feed.TrainFeed` of rank 0 of 1). A step's global minibatch,
  the size the schedule gives at the global sample count, is cut among the step's members with
  :func:`bunsan.elastic.part_bounds`; each member's gradient is weighted by its part
  (``share = part x members / global batch``, as :class:`bunsan.elastic.ElasticLoader` does), so the average
  is the gradient of the global minibatch's mean loss whatever the membership (docs/explanation/elastic.md).
* **A transaction per step.** The step's loss and metric sums are summed over the members inside the step,
  so they count only if it commits; the counters move on only then. A dropped step is trained again by the
  next quorum, cut among its members: each sample of an epoch is trained exactly once.
* **Nothing collective outside a step.** Epoch summaries read the sums every member holds; cross-validation
  and the final test run on each worker over the whole set (the replicas are equal, so the results are
  too); the cross-validation callback's outcome is each worker's own. Checkpoints are written by the
  quorum's rank 0 only, as a one-process session's checkpoint.
* **A joiner continues the job.** The session's counters, control state (learning-rate and momentum
  schedules, ``extra_state``), partial sums, history and the state of callbacks that have ``state_dict`` and
  ``load_state_dict`` are registered with the member, so a worker started by ``--max-restarts`` receives
  them with the model and the optimizer at its first quorum and goes on at the job's sample count.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from bunsan.elastic import member as _member
from bunsan.elastic.loader import part_bounds
from bunsan.elastic.optimizer import ElasticOptimizer
from bunsan.train.feed import TrainFeed
from bunsan.train.metrics import Accumulator, EvalResult, fetch, metric_sum, split_batch, to_device
from bunsan.train.summaries import EpochSummary

if TYPE_CHECKING:
    from bunsan.elastic.member import Member
    from bunsan.train.session import TrainingSession

__all__ = ["ElasticAlgorithm", "ElasticFeed", "ElasticSessionOptimizer", "member_part", "session_member"]


def session_member() -> Member | None:
    """This worker's :class:`~bunsan.elastic.Member` when ``bunsan run --min-np`` started it, else None.

    Joins the job first if the script did not call :func:`bunsan.init` (as :func:`bunsan.distribute` does)."""
    if _member.current() is None and _member.requested():
        from bunsan import runtime

        runtime.init()
    return _member.current()


def member_part(size: int, members: int, rank: int) -> tuple[int, int, float]:
    """``(start, stop, share)`` of member ``rank`` of ``members`` in a global minibatch of ``size``. Pure.

    The parts are :func:`bunsan.elastic.part_bounds`'; ``share`` weights the member's mean gradient so that
    the members' average of ``share x part mean`` is the global minibatch's mean (0 for an empty part)."""
    start, stop = part_bounds(size, members, rank)
    return start, stop, (stop - start) * members / size


class ElasticAlgorithm:
    """What a session asks of its algorithm, for the elastic job's exact data-parallel SGD.

    It has no state of its own (the model and the optimizer are the member's registered state) and no
    group (no ``torch.distributed`` group exists in an elastic job). ``stats()`` counts the dropped steps.
    """

    group = None

    def __init__(self, member: Member) -> None:
        self.member = member
        self.dropped_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to load: see the class docstring."""

    def stats(self) -> dict[str, float]:
        return {"dropped_steps": float(self.dropped_steps)}

    def __repr__(self) -> str:
        return f"elastic DataParallelSGD() (-np {self.member.start_size}, --min-np {self.member.min_size})"


class ElasticSessionOptimizer:
    """The session's optimizer in an elastic job: the :class:`~bunsan.elastic.ElasticOptimizer`, plus what the
    session calls on a :class:`bunsan.DistributedOptimizer` (``algorithm``, ``join``, ``sync_replicas``).

    Every other attribute is the elastic optimizer's (``step``, ``zero_grad``, ``param_groups``,
    ``committed``, ``optimizer``: the wrapped torch optimizer)."""

    def __init__(self, elastic: ElasticOptimizer, member: Member) -> None:
        self.elastic = elastic
        self.algorithm = ElasticAlgorithm(member)

    def __getattr__(self, name: str) -> Any:
        if name == "elastic":  # not set yet (a copy being made): no delegation
            raise AttributeError(name)
        return getattr(self.elastic, name)

    def join(self) -> None:
        """Nothing to wait for: every step's members trained the same number of steps."""

    def sync_replicas(self) -> None:
        """Nothing to bring together: a committed step leaves every replica equal."""


def distribute(model: nn.Module, optimizer: torch.optim.Optimizer, algorithm: Any, member: Member) -> Any:
    """The session's optimizer in an elastic job; ``optimizer`` may already be :func:`bunsan.distribute`'s."""
    if isinstance(optimizer, ElasticOptimizer):
        if algorithm is not None:
            raise ValueError("the optimizer is already distributed (an ElasticOptimizer); pass algorithm=None")
        return ElasticSessionOptimizer(optimizer, member)
    from bunsan import algorithms
    from bunsan.algorithms.blockwise import BlockwiseSGD
    from bunsan.elastic import distribute as elastic_distribute

    if isinstance(algorithm, str):
        algorithm = algorithms.create(algorithm)
    if isinstance(algorithm, BlockwiseSGD):
        raise NotImplementedError(
            f"a TrainingSession in an elastic job (bunsan run --min-np) trains with DataParallelSGD, exact or "
            f"quantized; {algorithm!r} runs elastic in a loop of your own (bunsan.distribute), not in a session yet"
        )
    return ElasticSessionOptimizer(elastic_distribute(model, optimizer, algorithm), member)


class ElasticFeed(TrainFeed):
    """The training data and the steps of a session in an elastic job (module docstring).

    The epoch's order is a one-process session's (rank 0 of 1); :meth:`batches` yields each global
    minibatch's sample indices, and :meth:`step` trains this member's part of one.
    """

    def __init__(self, member: Member, train_data: Any, seed: int, shuffle: bool, collate_fn: Any) -> None:
        # dataloader_kwargs are not used: a step's part is known only once its quorum is (read in process).
        super().__init__(train_data, 0, 1, seed=seed, shuffle=shuffle, collate_fn=collate_fn, dataloader_kwargs=None)
        self.member = member
        self._registered = False

    def batches(self, epoch: int, position: int, plan: Sequence[int]) -> Iterator[Tensor]:
        """The sample indices of each global minibatch of ``plan``, from sample ``position`` of ``epoch``."""
        order = self.partition.indices(epoch=epoch)
        for size in plan:
            yield order[position : position + size]
            position += size

    def begin(self, session: TrainingSession) -> None:
        """Register the session's state, then take part in the first quorum: a late joiner receives the live
        peers' state (model, optimizer, session) here, before it plans its first step."""
        if not self._registered:
            name = self.member.unique_name("session")
            self.member.register(name, lambda: session_state(session), lambda state: load_session(session, state))
            self._registered = True
        self.member.begin_step()

    def step(self, session: TrainingSession, indices: Tensor, size: int) -> bool:
        """Train the global minibatch ``indices`` (``size`` samples) until a quorum commits it.

        Returns False when this worker received a peer's later state at a quorum instead (it dropped a step
        the others committed): the session then plans again from the state it received.
        """
        before = (session.samples, session.steps)
        while True:
            self.member.begin_step()
            if (session.samples, session.steps) != before:
                return False
            start, stop, share = member_part(size, self.member.size(), self.member.rank())
            session._set_rates(session.optimizer.param_groups, size)
            sums = self._attempt(session, indices[start:stop], share)
            if session.optimizer.committed:
                for name, total in zip(["loss", *session.metrics], sums.tolist(), strict=True):
                    session._acc.add(name, total, size)
                session._last_minibatch = int(session.minibatch_schedule(session.samples))
                return True
            cast(ElasticAlgorithm, session.algorithm).dropped_steps += 1

    def _attempt(self, session: TrainingSession, part: Tensor, share: float) -> Tensor:
        """One try of a step on this member's ``part``: the loss and metric sums over every member, the
        gradient exchange and the commit (``session.optimizer.committed``), in the same order on every member."""
        session.optimizer.zero_grad()
        sums = torch.zeros(1 + len(session.metrics), dtype=torch.float64)
        loss = None
        if len(part):  # an empty part (fewer samples than members) sends zeros
            inputs, target = split_batch(to_device(fetch(self.dataset, part, self.collate_fn), session.device))
            output = session.model(*inputs)
            loss = session.loss_fn(output, target)
            sums[0] = loss.detach().to("cpu", torch.float64) * len(part)
            for i, fn in enumerate(session.metrics.values()):
                sums[i + 1] = metric_sum(fn, output.detach(), target)[0].cpu()
        self.member.allreduce_sum([sums])
        self.member.share = share
        if loss is not None:
            loss.backward()  # the gradients are averaged over the members before it returns
        session.optimizer.step()  # commits or drops the step on this member
        return sums


def session_state(session: TrainingSession) -> dict[str, Any]:
    """What a joining worker receives of ``session``: the committed state, the same on every member."""
    from bunsan.train.checkpoint.session_state import common_state

    return {
        "common": common_state(session),
        "accumulator": {name: list(value) for name, value in session._acc.local().items()},
        "restored_from": session.restored_from,
        "callbacks": [c.state_dict() if _has_state(c) else None for c in _stateful(session)],
    }


def load_session(session: TrainingSession, state: dict[str, Any]) -> None:
    """Continue ``session`` from a live peer's :func:`session_state`."""
    common = state["common"]
    counters = common["counters"]
    session.samples, session.steps = int(counters["samples"]), int(counters["steps"])
    session.epoch, session.position = int(counters["epoch"]), int(counters["position"])
    session.cv_index, session._last_minibatch = int(counters["cv_index"]), int(counters["last_minibatch"])
    session._stopped = common["stopped"]
    session._apply_control(common["control"])
    session.epochs = [EpochSummary.from_dict(e) for e in common["history"]["epochs"]]
    session.cross_validations = [EvalResult.from_dict(r) for r in common["history"]["cross_validations"]]
    session._acc = Accumulator.from_local(state["accumulator"])
    session.restored_from = state["restored_from"]
    session._epoch_clock = (time.perf_counter(), session.samples)
    for callback, saved in zip(_stateful(session), state["callbacks"], strict=True):
        if saved is not None and _has_state(callback):
            callback.load_state_dict(saved)


def _stateful(session: TrainingSession) -> list[Any]:
    """The session's callbacks, then the cross-validation callback: the objects whose state may be carried."""
    cv = session.cross_validation
    return [*session.callbacks, cv.callback if cv is not None else None]


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
