"""Model parallelism across ranks: layer pipelines and hybrid (model x data parallel) layouts.

* :func:`pipeline`: a model cut into stages, one per rank, with GPipe or 1F1B
  microbatch schedules (on :mod:`torch.distributed.pipelining`).
* :func:`hybrid_groups`: model-parallel groups of ``k`` ranks and data-parallel
  groups across them, for model-parallel layers combined with any data-parallel
  algorithm.

Layers split within a group live in :mod:`bunsan.nn`.
"""

from __future__ import annotations

from bunsan.parallel.hybrid import HybridGroups, hybrid_groups, rank_grid
from bunsan.parallel.pipeline import Pipeline, pipeline

__all__ = ["HybridGroups", "Pipeline", "hybrid_groups", "pipeline", "rank_grid"]
