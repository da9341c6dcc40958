"""On a GPU machine (``pytest -m gpu``): the NCCL/CUDA survey of docs/experiments/gpu_check.py passes.

NCCL moves only CUDA tensors: a collective that bunsan makes on a CPU tensor fails there even
at one worker, and Gloo (every other test) cannot show it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_every_case_of_the_gpu_survey_passes_on_nccl(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "experiments" / "gpu_check.py"), "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "FAIL" not in done.stdout
