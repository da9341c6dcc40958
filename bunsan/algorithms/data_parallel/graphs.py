"""The striped exchange's codec calls on a GPU, each replayed as one CUDA graph.

On a GPU each codec call (:class:`bunsan.compression.segments.SegmentCodec`) launches its
kernels one by one from Python: tens of them for an encode with error feedback, each some
microseconds of host time and a gap on the device, so a call costs 0.6-0.9 ms on an H100
whatever its size (docs/experiments/plan.md, "On a GPU"), and a ResNet-20 step makes four to eight of
them against a 7.6 ms step. A CUDA graph records a call's kernels once and launches them
all again with one host call (NVIDIA, "CUDA Graphs", CUDA C++ Programming Guide; PyTorch's
``torch.cuda.CUDAGraph``).

A graph holds the addresses of the tensors it read and wrote, so it is valid only for the
same tensors: the exchange's buffers are allocated once per bucket
(:class:`bunsan.algorithms.data_parallel.stripes.Stripes`) and the gradient bucket is the
same storage every step, which is what makes its calls replayable. :class:`CapturedCalls`
keys each call by its site, the Python values that shape it and the addresses, shapes and
dtypes of its tensors, and

* runs the first call of a key eagerly: it does the step's work and warms up what a capture
  cannot start (the codec's caches, the bit tables on the device, library handles);
* captures the second (a capture records and does not run, so the call's in-place updates,
  the residuals, happen once: by the replay that follows at once);
* replays from then on.

The calls write only into the tensors they were given (payloads, residuals, the bucket) and
return nothing, so no graph's output outlives it, and all of a device's graphs share one
memory pool: what a graph allocates inside is scratch, and the exchange replays its graphs
one after another on one stream, so the pool needs only the largest call's scratch, not the
sum over buckets. A capture that fails (an operation the graph cannot hold) warns once and
leaves the calls eager for the process; ``BUNSAN_CODEC_GRAPHS=0`` turns capture off, ``=1``
keeps it on where it would be (a CUDA device; there is nothing to replay on CPU).

It lives beside the exchange, not in :mod:`bunsan.compression`: the graphs are the exchange's
state (keyed by its buffers), and the codecs there stay stateless (DESIGN.md).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["CapturedCalls", "graphs_enabled", "run_call"]

_POOLS: dict[torch.device, Any] = {}  # per device: the memory pool all the codec's graphs share


def graphs_enabled(device: torch.device) -> bool:
    """Whether the codec's calls are captured as CUDA graphs on ``device``: on a CUDA device unless
    ``BUNSAN_CODEC_GRAPHS=0``."""
    setting = os.environ.get("BUNSAN_CODEC_GRAPHS", "")
    if setting not in ("", "0", "1"):
        raise ValueError(f"BUNSAN_CODEC_GRAPHS must be 0 or 1, got {setting!r}")
    return device.type == "cuda" and setting != "0"


def _pool(device: torch.device) -> Any:
    if device not in _POOLS:
        _POOLS[device] = torch.cuda.graph_pool_handle()
    return _POOLS[device]


class CapturedCalls:
    """Run each call as a CUDA graph from its second time on (see the module docstring).

    Args:
        device: the CUDA device the calls run on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seen: set[Hashable] = set()
        self._replays: dict[Hashable, Callable[[], object]] = {}
        self.failed: str | None = None  # why capture stopped, after a failed one
        self.captured = 0  # graphs made

    def __call__(self, site: Hashable, call: Callable[[], object], tensors: Sequence[Tensor | None]) -> None:
        """Do ``call()``, which must read and write only ``tensors`` (beside constants of its own) and
        return nothing; ``site`` names the call and the Python values it depends on."""
        key = (site, tuple(None if t is None else (t.data_ptr(), t.shape, t.dtype) for t in tensors))
        replay = self._replays.get(key)
        if replay is not None:
            replay()
            return
        if self.failed is not None or key not in self._seen:
            self._seen.add(key)
            call()
            return
        try:
            replay = self._capture(call)
        except Exception as error:  # an operation a graph cannot hold: eager from now on
            self.failed = f"{type(error).__name__}: {error}".splitlines()[0]
            warnings.warn(
                f"bunsan: the quantized exchange's codec could not be captured as a CUDA graph "
                f"({self.failed}); its calls stay eager (set BUNSAN_CODEC_GRAPHS=0 to skip the attempt)",
                RuntimeWarning,
                stacklevel=3,
            )
            call()
            return
        self._replays[key] = replay
        self.captured += 1
        replay()

    def _capture(self, call: Callable[[], object]) -> Callable[[], object]:
        """Record ``call`` (without running it) and return what replays it."""
        graph = torch.cuda.CUDAGraph()
        with (
            torch.cuda.device(self.device),
            torch.cuda.graph(graph, pool=_pool(self.device), capture_error_mode="thread_local"),
        ):
            call()
        return graph.replay


def run_call(graphs: CapturedCalls | None, site: Hashable, call: Callable[[], object], *tensors: Tensor | None) -> None:
    """Do ``call`` through ``graphs`` (as a CUDA graph from its second time on), or now where ``graphs``
    is ``None`` (a CPU, or capture turned off)."""
    if graphs is None:
        call()
    else:
        graphs(site, call, tensors)
