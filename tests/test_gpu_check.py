"""The prepared GPU check (bench/gpu_check.sh) on a machine without a GPU: one line that says so, nothing run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: bench/gpu_check.sh runs the real check")
def test_gpu_check_says_in_one_line_that_there_is_no_gpu():
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "no CUDA GPU" in lines[0], (run.returncode, lines)
