"""Cost per collective of bunsan's out-of-step bookkeeping (bunsan.comm.inspector) on the fast path.

    python -m tests.launch.edges_overhead

Times ``started`` plus ``begin_wait``/``end_wait``, what every collective adds,
against an empty loop. Compare with a collective's own time (tens of
microseconds for a tiny all-reduce on loopback, milliseconds for a gradient bucket).
"""

from __future__ import annotations

import time

import torch

from bunsan.comm import inspector


class _Algorithm:
    step = 3


def main(calls: int = 200_000) -> None:
    tensor = torch.zeros(1000)
    algorithm = _Algorithm()  # held: the registry is weak
    inspector.count_steps_of(algorithm)
    for label in ("started + begin_wait/end_wait", "empty loop"):
        start = time.perf_counter()
        for _ in range(calls):
            if label != "empty loop":
                inspector.started("all_reduce", None, tensor)
                inspector.end_wait(inspector.begin_wait())
        print(f"{label}: {(time.perf_counter() - start) / calls * 1e6:.2f} us per collective")


if __name__ == "__main__":
    main()
