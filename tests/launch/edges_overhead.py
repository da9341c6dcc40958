"""Cost per collective of bunsan's out-of-step bookkeeping (bunsan.comm.inspector) on the fast path.

    python -m tests.launch.edges_overhead

Times ``started`` plus ``begin_wait``/``end_wait``, what every collective adds,
against an empty loop. Compare with a collective's own time (tens of
microseconds for a tiny all-reduce on loopback, milliseconds for a gradient bucket).
"""

import time

import torch

from bunsan.comm import inspector
t = torch.zeros(1000)


class _Algorithm:
    step = 3


algorithm = _Algorithm()
inspector.count_steps_of(algorithm)
n = 200000
for label in ("started+begin/end_wait", "baseline loop"):
    t0 = time.perf_counter()
    for _ in range(n):
        if label != "baseline loop":
            inspector.started("all_reduce", None, t)
            w = inspector.begin_wait()
            inspector.end_wait(w)
    dt = (time.perf_counter() - t0) / n * 1e6
    print(f"{label}: {dt:.2f} us per collective")
