"""Drop-in pieces on 2 gloo ranks: Partition in a plain DataLoader, Horovod's broadcasts, evaluate, print."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import bunsan
from bunsan.data import Partition


def _body_partition_in_a_plain_dataloader(rank: int, world_size: int) -> list[list[int]]:
    data = TensorDataset(torch.arange(21))
    sampler = Partition(data, shuffle=True, seed=1)  # rank and size from the process group
    assert (sampler.rank, sampler.num_replicas) == (rank, world_size)
    plain = DataLoader(data, batch_size=4, sampler=sampler)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append([int(i) for (batch,) in plain for i in batch])
    return epochs


def test_partition_in_a_plain_dataloader_shards_every_epoch(workers):
    ranks = workers.run(f"{__name__}:_body_partition_in_a_plain_dataloader")
    for epoch in range(2):
        both = ranks[0][epoch] + ranks[1][epoch]
        assert len(ranks[0][epoch]) == len(ranks[1][epoch]) == 11  # ceil(21 / 2): one sample padded
        assert set(both) == set(range(21)) and len(both) == 22
    assert ranks[0][0] != ranks[0][1]


def _body_broadcast_parameters(rank: int, world_size: int, form: str) -> list[float]:
    torch.manual_seed(10 + rank)  # different weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(rank))
    params = {"module": model, "state_dict": model.state_dict(), "named": model.named_parameters()}[form]
    bunsan.broadcast_parameters(params, root_rank=1)
    assert not any(p.grad is not None for p in model.parameters())
    values = [p.detach() for p in model.parameters()]
    if form != "named":  # named_parameters() holds parameters only, no buffers
        values.append(model[1].running_mean)
    return torch.cat([v.reshape(-1) for v in values]).tolist()


@pytest.mark.parametrize("form", ["module", "state_dict", "named"])
def test_broadcast_parameters_gives_every_rank_the_roots_values(workers, form):
    ranks = workers.run(f"{__name__}:_body_broadcast_parameters", form=form)
    assert ranks[0] == ranks[1]
    torch.manual_seed(11)  # rank 1's weights, built as rank 1 built them
    expected = torch.nn.Linear(3, 4)
    assert ranks[0][:12] == expected.weight.reshape(-1).tolist()
    if form != "named":
        assert ranks[0][-4:] == [1.0] * 4  # rank 1's running mean


def _body_broadcast_optimizer_state(rank: int, world_size: int, kind: str) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    if kind == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 + rank, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == 0:  # only the root has stepped: the others have no state yet (Horovod's case after a restore)
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(5, 3)).square().sum().backward()
            optimizer.step()
    bunsan.broadcast_optimizer_state(optimizer, root_rank=0)
    state = optimizer.state_dict()
    tensors = {f"{i}.{k}": v.reshape(-1).tolist() for i, s in state["state"].items() for k, v in s.items()}
    return state["param_groups"][0]["lr"], tensors


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_broadcast_optimizer_state_creates_and_copies_the_roots_state(workers, kind):
    (lr0, state0), (lr1, state1) = workers.run(f"{__name__}:_body_broadcast_optimizer_state", kind=kind)
    assert lr0 == lr1
    assert state0 and state0 == state1


def _body_evaluate(rank: int, world_size: int, n: int) -> tuple[dict, dict]:
    torch.manual_seed(0)
    x, y = torch.randn(n, 5), torch.randint(0, 3, (n,))
    model = torch.nn.Linear(5, 3)
    whole = bunsan.evaluate(model, TensorDataset(x, y), ["accuracy", "error"], loss_fn=F.cross_entropy, batch_size=4)
    # The hand-written loop over this rank's shard, then one all-reduce of its sums.
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for i in range(rank, n, world_size):
            out = model(x[i : i + 1])
            loss_sum += float(F.cross_entropy(out, y[i : i + 1], reduction="sum"))
            correct += int(out.argmax(1).item() == y[i].item())
            seen += 1
    totals = bunsan.all_reduce_metrics({"loss": loss_sum, "correct": correct, "samples": seen})
    return whole, totals


@pytest.mark.parametrize("n", [10, 13])
def test_evaluate_on_shards_equals_one_process_on_everything(workers, n):
    ranks = workers.run(f"{__name__}:_body_evaluate", n=n)
    (whole0, totals0), (whole1, totals1) = ranks
    assert whole0 == whole1 and totals0 == totals1
    torch.manual_seed(0)
    x, y = torch.randn(n, 5), torch.randint(0, 3, (n,))
    model = torch.nn.Linear(5, 3)
    with torch.no_grad():
        out = model(x)
    accuracy = float((out.argmax(1) == y).double().mean())
    assert whole0["samples"] == n == totals0["samples"]
    assert whole0["accuracy"] == pytest.approx(accuracy) == totals0["correct"] / n
    assert whole0["error"] == pytest.approx(1 - accuracy)
    assert whole0["loss"] == pytest.approx(float(F.cross_entropy(out, y)), rel=1e-6)
    assert totals0["loss"] / n == pytest.approx(whole0["loss"], rel=1e-6)


def _body_all_reduce_metrics_names_differ(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="different names"):
        bunsan.all_reduce_metrics({"loss": 1.0, "correct" if rank == 0 else "right": 2})


def test_all_reduce_metrics_refuses_different_names_on_every_rank(workers):
    workers.run(f"{__name__}:_body_all_reduce_metrics_names_differ")


def _body_print(rank: int, world_size: int) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bunsan.print(f"rank {rank}")
        bunsan.print(f"all {rank}", rank=None)
    return out.getvalue()


def test_print_on_rank_zero_only(workers):
    assert workers.run(f"{__name__}:_body_print") == ["rank 0\nall 0\n", "all 1\n"]
