"""plan_stripes: whole per-parameter chunks dealt out to the ranks (pure)."""

from __future__ import annotations

import pytest

from bunsan.algorithms.data_parallel import plan_stripes


@pytest.mark.parametrize(
    ("numels", "chunk", "world"), [([32, 3072, 10], 512, 2), ([5], 512, 4), ([1000, 1, 700], 256, 3), ([4096], 512, 8)]
)
def test_segments_cover_every_element_once_inside_one_parameter(numels, chunk, world):
    stripes = plan_stripes(numels, chunk, world)
    assert len(stripes) == world
    covered = sorted((lo, length) for stripe in stripes for lo, length in stripe)
    position = 0
    for lo, length in covered:  # contiguous, no overlap, no gap
        assert lo == position and length > 0
        position += length
    assert position == sum(numels)
    bounds = [sum(numels[:i]) for i in range(len(numels) + 1)]
    for lo, length in covered:  # no segment crosses a parameter boundary
        assert any(b <= lo and lo + length <= bounds[i + 1] for i, b in enumerate(bounds[:-1]))


def test_chunks_are_balanced_and_a_small_parameter_keeps_its_short_chunk():
    stripes = plan_stripes([32, 3072, 10], 512, 2)
    # 1 + 6 + 1 = 8 chunks: 4 per rank; the bias of 32 is a chunk of its own, not padded to 512
    assert stripes[0][0] == (0, 32)
    assert stripes[1][-1] == (32 + 3072, 10)
    assert [sum(n for _, n in s) for s in stripes] == [32 + 3 * 512, 3 * 512 + 10]


def test_fewer_chunks_than_ranks_leaves_empty_stripes():
    assert plan_stripes([5], 512, 4) == [[], [], [], [(0, 5)]]
