"""quantized_hook under the real Hugging Face Trainer (2 gloo ranks): QuantizedHookCallback trains and resumes.

Skipped without transformers: it is not in the ``test`` extra (a large install), so CI skips this
module; ``pip install 'bunsan[transformers]'`` runs it. The workers already share a process group;
torch's launcher variables tell the Trainer (through Accelerate) that the processes exist.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.test_trainer_integrations import _data, _flat, _launcher_environment

pytest.importorskip("transformers")

FIRST, THEN = 3, 2


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(20, 37), nn.Tanh(), nn.Linear(37, 3))

    def forward(self, x, y):
        return {"loss": F.mse_loss(self.net(x), y)}


def _train(world_size, folder, resume_from_checkpoint=None):
    from transformers import Trainer, TrainingArguments

    from bunsan.integrations.transformers import QuantizedHookCallback

    x, y = _data(world_size)
    data = [{"x": a, "y": b} for a, b in zip(x, y)]
    args = TrainingArguments(
        output_dir=folder,
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=16,  # one step per epoch
        max_steps=FIRST + THEN,
        save_strategy="steps",
        save_steps=FIRST,
        learning_rate=0.05,
        remove_unused_columns=False,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    model = _Regression()
    trainer = Trainer(model=model, args=args, train_dataset=data)
    callback = QuantizedHookCallback(trainer, bits=1, warmup_steps=1)
    trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return model, callback


def _body_hf_trainer(rank, world_size, folder):
    _launcher_environment(rank, world_size)
    model, callback = _train(world_size, folder)
    assert callback.hook_state.step == FIRST + THEN and callback.hook_state.quantized_steps == FIRST + THEN - 1
    saved = torch.load(os.path.join(folder, f"checkpoint-{FIRST}", f"bunsan_quantized_hook_rank{rank}.pt"))
    assert saved["step"] == FIRST
    residual = torch.cat([r.reshape(-1) for r in saved["residuals"]["residual"].values()])
    resumed, callback = _train(world_size, folder, resume_from_checkpoint=os.path.join(folder, f"checkpoint-{FIRST}"))
    assert callback.hook_state.step == FIRST + THEN and callback.hook_state.quantized_steps == FIRST + THEN - 1
    return torch.equal(_flat(model), _flat(resumed)), residual.tolist()


def test_hf_trainer_callback_trains_with_the_hook_and_resumes_every_ranks_residuals(workers, tmp_path):
    results = workers.run(f"{__name__}:_body_hf_trainer", folder=str(tmp_path))
    (equal0, residual0), (equal1, residual1) = results
    assert equal0 and equal1
    residual0, residual1 = torch.tensor(residual0), torch.tensor(residual1)
    assert residual0.abs().sum() > 0 and residual1.abs().sum() > 0 and not torch.equal(residual0, residual1)
