"""Real training loops on 2 gloo ranks: clipping, GradScaler, unused parameters, buffers, hooks.

Each test trains the same model from the same seed three ways where it applies:
bunsan on 2 ranks (each on its half of the global batch), one in-process model on
the whole global batch, and plain ``DistributedDataParallel`` on the same halves.
The claim of the README's "Your training loop" section is that bunsan equals the
one-process run wherever DDP does.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import bunsan

STEPS = 6
GLOBAL_BATCH = 8
THRESHOLD = 1.0  # samples with x[:, 0] above it go through the branch


class _Net(nn.Module):
    """A body, an optional BatchNorm, a head, a branch used by some samples only, a frozen layer."""

    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.bn = nn.BatchNorm1d(16) if bn else nn.Identity()
        self.head = nn.Linear(16, 3)
        self.branch = nn.Linear(6, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.frozen(self.head(self.bn(self.body(x))))
        mask = x[:, 0] > THRESHOLD
        if bool(mask.any()):  # the branch runs only when a sample needs it
            out = out.clone()
            out[mask] = out[mask] + self.branch(x[mask])
        return out


def _batches(branch: str = "mixed") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches; ``x[rank::2]`` is a rank's half. Which samples reach the branch, per step:

    step 0: none (unused by every rank), 1: only sample 0 (rank 0), 2: only sample 1
    (rank 1), 3: both ranks, then none again, then rank 0 only.
    """
    g = torch.Generator().manual_seed(1)
    out = []
    users = [[], [0], [1], [0, 1, 2, 5], [], [4]] if branch == "mixed" else [[]] * STEPS
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 6, generator=g).clamp(-0.9, 0.9)
        for i in users[step]:
            x[i, 0] = 2.0
        out.append((x, torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)))
    return out


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in [*model.parameters(), *model.buffers()]])


def _make(kind: str, bn: bool = False, lr: float = 0.1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Net(bn)
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return model, torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.01)
    if kind == "plain":
        return model, torch.optim.SGD(params, lr=lr)
    if kind == "adamw":
        return model, torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    raise ValueError(kind)


def _algorithm(name: str) -> bunsan.algorithms.Algorithm:
    if name == "exact":
        return bunsan.DataParallelSGD()
    if name == "fp16":
        return bunsan.DataParallelSGD(compression="fp16")
    if name == "8bit":
        return bunsan.DataParallelSGD(bits=8)
    raise ValueError(name)


# -- the loops ----------------------------------------------------------------------------
def _clip_norm(model, optimizer, x, y, step, state):
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    state.setdefault("norms", []).append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
    optimizer.step()


def _clip_value(model, optimizer, x, y, step, state):
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
    optimizer.step()


def _clip_keep_buffers(model, optimizer, x, y, step, state):
    optimizer.zero_grad(set_to_none=False)
    F.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optimizer.step()


def _plain(model, optimizer, x, y, step, state):
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def _accumulate(model, optimizer, x, y, step, state):
    """Two micro-batches per step, the first inside no_sync() where the optimizer has it."""
    optimizer.zero_grad()
    half = len(x) // 2
    no_sync = getattr(state.get("sync_owner"), "no_sync", None)
    with no_sync() if no_sync is not None else _nothing():
        (F.cross_entropy(model(x[:half]), y[:half]) / 2).backward()
    (F.cross_entropy(model(x[half:]), y[half:]) / 2).backward()
    optimizer.step()


def _accumulate_without_no_sync(model, optimizer, x, y, step, state):
    optimizer.zero_grad()
    half = len(x) // 2
    (F.cross_entropy(model(x[:half]), y[:half]) / 2).backward()
    (F.cross_entropy(model(x[half:]), y[half:]) / 2).backward()
    optimizer.step()


def _eval_inside(model, optimizer, x, y, step, state):
    _plain(model, optimizer, x, y, step, state)
    model.eval()
    with torch.no_grad():
        state.setdefault("eval", []).append(model(torch.linspace(-1, 1, 12).view(2, 6)).tolist())
    model.train()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_LOOPS = {
    "clip_norm": _clip_norm,
    "clip_value": _clip_value,
    "clip_keep_buffers": _clip_keep_buffers,
    "plain": _plain,
    "accumulate": _accumulate,
    "accumulate_without_no_sync": _accumulate_without_no_sync,
    "eval_inside": _eval_inside,
}


def _run(loop, model, optimizer, batches, rank, world_size, *, split: bool, state=None):
    state = {} if state is None else state
    for step, (x, y) in enumerate(batches):
        if split:
            x, y = x[rank::world_size], y[rank::world_size]
        loop(model, optimizer, x, y, step, state)
    return state


def _body_equivalence(rank, world_size, loop, optimizer_kind, algorithm, bn):
    """bunsan on halves vs one process on the global batch vs DDP on halves."""
    batches = _batches()
    loop_fn = _LOOPS[loop]
    reference, ref_opt = _make(optimizer_kind, bn)
    _run(loop_fn, reference, ref_opt, batches, rank, world_size, split=False, state={"sync_owner": None})

    model, optimizer = _make(optimizer_kind, bn)
    model, optimizer = bunsan.distribute(model, optimizer, _algorithm(algorithm))
    state = _run(loop_fn, model, optimizer, batches, rank, world_size, split=True, state={"sync_owner": optimizer})

    ddp_model, ddp_opt = _make(optimizer_kind, bn)
    ddp = DistributedDataParallel(ddp_model, find_unused_parameters=True)
    _run(loop_fn, ddp, ddp_opt, batches, rank, world_size, split=True, state={"sync_owner": ddp})
    return {
        "bunsan": (_flat(model) - _flat(reference)).abs().max().item(),
        "ddp": (_flat(ddp_model) - _flat(reference)).abs().max().item(),
        "params": _flat(model).tolist(),
        "branch_grad_none_after_unused_step": None,
        "norms": state.get("norms"),
        "eval": state.get("eval"),
    }


_EXACT_CASES = [
    ("clip_norm", "sgd"),
    ("clip_value", "sgd"),
    ("clip_keep_buffers", "sgd"),
    ("clip_norm", "adamw"),
    ("plain", "sgd"),  # unused parameters with momentum and weight decay
    ("plain", "adamw"),
    ("accumulate", "sgd"),
    ("accumulate_without_no_sync", "sgd"),
    ("eval_inside", "sgd"),
]


@pytest.mark.parametrize(("loop", "optimizer_kind"), _EXACT_CASES)
def test_real_loops_equal_one_process(workers, loop, optimizer_kind):
    results = workers.run(
        f"{__name__}:_body_equivalence", loop=loop, optimizer_kind=optimizer_kind, algorithm="exact", bn=False
    )
    for result in results:
        assert result["ddp"] <= 1e-5, f"the reference itself is off: DDP differs by {result['ddp']}"
        assert result["bunsan"] <= 1e-5
    assert results[0]["params"] == results[1]["params"]  # replicas bit-identical
    if results[0]["eval"] is not None:
        assert results[0]["eval"] == results[1]["eval"]


# 8 bits with error feedback and momentum 0.9 drift further from exact SGD in 6 steps than
# fp16 does (measured 0.05 without clipping); the claim here is about where the decoded
# average is seen, the codecs' accuracy is tested in test_quantized.py.
@pytest.mark.parametrize(("algorithm", "tolerance"), [("fp16", 2e-3), ("8bit", 0.1)])
@pytest.mark.parametrize("loop", ["clip_norm", "clip_keep_buffers", "plain"])
def test_compressed_exchange_sees_the_decoded_average(workers, algorithm, tolerance, loop):
    """Half-precision and 8-bit exchanges: clipping acts on the (decoded) average, replicas agree."""
    results = workers.run(
        f"{__name__}:_body_equivalence", loop=loop, optimizer_kind="sgd", algorithm=algorithm, bn=False
    )
    for result in results:
        assert result["bunsan"] <= tolerance
    assert results[0]["params"] == results[1]["params"]


# -- gradients seen between backward and step -------------------------------------------
def _body_grad_after_backward(rank, world_size, algorithm):
    x, y = _batches()[3]
    reference, _ = _make("sgd")
    F.cross_entropy(reference(x), y).backward()
    model, optimizer = _make("sgd")
    model, optimizer = bunsan.distribute(model, optimizer, _algorithm(algorithm))
    F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
    seen = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    optimizer.step()
    assert sorted(seen) == sorted(expected)
    return max((seen[n] - expected[n]).abs().max().item() for n in seen)


@pytest.mark.parametrize(("algorithm", "tolerance"), [("exact", 1e-6), ("fp16", 1e-3), ("8bit", 2e-2)])
def test_grad_after_backward_is_the_global_average(workers, algorithm, tolerance):
    for diff in workers.run(f"{__name__}:_body_grad_after_backward", algorithm=algorithm):
        assert diff <= tolerance


# -- unused parameters ---------------------------------------------------------------------
def _body_unused(rank, world_size, optimizer_kind):
    batches = _batches()
    model, optimizer = _make(optimizer_kind)
    model, optimizer = bunsan.distribute(model, optimizer)
    branch_before = model.branch.weight.detach().clone()
    x, y = batches[0]  # no sample of the global batch reaches the branch
    optimizer.zero_grad()
    F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
    grad_none = model.branch.weight.grad is None and model.branch.bias.grad is None
    frozen_none = model.frozen.weight.grad is None
    optimizer.step()
    unmoved = torch.equal(model.branch.weight, branch_before)
    x, y = batches[1]  # only rank 0's half reaches the branch
    optimizer.zero_grad()
    F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
    some_grad = model.branch.weight.grad is not None and model.branch.weight.grad.abs().sum().item() > 0
    optimizer.step()
    return grad_none, frozen_none, unmoved, some_grad


@pytest.mark.parametrize("optimizer_kind", ["sgd", "adamw"])
def test_a_parameter_no_rank_used_keeps_grad_none_and_does_not_move(workers, optimizer_kind):
    for grad_none, frozen_none, unmoved, some_grad in workers.run(
        f"{__name__}:_body_unused", optimizer_kind=optimizer_kind
    ):
        assert grad_none and frozen_none and unmoved
        assert some_grad  # used by rank 0 only: both ranks get the average (rank 1 too)


# -- GradScaler --------------------------------------------------------------------------
def _body_grad_scaler(rank, world_size, dtype, inf_step):
    """The AMP loop of the PyTorch docs, bunsan vs DDP; optionally one rank's loss is inf at one step."""
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    def train(model, optimizer, owner_model):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        scales = []
        for step, (x, y) in enumerate(_batches()):
            x, y = x[rank::world_size], y[rank::world_size]
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=amp_dtype):
                loss = F.cross_entropy(owner_model(x), y)
            if step == inf_step and rank == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(owner_model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    model, optimizer = _make("sgd")
    model, optimizer = bunsan.distribute(model, optimizer)
    scales = train(model, optimizer, model)
    ddp_model, ddp_opt = _make("sgd")
    ddp = DistributedDataParallel(ddp_model, find_unused_parameters=True)
    ddp_scales = train(ddp_model, ddp_opt, ddp)
    finite = bool(torch.isfinite(_flat(model)).all())
    return (_flat(model) - _flat(ddp_model)).abs().max().item(), scales, ddp_scales, finite, _flat(model).tolist()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("inf_step", [None, 2], ids=["finite", "inf-on-rank-1"])
def test_grad_scaler_equals_ddp(workers, dtype, inf_step):
    results = workers.run(f"{__name__}:_body_grad_scaler", dtype=dtype, inf_step=inf_step)
    for diff, scales, ddp_scales, finite, _ in results:
        assert finite
        assert diff <= 1e-5
        assert scales == ddp_scales
        if inf_step is not None:  # every rank skipped that step and lowered its scale
            assert scales[inf_step] == scales[inf_step - 1] / 2
    assert results[0][1] == results[1][1]
    assert results[0][4] == results[1][4]


# -- buffers -------------------------------------------------------------------------------
def _body_batchnorm(rank, world_size):
    batches = _batches("none")
    reference, ref_opt = _make("sgd", bn=True)
    model, optimizer = _make("sgd", bn=True)
    model, optimizer = bunsan.distribute(model, optimizer)
    outputs, mean_diff = [], None
    for x, y in batches:
        for m, opt, xs, ys in (
            (reference, ref_opt, x, y),
            (model, optimizer, x[rank::world_size], y[rank::world_size]),
        ):
            opt.zero_grad()
            F.cross_entropy(m(xs), ys).backward()
            opt.step()
        if mean_diff is None:
            # After one step (same inputs to the BatchNorm) the mean of the ranks' running
            # means is the running mean one process keeps over the whole batch. Later the
            # models differ: each rank normalized with its own half's statistics.
            mean_diff = (model.bn.running_mean - reference.bn.running_mean).abs().max().item()
        model.eval()
        with torch.no_grad():
            outputs.append(model(x).tolist())
        model.train()
    return (
        model.bn.running_mean.tolist(),
        model.bn.running_var.tolist(),
        outputs,
        mean_diff,
        int(model.bn.num_batches_tracked),
    )


def test_batchnorm_statistics_stay_equal_across_ranks(workers):
    (m0, v0, out0, diff0, n0), (m1, v1, out1, diff1, n1) = workers.run(f"{__name__}:_body_batchnorm")
    assert m0 == m1 and v0 == v1 and n0 == n1 == STEPS
    assert out0 == out1  # evaluation gives the same answer on every rank
    # The mean of the ranks' running means is the one-process running mean on the whole batch.
    assert diff0 <= 1e-6 and diff1 <= 1e-6


def _body_sync_batchnorm_kept(rank, world_size):
    model, optimizer = _make("sgd", bn=True)
    model = bunsan.nn.convert_sync_batchnorm(model)
    model, optimizer = bunsan.distribute(model, optimizer)
    for x, y in _batches("none"):
        optimizer.zero_grad()
        F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
    return model.bn.running_mean.tolist(), optimizer.algorithm.buffer_sync


def test_sync_batchnorm_statistics_are_not_averaged_again(workers):
    (m0, sync0), (m1, sync1) = workers.run(f"{__name__}:_body_sync_batchnorm_kept")
    assert m0 == m1
    assert sync0 is None and sync1 is None  # SyncBatchNorm's statistics are global already: nothing to keep


# -- sample counting -------------------------------------------------------------------------
def _body_metric_forward(rank, world_size, algorithm, with_metric):
    options = {"block_size": 8} if algorithm != "data_parallel" else {}
    model, optimizer = _make("sgd")
    model, optimizer = bunsan.distribute(model, optimizer, algorithm, **options)
    for x, y in _batches("none"):
        x, y = x[rank::world_size], y[rank::world_size]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if with_metric and rank == 0:
            model(x).argmax(1)  # a train-mode forward whose output is never back-propagated
        optimizer.step()
    optimizer.join()
    return _flat(model).tolist(), optimizer.algorithm.samples, optimizer.algorithm.local_samples


@pytest.mark.parametrize("algorithm", ["data_parallel", "block_momentum", "model_averaging"])
def test_a_metric_forward_counts_no_samples(workers, algorithm):
    plain = workers.run(f"{__name__}:_body_metric_forward", algorithm=algorithm, with_metric=False)
    metric = workers.run(f"{__name__}:_body_metric_forward", algorithm=algorithm, with_metric=True)
    assert plain == metric
    assert plain[0][2] == STEPS * GLOBAL_BATCH // 2


# -- the model and the optimizer stay ordinary torch objects ------------------------------
def _body_objects(rank, world_size):
    model, optimizer = _make("sgd")
    torch_opt = optimizer
    model, optimizer = bunsan.distribute(model, optimizer)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x, y = _batches("none")[0]
    x, y = x[rank::world_size], y[rank::world_size]
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    scheduler.step()
    # torch.save(model) and deepcopy work; the copy is independent of the job.
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)
    pending = optimizer.algorithm._pending_samples
    twin(x).sum().backward()  # a copy counts into nothing, exchanges nothing
    loaded(x).sum().backward()
    untouched = optimizer.algorithm._pending_samples == pending
    same = torch.equal(_flat(twin), _flat(model)) and torch.equal(_flat(loaded), _flat(model))
    # The optimizer's state_dict is torch's format: a plain optimizer loads it.
    state = optimizer.state_dict()
    plain_model, plain_opt = _make("sgd")
    plain_opt.load_state_dict(state)
    loaded_lr = plain_opt.param_groups[0]["lr"]
    momentum_ok = all(
        torch.equal(plain_opt.state[q]["momentum_buffer"], torch_opt.state[p]["momentum_buffer"])
        for p, q in zip(
            [p for p in model.parameters() if p.requires_grad and p.grad is not None],
            [q for q in plain_model.parameters() if q.requires_grad],
        )
        if p in torch_opt.state
    )
    return calls, untouched, same, loaded_lr, math.isclose(optimizer.param_groups[0]["lr"], 0.05), momentum_ok


def test_model_and_optimizer_stay_torch_objects(workers):
    for calls, untouched, same, loaded_lr, lr_ok, momentum_ok in workers.run(f"{__name__}:_body_objects"):
        assert calls == ["pre", "post"]
        assert untouched and same
        assert loaded_lr == pytest.approx(0.05) and lr_ok
        assert momentum_ok


# -- block algorithms: clipping acts on the local step ------------------------------------
def _body_model_averaging_clip(rank, world_size):
    """Model averaging after every minibatch with plain SGD = the mean of the locally clipped steps."""
    batches = _batches()
    reference, _ = _make("plain")
    lr = 0.1
    for x, y in batches:
        grads = []
        for r in range(world_size):
            reference.zero_grad()
            F.cross_entropy(reference(x[r::world_size]), y[r::world_size]).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            grads.append({n: (p.grad.clone() if p.grad is not None else None) for n, p in reference.named_parameters()})
        with torch.no_grad():
            for n, p in reference.named_parameters():
                used = [g[n] for g in grads if g[n] is not None]
                if used:
                    p -= lr * sum(used) / world_size
    model, optimizer = _make("plain")
    model, optimizer = bunsan.distribute(model, optimizer, bunsan.ModelAveragingSGD(block_size=GLOBAL_BATCH // 2))
    _run(_clip_norm, model, optimizer, batches, rank, world_size, split=True)
    return (_flat(model) - _flat(reference)).abs().max().item()


def test_block_algorithm_clips_the_local_gradient(workers):
    for diff in workers.run(f"{__name__}:_body_model_averaging_clip"):
        assert diff <= 1e-6


def _body_block_warm_start_clip(rank, world_size, algorithm):
    """During the warm start the block algorithms average gradients in backward: clipping sees the average."""
    batches = _batches()
    reference, ref_opt = _make("sgd")
    _run(_clip_norm, reference, ref_opt, batches, rank, world_size, split=False)
    model, optimizer = _make("sgd")
    options = {"block_size": 8, "warm_start": STEPS * GLOBAL_BATCH}
    model, optimizer = bunsan.distribute(model, optimizer, algorithm, **options)
    _run(_clip_norm, model, optimizer, batches, rank, world_size, split=True)
    return (_flat(model) - _flat(reference)).abs().max().item()


@pytest.mark.parametrize("algorithm", ["block_momentum", "model_averaging"])
def test_block_warm_start_equals_one_process_with_clipping(workers, algorithm):
    for diff in workers.run(f"{__name__}:_body_block_warm_start_clip", algorithm=algorithm):
        assert diff <= 1e-5


def _body_async_clip(rank, world_size):
    model, optimizer = _make("plain", lr=0.05)
    model, optimizer = bunsan.distribute(model, optimizer, bunsan.AsyncSGD(timeout_s=30))
    _run(_clip_norm, model, optimizer, _batches(), rank, world_size, split=True)
    optimizer.join()
    return _flat(model).tolist()


def test_async_with_clipping_ends_with_equal_finite_replicas(workers):
    first, second = workers.run(f"{__name__}:_body_async_clip")
    assert first == second and all(math.isfinite(v) for v in first)


# -- activation checkpointing ------------------------------------------------------------
class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        return self.c(h)


def _body_checkpointing(rank, world_size, reentrant):
    torch.manual_seed(0)
    reference = _Checkpointed(reentrant)
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    _run(_clip_norm, reference, ref_opt, _batches("none"), rank, world_size, split=False)
    _run(_clip_norm, model, optimizer, _batches("none"), rank, world_size, split=True)
    return (_flat(model) - _flat(reference)).abs().max().item()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_keeps_the_exchange_exact(workers, reentrant):
    for diff in workers.run(f"{__name__}:_body_checkpointing", reentrant=reentrant):
        assert diff <= 1e-5


# -- sample counting when the loss is not taken from the model's output -------------------
class _Probe(nn.Module):
    """Returns a detached summary; the loss comes from an activation kept on the side."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept = self.layer(x)
        return self.kept.detach()


def _body_intermediate_loss(rank, world_size):
    torch.manual_seed(0)
    model = _Probe()
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in _batches("none")[:3]:
        optimizer.zero_grad()
        model(x[rank::world_size])
        F.cross_entropy(model.kept, y[rank::world_size]).backward()
        optimizer.step()
    return optimizer.algorithm.samples, optimizer.algorithm.local_samples


def test_samples_count_when_the_loss_comes_from_an_intermediate_tensor(workers):
    for samples, local in workers.run(f"{__name__}:_body_intermediate_loss"):
        assert (samples, local) == (3 * GLOBAL_BATCH, 3 * GLOBAL_BATCH // 2)


# -- broadcast=False ----------------------------------------------------------------------
def _body_no_broadcast(rank, world_size, same, check):
    torch.manual_seed(0 if same else rank)
    model = _Net()
    try:
        bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), broadcast=False, check=check)
    except bunsan.errors.ModelMismatchError as error:
        return str(error)
    return None


def test_broadcast_false_checks_that_ranks_start_equal(workers):
    assert workers.run(f"{__name__}:_body_no_broadcast", same=True, check=True) == [None, None]
    messages = workers.run(f"{__name__}:_body_no_broadcast", same=False, check=True)
    assert all(m is not None and "different values on different ranks" in m for m in messages)
    assert workers.run(f"{__name__}:_body_no_broadcast", same=False, check=False) == [None, None]


# -- a nanoGPT-style loop, as written for DDP ------------------------------------------------
class _TinyGPT(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 32, block: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t))
        logits = self.head(self.blocks(h, mask=self.mask[:t, :t], is_causal=True))
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _body_nanogpt(rank, world_size, wrap):
    """nanoGPT's train loop shape: AdamW with decay groups, bf16 autocast, accumulation by
    ``require_backward_grad_sync``, clipping, a cosine learning rate set by hand."""
    torch.manual_seed(0)
    raw = _TinyGPT()
    decay = [p for n, p in raw.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in raw.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95)
    )
    if wrap == "bunsan":
        model, optimizer = bunsan.distribute(raw, optimizer)
    else:
        model = DistributedDataParallel(raw)
    g = torch.Generator().manual_seed(3)
    accumulation, iters = 2, 5
    for it in range(iters):
        lr = 1e-3 * 0.5 * (1 + math.cos(math.pi * it / iters))
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(accumulation):
            x = torch.randint(0, 16, (2 * world_size, 8), generator=g)[rank::world_size]
            y = torch.roll(x, -1, dims=1)
            model.require_backward_grad_sync = micro == accumulation - 1
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sent = optimizer.algorithm.stats()["collectives"] if wrap == "bunsan" else None
    return _flat(raw).tolist(), sent


def test_nanogpt_style_loop_equals_ddp(workers):
    bunsan_runs = workers.run(f"{__name__}:_body_nanogpt", wrap="bunsan")
    ddp_runs = workers.run(f"{__name__}:_body_nanogpt", wrap="ddp")
    for (ours, collectives), (theirs, _) in zip(bunsan_runs, ddp_runs):
        assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5
        assert collectives == 5  # one exchange per iteration: the first micro-step sent nothing
    assert bunsan_runs[0][0] == bunsan_runs[1][0]


# -- what a loop sees in p.grad while quantizing with local momentum ----------------------
def _body_grad_norm_seen_while_quantizing(rank, world_size, kind):
    """Per step: the norm clip_grad_norm_ measures on this rank, and the global batch's gradient norm at the same point.

    The reference gradient is taken at this job's own parameters (1-bit Adam freezes the
    variance, so its trajectory differs from AdamW's by design).
    """
    batches = _batches("none")
    reference, _ = _make(kind)
    model, optimizer = _make(kind)
    warm = GLOBAL_BATCH if kind == "adamw" else 0  # 1-bit Adam's exact warm-up: one step
    model, optimizer = bunsan.distribute(model, optimizer, bunsan.DataParallelSGD(bits=16, warm_start=warm))
    ours, theirs = [], []
    for x, y in batches:
        reference.load_state_dict(model.state_dict())
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        theirs.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e6)))  # measured, not active
        optimizer.zero_grad()
        F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
        ours.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)))
        before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        optimizer.step()
        if kind == "sgd":  # the optimizer stepped along the momentum; p.grad is the gradient again, as in one process
            for p, g in zip(model.parameters(), before, strict=True):
                assert (p.grad is None and g is None) or torch.equal(p.grad, g)
    return ours, theirs


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_clipping_sees_the_mean_gradient_while_quantizing_with_local_momentum(workers, kind):
    """p.grad between backward and step is the global mean gradient, not the exchanged momentum.

    With local momentum the workers exchange a momentum (SGD: up to 1 / (1 - 0.9) = 10x a
    gradient; 1-bit Adam: the preconditioned moment, of order one per coordinate); shown as
    it is, clip_grad_norm_ measured that and clipped far too much (issue 16).
    """
    for ours, theirs in workers.run(f"{__name__}:_body_grad_norm_seen_while_quantizing", kind=kind):
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert abs(a - b) <= 0.02 * b, (step, ours, theirs)  # 16 bits: about 0.3% here


# -- GradScaler and clipping while quantizing with local momentum --------------------------
def _body_scaled_and_clipped_while_quantizing(rank, world_size, scale, clip, nesterov):
    """Final parameters of 2 ranks at 16 bits (local momentum) and of one process on the global batch."""

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov)

    reference, reference_opt = make()
    model, optimizer = make()
    model, optimizer = bunsan.distribute(model, optimizer, bunsan.DataParallelSGD(bits=16))
    scalers = [torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10**6) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
        runs = ((reference, reference_opt, x, y), (model, optimizer, x[rank::world_size], y[rank::world_size]))
        for (m, opt, xs, ys), scaler in zip(runs, scalers, strict=True):
            opt.zero_grad()
            scaler.scale(F.cross_entropy(m(xs), ys)).backward()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            scaler.step(opt)
            scaler.update()
    return max(float((a - b).abs().max()) for a, b in zip(reference.parameters(), model.parameters()))


@pytest.mark.parametrize(("scale", "clip", "nesterov"), [(256.0, 0.0, False), (1.0, 0.1, False), (256.0, 0.1, True)])
def test_gradscaler_and_clipping_while_quantizing_equal_one_process(workers, scale, clip, nesterov):
    """The workers' momentum follows what the user did to p.grad (unscale_, clip_grad_norm_).

    Before: GradScaler's scale 256 ended 0.38 away from one process (the scaled gradient
    stayed in the workers' momentum), clipping 0.03 (clipped amounts came back later).
    """
    for diff in workers.run(
        f"{__name__}:_body_scaled_and_clipped_while_quantizing", scale=scale, clip=clip, nesterov=nesterov
    ):
        assert diff < 1e-5, diff
