"""Checkpoint files: atomic writes, damaged files skipped, safe loading, model fit. One process."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from bunsan.errors import CheckpointError
from bunsan.train import checkpoint as ckpt
from bunsan.train.checkpoint import Checkpoint
from bunsan.train.checkpoint import files as ckpt_files


def _payload(value: float) -> dict:
    """The layout :func:`ckpt.save` writes, for a world of one."""
    return {
        "format": ckpt.FORMAT,
        "world_size": 1,
        "samples": int(value),
        "common": {"note": ("a", 1, None)},
        "replicated": {"weights": {"w": torch.full((3, 2), value)}},
        "replicas": {},
        "per_rank": [{}],
    }


def test_file_round_trip(tmp_path):
    path = ckpt.write_file(tmp_path / "a.pt", _payload(1.5))
    back = ckpt.read_file(path)
    assert torch.equal(back["replicated"]["weights"]["w"], torch.full((3, 2), 1.5))
    assert back["common"]["note"] == ("a", 1, None)


def test_names_and_order_of_files(tmp_path):
    config = Checkpoint(tmp_path / "run.pt")
    assert config.file_for(54000).name == "run.000000054000.pt"
    assert Checkpoint(f"{tmp_path}/").file_for(7).name == "checkpoint.000000000007.pt"
    for samples in (10, 300, 20):
        ckpt.write_file(config.file_for(samples), _payload(samples))
    (tmp_path / "run.pt").write_text("not ours")  # other names are ignored
    assert [s for s, _ in config.files()] == [300, 20, 10]


@pytest.mark.parametrize("crash_in", ["_write_payload", "_fsync"])
def test_a_crash_while_writing_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch, crash_in):
    config = Checkpoint(tmp_path / "run.pt")
    ckpt.write_file(config.file_for(100), _payload(1.0))

    def half_then_crash(file, data):  # the process dies after writing part of the file
        file.write(data[: len(data) // 2])
        raise OSError("simulated crash while writing")

    def crash(fd):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(ckpt_files, crash_in, half_then_crash if crash_in == "_write_payload" else crash)
    with pytest.raises(OSError, match="simulated crash"):
        ckpt.write_file(config.file_for(200), _payload(2.0))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.000000000100.pt"]  # no new file, no temporary left
    path, payload = ckpt.find_latest_valid(config)
    assert path == config.file_for(100) and payload["replicated"]["weights"]["w"][0, 0] == 1.0


def test_a_stray_temporary_file_is_ignored_and_cleaned_by_the_next_save(tmp_path):
    config = Checkpoint(tmp_path / "run.pt")
    stray = tmp_path / ".run.000000000200.pt.x1y2.tmp"  # a writer killed before its rename
    stray.write_bytes(b"BUNSAN-CHECKPOINT 1\nsha256 00 10\npartial")
    ckpt.save(config, 100, common={}, replicated={}, per_rank={})
    assert not stray.exists()
    assert [s for s, _ in config.files()] == [100]


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty"])
def test_a_damaged_newest_file_is_skipped_with_a_warning(tmp_path, damage):
    config = Checkpoint(tmp_path / "run.pt")
    ckpt.write_file(config.file_for(100), _payload(1.0))
    newest = ckpt.write_file(config.file_for(200), _payload(2.0))
    raw = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(raw[: len(raw) - 100])
    elif damage == "flip":
        newest.write_bytes(raw[:-10] + bytes([raw[-10] ^ 0xFF]) + raw[-9:])
    elif damage == "header":
        newest.write_bytes(b"garbage" + raw)
    else:
        newest.write_bytes(b"")
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoint.*run\.000000000200\.pt"):
        path, _ = ckpt.find_latest_valid(config)
    assert path == config.file_for(100)
    with pytest.warns(UserWarning, match="skipping damaged"):
        restored = ckpt.restore(config)  # the collective version agrees (world of one)
    assert restored is not None and restored.path == config.file_for(100)


def test_no_file_means_a_fresh_start_but_only_damaged_files_refuse_unless_allowed(tmp_path):
    config = Checkpoint(tmp_path / "run.pt")
    assert ckpt.restore(config) is None  # a first run: nothing to resume
    config.file_for(5).write_bytes(b"junk")
    ckpt.write_file(config.file_for(6), {"format": ckpt.FORMAT, "something": "else"})  # whole, but not a session's
    with (
        pytest.warns(UserWarning, match="skipping damaged"),
        pytest.raises(
            CheckpointError, match=r"every one of the 2 checkpoint file\(s\) .* is damaged .*allow_fresh_start=True"
        ),
    ):
        ckpt.restore(config)
    allowed = Checkpoint(tmp_path / "run.pt", allow_fresh_start=True)
    with pytest.warns(UserWarning, match="skipping damaged") as caught:
        assert ckpt.restore(allowed) is None
    assert any("not a training checkpoint" in str(w.message) for w in caught)


def test_only_plain_data_is_saved(tmp_path):
    class Opaque:
        pass

    with pytest.raises(CheckpointError, match=r"checkpoint\['algorithm'\]\['state'\]\[1\] is a Opaque"):
        ckpt.write_file(tmp_path / "x.pt", {"format": 1, "algorithm": {"state": [1, Opaque()]}})
    assert not list(tmp_path.iterdir())


def test_loading_runs_no_pickled_code(tmp_path):
    # A payload whose pickle would call a function is refused by weights_only loading.
    import hashlib
    import io

    buffer = io.BytesIO()
    torch.save({"format": 1, "evil": print}, buffer)
    data = buffer.getvalue()
    (tmp_path / "x.pt").write_bytes(
        ckpt_files._MAGIC + f"sha256 {hashlib.sha256(data).hexdigest()} {len(data)}\n".encode() + data
    )
    with pytest.raises(CheckpointError, match="cannot load"):
        ckpt.read_file(tmp_path / "x.pt")


def test_keep_prunes_the_oldest(tmp_path):
    config = Checkpoint(tmp_path / "run.pt", keep=2)
    for samples in (10, 20, 30):
        ckpt.save(config, samples, common={"n": samples}, replicated={"model": {"w": torch.ones(1)}}, per_rank={})
    assert [s for s, _ in config.files()] == [30, 20]
    restored = ckpt.restore(config)
    assert restored.samples == 30 and restored.common == {"n": 30} and restored.notes == []


def test_restore_into_another_world_size_takes_rank_0_and_says_so(tmp_path):
    config = Checkpoint(tmp_path / "run.pt")
    replicas = [{"w": torch.zeros(2)}, {"w": torch.ones(2)}]
    ckpt.write_file(
        config.file_for(8),
        {
            "format": 1,
            "world_size": 2,
            "samples": 8,
            "common": {},
            "replicated": {"model": replicas[0]},
            "replicas": {"model": replicas},
            "per_rank": [{"r": 0}, {"r": 1}],
        },
    )
    restored = ckpt.restore(config)  # a world of one
    assert torch.equal(restored.replicated["model"]["w"], torch.zeros(2))
    assert restored.per_rank is None and restored.all_per_rank == [{"r": 0}, {"r": 1}]
    assert "differed" in restored.notes[0]


def test_model_fit_names_the_first_mismatch():
    saved = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).state_dict()
    ckpt.check_model_fits(saved, nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), "c")
    with pytest.raises(CheckpointError, match=r"another model: '0\.weight' is \[8, 4\] in the checkpoint but \[6, 4\]"):
        ckpt.check_model_fits(saved, nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), "c")
    with pytest.raises(CheckpointError, match=r"no entry '2\.weight'"):
        ckpt.check_model_fits(saved, nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(2, 2)), "c")
    with pytest.raises(CheckpointError, match=r"entry '1\.weight' that this model lacks"):
        ckpt.check_model_fits(saved, nn.Sequential(nn.Linear(4, 8)), "c")
    with pytest.raises(CheckpointError, match=r"torch\.float64"):
        ckpt.check_model_fits(saved, nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).double(), "c")


def test_rng_states_round_trip_through_a_file(tmp_path):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    np.random.standard_normal()  # leave a cached gaussian in numpy's state
    ckpt.write_file(tmp_path / "rng.pt", {"format": 1, "rng": ckpt.rng_state()})
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)], np.random.standard_normal())
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    ckpt.set_rng_state(ckpt.read_file(tmp_path / "rng.pt")["rng"])
    again = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)], np.random.standard_normal())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2] == again[2] and expected[3] == again[3]


def test_digest_sees_values_dtypes_and_shapes():
    a = {"w": torch.zeros(2, 3), "n": 1}
    assert ckpt.digest(a) == ckpt.digest({"n": 1, "w": torch.zeros(2, 3)})
    assert ckpt.digest(a) != ckpt.digest({"w": torch.zeros(3, 2), "n": 1})
    assert ckpt.digest(a) != ckpt.digest({"w": torch.zeros(2, 3, dtype=torch.float64), "n": 1})
    assert ckpt.digest(a) != ckpt.digest({"w": torch.zeros(2, 3).index_fill_(1, torch.tensor([2]), 1e-30), "n": 1})


@pytest.mark.parametrize(("kwargs", "match"), [({"every": 0}, "every must be"), ({"keep": 0}, "keep must be")])
def test_bad_checkpoint_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Checkpoint(tmp_path / "x.pt", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"every": 1.5}, "every must be an int >= 1 or None"), ({"keep": True}, "keep must be")]
)
def test_checkpoint_settings_of_the_wrong_type_raise_type_error(tmp_path, kwargs, match):
    with pytest.raises(TypeError, match=match):
        Checkpoint(tmp_path / "x.pt", **kwargs)
