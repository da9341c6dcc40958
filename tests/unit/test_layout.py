"""bunsan.comm.layout: the one flat parameter layout (pure, no process group)."""

from __future__ import annotations

import pytest
import torch

from bunsan.comm.layout import FlatGroup, group_by_kind
from bunsan.errors import CheckpointError


def _named() -> list[tuple[str, torch.Tensor]]:
    return [
        ("a", torch.arange(6.0).reshape(2, 3)),
        ("h", torch.ones(3, dtype=torch.float16)),
        ("b", torch.arange(4.0)),
        ("d", torch.zeros(2, dtype=torch.float64)),
    ]


def test_groups_by_dtype_in_an_order_every_rank_computes_alike():
    groups = group_by_kind(_named())
    # sorted by str(dtype): float16 < float32 < float64; members keep their given order
    assert [[n for n, _ in g] for g in groups] == [["h"], ["a", "b"], ["d"]]
    reordered = group_by_kind(list(reversed(_named())))
    assert [[n for n, _ in g] for g in reordered] == [["h"], ["b", "a"], ["d"]]  # same group order


def test_offsets_views_and_pack_unpack_round_trip():
    layout = FlatGroup.of([(n, t) for n, t in _named() if t.dtype == torch.float32])
    assert (layout.offsets, layout.numel, layout.dtype) == ([0, 6], 10, torch.float32)
    flat = layout.zeros(extra=2)
    assert flat.numel() == 12
    layout.pack(flat)
    torch.testing.assert_close(flat[:10], torch.cat([torch.arange(6.0), torch.arange(4.0)]))
    views = layout.views(flat)
    assert views[0].shape == (2, 3) and views[0].data_ptr() == flat.data_ptr()  # views, not copies
    layout.pack(flat, [None, torch.full((4,), 7.0)])  # None: zeros, as for an unused parameter
    torch.testing.assert_close(flat[:10], torch.cat([torch.zeros(6), torch.full((4,), 7.0)]))
    targets = [torch.empty(2, 3), torch.empty(4)]
    layout.unpack(flat, targets)
    torch.testing.assert_close(targets[1], torch.full((4,), 7.0))


def test_named_copies_and_load_named_refuses_another_model():
    layout = FlatGroup.of([("w", torch.zeros(2, 2)), ("b", torch.zeros(2))])
    flat = torch.arange(6.0)
    saved = layout.named(flat)
    assert set(saved) == {"w", "b"} and saved["w"].shape == (2, 2)
    flat.zero_()
    assert saved["b"].tolist() == [4.0, 5.0]  # copies: unaffected
    layout.load_named(flat, saved, "momentum")
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(CheckpointError, match=r"momentum has no parameter 'b': it is from another model"):
        layout.load_named(flat, {"w": saved["w"]}, "momentum")
    with pytest.raises(CheckpointError, match=r"momentum\['w'\] has shape \[4\].*another model"):
        layout.load_named(flat, {"w": torch.zeros(4), "b": saved["b"]}, "momentum")
    layout.load_named(flat, {"w": torch.full((4,), 9.0), "b": torch.full((2,), 8.0)}, "residual", strict=False)
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 8.0, 8.0]  # the mismatched one kept its values
