"""Issue 15, item 7: ``restore=True`` with every checkpoint damaged is an error, on every rank.

Two gloo ranks of the warm pool: each gets the same ``CheckpointError`` (one
sentence that names the directory and the way out), unless the checkpoint
allows a fresh start; then both start from scratch. A directory without any
checkpoint file is a first run, not an error.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from bunsan import comm
from bunsan.errors import CheckpointError
from bunsan.train import checkpoint as ckpt
from bunsan.train.checkpoint import Checkpoint


def _body_restore(rank, world_size, directory, allow):
    config = Checkpoint(Path(directory) / "run.pt", allow_fresh_start=allow)
    if rank == 0 and not config.files():
        config.directory.mkdir(parents=True, exist_ok=True)
        config.file_for(40).write_bytes(b"BUNSAN-CHECKPOINT 1\ntruncated")
        config.file_for(80).write_bytes(b"")
    comm.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 0 warns about each damaged file
        try:
            return ("restored", ckpt.restore(config))
        except CheckpointError as error:
            return ("error", str(error))


def _body_empty_directory(rank, world_size, directory):
    return ckpt.restore(Checkpoint(Path(directory) / "run.pt"))


def test_every_checkpoint_damaged_raises_on_every_rank(workers, tmp_path):
    results = workers.run(f"{__name__}:_body_restore", directory=str(tmp_path), allow=False)
    assert [kind for kind, _ in results] == ["error", "error"]
    assert results[0][1] == results[1][1]  # the same sentence everywhere
    message = results[0][1]
    assert f"every one of the 2 checkpoint file(s) in {tmp_path} is damaged" in message
    assert "allow_fresh_start=True" in message and "\n" not in message


def test_allow_fresh_start_starts_from_scratch(workers, tmp_path):
    assert workers.run(f"{__name__}:_body_restore", directory=str(tmp_path), allow=True) == [
        ("restored", None),
        ("restored", None),
    ]


def test_no_checkpoint_at_all_is_a_first_run(workers, tmp_path):
    assert workers.run(f"{__name__}:_body_empty_directory", directory=str(tmp_path / "nothing")) == [None, None]


def test_training_session_refuses_to_start_afresh(tmp_path):
    """The same through TrainingSession.train() in a world of one."""
    import torch

    from bunsan.train import TrainingSession

    config = Checkpoint(tmp_path / "run.pt")
    config.directory.mkdir(parents=True, exist_ok=True)
    config.file_for(10).write_bytes(b"junk")
    model = torch.nn.Linear(2, 2)
    session = TrainingSession(
        model,
        torch.nn.functional.cross_entropy,
        torch.optim.SGD(model.parameters(), lr=0.1),
        "data_parallel",
        (torch.randn(8, 2), torch.randint(0, 2, (8,))),
        minibatch_size=4,
        max_epochs=1,
        checkpoint=config,
        progress=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match="is damaged .* allow_fresh_start=True"):
            session.train()
