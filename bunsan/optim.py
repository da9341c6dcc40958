"""The training-loop glue: a torch optimizer driven by a data-parallel algorithm.

:func:`distribute` is the one call a single-process script adds. It checks that
the model is the same on every rank, copies rank 0's parameters and buffers to
all ranks, hooks the algorithm into backward and forward (to count samples), and
wraps the optimizer so that ``optimizer.step()`` runs the algorithm's collectives
around the user's own update rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.algorithms.join import Joinable, JoinHook

from bunsan import _allocator, elastic
from bunsan import algorithms as _algorithms
from bunsan._delegate import init_optimizer_hooks, optimizer_attribute
from bunsan._validate import check_type
from bunsan.algorithms import measure as _measure
from bunsan.algorithms.base import Algorithm
from bunsan.algorithms.blockwise import BlockwiseSGD
from bunsan.algorithms.buffers import synced_buffer_modules
from bunsan.comm import (
    broadcast_tensors,
    get_backend,
    get_world_size,
    global_rank,
    is_initialized,
)
from bunsan.elastic import blocks as elastic_blocks
from bunsan.elastic import member as _elastic_member
from bunsan.errors import CheckpointError
from bunsan.model_checks import check_same_model, check_same_values

__all__ = ["DistributedOptimizer", "check_same_model", "distribute"]


class DistributedOptimizer(torch.optim.Optimizer, Joinable):
    """Run ``algorithm``'s collective hooks around ``optimizer.step()``.

    It is a :class:`torch.optim.Optimizer` (learning-rate schedulers, step pre/post
    hooks and ``GradScaler`` accept it) whose ``param_groups``, ``state`` and
    ``defaults`` are those of the wrapped optimizer: the object the user built
    stays the one that updates parameters.

    What a training loop sees (DESIGN.md, "Your training loop" in the README):
    gradient-exchanging algorithms complete their exchange when ``loss.backward()``
    returns, so anything between backward and ``step()`` (clipping,
    ``GradScaler.unscale_`` and its inf check, inspection, edits) sees the global
    average. ``step()`` then runs the user's update rule and the algorithm's
    model exchange, if it has one.

    Uneven data: call :meth:`join` on every rank after the loop, or, as with DDP,
    run the loop inside ``with torch.distributed.algorithms.join.Join([optimizer]):``
    (also beside other joinables, e.g. ``Join([ddp_model, optimizer])``). The
    context needs an algorithm that exchanges every step (``DataParallelSGD``); the
    block algorithms synchronize when a block ends, which a rank that has joined
    cannot foresee from the ``Join`` context's per-iteration notice, and AsyncSGD
    has no per-step collective to shadow: :meth:`join` serves those.

    Args:
        optimizer: any torch optimizer over the model's parameters.
        algorithm: a :class:`bunsan.algorithms.Algorithm` already set up with the
            model's parameters (:func:`distribute` does that).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, algorithm: Algorithm) -> None:
        # Deliberately no super().__init__: the wrapped optimizer owns the parameter
        # groups and state; this object only adds collectives around its step.
        check_type("optimizer", optimizer, torch.optim.Optimizer, hint="torch.optim.Optimizer")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("the optimizer is already distributed; pass the original torch optimizer")
        self.optimizer = optimizer
        self.algorithm = algorithm
        init_optimizer_hooks(self)
        from bunsan import runtime

        runtime.track_optimizer(self)  # finalize() joins it unless the script does

    # The wrapped optimizer's attributes, seen through this object.
    param_groups = optimizer_attribute("param_groups")
    state = optimizer_attribute("state")
    defaults = optimizer_attribute("defaults")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({type(self.optimizer).__name__}, {self.algorithm!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a DistributedOptimizer is tied to a live process group; save its state_dict() instead")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "adding parameter groups after bunsan.distribute() is not supported: "
            "the algorithm's buckets and residuals are built for the parameters it was given"
        )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Collective: every rank calls it once per training step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.algorithm.reduce_gradients()
        self.optimizer.step()
        self.algorithm.after_step()
        self.algorithm.step += 1
        return loss

    def synchronize(self) -> None:
        """Collective. Complete this step's gradient exchange now (Horovod's spelling).

        Never needed: the exchange already completes when ``loss.backward()``
        returns. It exists so that ported Horovod code (``optimizer.synchronize()``
        before clipping) keeps working; it is a no-op when there is nothing pending.
        """
        self.algorithm.complete_exchange()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's ``with optimizer.skip_synchronize(): optimizer.step()``: nothing to skip here.

        The exchange completed in backward (or in :meth:`synchronize`); ``step()``
        never exchanges gradients twice.
        """
        yield

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside send nothing.

        Run all but the last micro-batch's backward inside it; the last one,
        outside, sends the accumulated gradients.
        """
        self.algorithm.begin_accumulation()
        try:
            yield
        finally:
            self.algorithm.end_accumulation()

    def join(self) -> None:
        """Collective. Call after the training loop on every rank; see Algorithm.join.

        With uneven data a rank that finishes first keeps answering the others'
        synchronizations until every rank has called it.
        """
        self.algorithm.join()

    # torch's join protocol: the algorithm takes part; this object forwards so that
    # ``Join([optimizer])`` works as ``Join([ddp_model])`` does.
    @property
    def _join_config(self) -> Any:
        return getattr(self.algorithm, "_join_config", None)

    @_join_config.setter
    def _join_config(self, value: Any) -> None:
        self.algorithm._join_config = value  # type: ignore[attr-defined]  # checked in join_hook() first

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The algorithm's :class:`~torch.distributed.algorithms.join.JoinHook` (for a ``Join`` context)."""
        if not isinstance(self.algorithm, Joinable):
            raise TypeError(
                f"{type(self.algorithm).__name__} cannot run inside torch's Join context: a rank that has joined "
                "can shadow only an exchange made every step (DataParallelSGD's); call optimizer.join() after "
                "the training loop on every rank instead"
            )
        return self.algorithm.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self.algorithm.join_device if isinstance(self.algorithm, Joinable) else torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return self.algorithm.join_process_group if isinstance(self.algorithm, Joinable) else None

    def sync_replicas(self) -> None:
        """Collective. Bring every replica to the same model now.

        Block algorithms finish their partial block; AsyncSGD pulls the global
        model; exact data parallelism has nothing to do (the replicas are equal).
        """
        self.algorithm.sync_replicas()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state in torch's format, plus ``"algorithm"`` (this rank's part).

        A plain torch optimizer loads it as it is (torch ignores the extra key).
        """
        state = dict(self.optimizer.state_dict())
        state["algorithm"] = self.algorithm.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a plain torch optimizer's state is accepted too."""
        if not isinstance(state_dict, dict):
            raise CheckpointError(f"not an optimizer state: expected a dict, got {type(state_dict).__name__}")
        if "optimizer" in state_dict and "algorithm" in state_dict:  # the format before 0.2
            self.optimizer.load_state_dict(state_dict["optimizer"])
            self.algorithm.load_state_dict(state_dict["algorithm"])
        elif "param_groups" in state_dict:
            plain = {k: v for k, v in state_dict.items() if k != "algorithm"}
            self.optimizer.load_state_dict(plain)
            if "algorithm" in state_dict:
                self.algorithm.load_state_dict(state_dict["algorithm"])
        else:
            raise CheckpointError("not an optimizer state: expected the output of optimizer.state_dict()")


class _Attachment:
    """What :func:`distribute` leaves on a model: the algorithm, without making the model unpicklable.

    A copy (``copy.deepcopy``) or a pickled and loaded model (``torch.save(model)``)
    gets an empty attachment: it is an ordinary model again, bound to no job.
    """

    def __init__(self, algorithm: Algorithm | None) -> None:
        self.algorithm = algorithm

    def __deepcopy__(self, memo: dict[int, Any]) -> _Attachment:
        return _Attachment(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Attachment, (None,))


def _tensors_in(value: Any, limit: int = 16) -> list[Tensor]:
    """Up to ``limit`` tensors that require grad in a forward's output (tensors, tuples, lists, dicts)."""
    found: list[Tensor] = []
    stack = [value]
    while stack and len(found) < limit:
        item = stack.pop()
        if isinstance(item, Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif hasattr(item, "__dataclass_fields__"):
            stack.extend(getattr(item, f) for f in item.__dataclass_fields__)
    return found


class _SampleCounter:
    """Forward hooks that count a forward's samples once its output is back-propagated.

    The count is the leading dimension of the forward's first tensor input. It is
    confirmed to the algorithm when a gradient first flows into one of the
    forward's outputs, i.e. in the backward that leads to the optimizer step. A
    forward whose output is never back-propagated (a metric computed in train mode)
    counts nothing, unless no forward of the step was confirmed (a loss taken from
    an intermediate tensor): then the unconfirmed ones count. A forward that returns
    no tensor requiring grad counts at once.
    Picklable and deep-copyable: the copy is inert (see :class:`_Attachment`).
    """

    def __init__(self, attachment: _Attachment) -> None:
        self.attachment = attachment
        self._pending: list[int] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> _SampleCounter:
        return _SampleCounter(_Attachment(None))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_SampleCounter, (_Attachment(None),))

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        algorithm = self.attachment.algorithm
        if algorithm is None or not (module.training and torch.is_grad_enabled()):
            return
        # DDP's attribute, set by scripts written for it (nanoGPT toggles it per micro-step):
        # honoured the same way, read at forward time for the backward that follows.
        sync = module.__dict__.get("require_backward_grad_sync")
        if sync is not None:
            algorithm.set_gradient_sync(bool(sync))
        first = _first_tensor(args, kwargs)
        self._pending.append(first.shape[0] if first is not None and first.dim() > 0 else 0)

    def post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not self._pending:
            return
        n = self._pending.pop()
        algorithm = self.attachment.algorithm
        if algorithm is None or n == 0:
            return
        outputs = _tensors_in(output)
        if not outputs:
            algorithm.count_samples(n)
            return
        algorithm.note_forward(n)
        confirmed = [False]

        def confirm(grad: Tensor) -> None:
            if not confirmed[0]:
                confirmed[0] = True
                algorithm.confirm_forward(n)

        for t in outputs:
            t.register_hook(confirm)


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], Tensor):
            return value[0]
    return None


def _distribute_elastic(
    model: nn.Module, optimizer: torch.optim.Optimizer, member: Any, algorithm: Any, options: dict[str, Any]
) -> DistributedOptimizer:
    """:func:`distribute` in an elastic job (:mod:`bunsan.elastic`)."""
    if isinstance(algorithm, str):
        algorithm = _algorithms.create(algorithm, **options)
    elif options:
        raise TypeError(
            f"options {sorted(options)} are for a name-built algorithm; pass them to {type(algorithm).__name__}(...)"
        )
    if isinstance(algorithm, BlockwiseSGD):
        return cast(DistributedOptimizer, elastic_blocks.distribute(model, optimizer, member, algorithm))
    return cast(DistributedOptimizer, elastic.distribute(model, optimizer, algorithm))


def distribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    algorithm: Algorithm | str | None = None,
    *,
    group: Any = None,
    broadcast: bool = True,
    check: bool = True,
    **algorithm_options: Any,
) -> tuple[nn.Module, DistributedOptimizer]:
    """Make a single-process model and optimizer data-parallel. Collective.

    Calls :func:`bunsan.init` first if this process has not joined the job yet. A CPU model
    in a group of several, also one the script made itself with
    ``torch.distributed.init_process_group``, gets the malloc settings that ``bunsan.init()``
    gives its CPU workers (:mod:`bunsan._allocator`; ``BUNSAN_MALLOC_TUNING=0`` turns it off),
    and in a Gloo group that ``bunsan.init()`` did not start, workers sharing a host that would
    run more intra-op threads than it has cores get their share of them
    (:func:`bunsan.runtime.share_host_cores`).

    Args:
        model: the model; it is returned as the same object (no wrapper, so its
            ``state_dict()`` keys do not change), with hooks added.
        optimizer: a torch optimizer over ``model``'s parameters.
        algorithm: an :class:`Algorithm`, a registered name (``"data_parallel"``,
            ...), or None for exact ``DataParallelSGD()``.
        group: process group for a name-built algorithm.
        broadcast: copy rank 0's parameters and buffers to every rank first.
        check: with ``broadcast=False``, check (one small all-reduce) that every
            rank starts from the same parameter values, and raise if not.
        **algorithm_options: options for a name-built algorithm.

    Returns:
        ``(model, optimizer)`` where the optimizer is a :class:`DistributedOptimizer`.

    Raises:
        ModelMismatchError: the ranks' models differ (names, shapes or dtypes).
    """
    check_type("model", model, nn.Module, hint="torch.nn.Module")
    member = _elastic_member.current()
    if member is None and not is_initialized():
        # Join the job from the launcher's variables, as bunsan.init() would; a lone
        # process becomes a job of one. A script that forgot init() still does the right thing.
        from bunsan import runtime

        runtime.init()
        member = _elastic_member.current()
    if member is not None:  # bunsan run --min-np: steps (a block algorithm's blocks) commit or drop together
        return model, _distribute_elastic(model, optimizer, member, algorithm, algorithm_options)
    if isinstance(algorithm, str) or algorithm is None:
        options = {"group": group, **algorithm_options}
        algorithm = _algorithms.create(algorithm or "data_parallel", **options)
    elif algorithm_options:
        raise TypeError(
            f"options {sorted(algorithm_options)} are for a name-built algorithm; pass them to {type(algorithm).__name__}(...)"
        )
    check_type("algorithm", algorithm, Algorithm, hint="or a registered name")
    attached = getattr(model, "_bunsan_algorithm", None)
    if attached is not None and getattr(attached, "algorithm", None) is not None:
        raise ValueError("this model was already passed to bunsan.distribute(); build a fresh model or optimizer pair")

    if get_world_size(algorithm.group) > 1 and get_backend(algorithm.group) == "gloo":
        from bunsan import runtime

        runtime.share_host_cores(algorithm.group)  # a script's own group: no more threads than cores
    check_same_model(model, group=algorithm.group)
    if get_world_size(algorithm.group) > 1 and all(p.device.type == "cpu" for p in model.parameters()):
        # What bunsan.init() does for the CPU workers it starts, also for a group the script made itself
        # (torchrun + dist.init_process_group): keep the memory a step frees for the next one. Without
        # it, ResNet-20's exact steps at 2 workers took 4,000-8,800 minor page faults each
        # (docs/experiments/design-notes.md, "Page faults"). BUNSAN_MALLOC_TUNING=0 leaves malloc alone.
        _allocator.tune()
    with torch.no_grad():
        tensors = [p.data for p in model.parameters()] + [b for b in model.buffers()]
        if broadcast:
            broadcast_tensors(tensors, src=global_rank(algorithm.group, 0), group=algorithm.group)
        elif check:
            check_same_values(model, algorithm.group)

    in_optimizer = {p for g in optimizer.param_groups for p in g["params"]}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p in in_optimizer]
    if not named:
        raise ValueError("the optimizer holds none of the model's trainable parameters")
    algorithm.setup(named)
    algorithm.setup_buffers(synced_buffer_modules(model))
    algorithm.attach_optimizer(optimizer)

    attachment = _Attachment(algorithm)
    counter = _SampleCounter(attachment)
    model.register_forward_pre_hook(counter.pre, with_kwargs=True)
    model.register_forward_hook(counter.post, with_kwargs=True)
    model._bunsan_algorithm = attachment  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
    return model, DistributedOptimizer(optimizer, algorithm)


_measure.register_distribute(distribute)  # the probe of fixed costs (Auto, tools/predict.py) builds tiny jobs
