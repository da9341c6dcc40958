"""bunsan.init() in this process: a job of one worker, idempotent, clean finalize."""

from __future__ import annotations

import pytest
import torch

import bunsan
from bunsan.comm import all_reduce, get_world_size


def test_init_is_idempotent_and_finalize_resets():
    info = bunsan.init()
    assert bunsan.init() is info
    assert (bunsan.rank(), bunsan.size(), bunsan.local_rank(), bunsan.local_size()) == (0, 1, 0, 1)
    assert bunsan.is_main() and bunsan.is_initialized() and bunsan.device() == torch.device("cpu")
    t = torch.ones(3)
    all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0] and get_world_size() == 1
    bunsan.finalize()
    bunsan.finalize()  # twice is fine
    assert not bunsan.is_initialized()


def test_session_context_manager():
    with bunsan.session() as info:
        assert info.world_size == 1 and bunsan.is_initialized()
    assert not bunsan.is_initialized()


def test_lone_process_trains_through_distribute():
    with bunsan.session():
        model = torch.nn.Linear(3, 1)
        model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 3)).pow(2).mean().backward()
            optimizer.step()
        assert optimizer.algorithm.stats()["samples"] == 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"backend": "mpi"}, "backend must be"), ({"timeout_s": 0}, "timeout_s must be a number > 0")],
)
def test_bad_init_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bunsan.init(**kwargs)
    assert not bunsan.is_initialized()


def test_bad_algorithm_arguments_are_one_sentence():
    with pytest.raises(ValueError, match="bits must be 32"):
        bunsan.DataParallelSGD(bits=0)
    with pytest.raises(ValueError, match="compression must be"):
        bunsan.DataParallelSGD(compression="int8")
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        bunsan.algorithms.create("nope")


def test_distribute_refuses_wrong_types_and_reuse():
    with bunsan.session():
        model = torch.nn.Linear(2, 2)
        with pytest.raises(TypeError, match=r"torch.nn.Module"):
            bunsan.distribute("model", torch.optim.SGD(model.parameters(), lr=0.1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        bunsan.distribute(model, opt)
        with pytest.raises(ValueError, match="already passed"):
            bunsan.distribute(model, opt)
        other = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match="none of the model's trainable parameters"):
            bunsan.distribute(other, torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))


def test_distribute_without_init_joins_a_job_of_one():
    import torch.nn.functional as F

    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    model = torch.nn.Linear(3, 2)
    reference = torch.nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    model, optimizer = bunsan.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))  # no bunsan.init()
    assert bunsan.is_initialized() and bunsan.size() == 1
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for m, opt in ((model, optimizer), (reference, ref_opt)):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    torch.testing.assert_close(model.weight, reference.weight)  # a job of one is plain SGD
