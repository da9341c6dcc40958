"""The parameter server's arrival log is a ring: bounded memory for a job of any length."""

from __future__ import annotations

import pytest
import torch

from bunsan.algorithms.async_sgd import ParameterServer
from bunsan.algorithms.async_sgd.messages import MessageLayout


def _server(kept: int) -> ParameterServer:
    layout = MessageLayout([("w", torch.zeros(3))])
    return ParameterServer(
        layout, [0, 1], {}, staleness_bound=None, staleness_aware=False, timeout_s=5.0, arrivals_kept=kept
    )


def test_arrivals_keep_the_last_k_and_counts_cover_all():
    server = _server(kept=4)
    update = [torch.ones(3)]
    with server.cond:
        for i in range(10):
            server._apply(i % 2, update, samples=2)
    # Nobody pulls, so an update's staleness is the number of updates before it.
    # The last 4 of 10 alternating pushes: worker 0's 4th and 5th, worker 1's 4th and 5th.
    assert server.arrivals == [(0, 4, 6), (1, 4, 7), (0, 5, 8), (1, 5, 9)]
    assert server.version == 10 and server.samples == 20 and server.pushes == {0: 5, 1: 5}
    assert server.staleness_sum == sum(range(10)) and server.staleness_max == 9
    torch.testing.assert_close(server.model[32:44].view(torch.float32), torch.full((3,), 10.0))


def test_arrivals_kept_must_be_positive():
    with pytest.raises(ValueError, match="arrivals_kept"):
        _server(kept=0)
