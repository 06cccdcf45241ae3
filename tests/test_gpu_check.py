"""scripts/gpu_check.sh on a machine without CUDA: one JSON line saying it skipped, exit 0 (the GPU
comparison itself runs only where a CUDA GPU is: docs/operating.md#gpu-check)."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: the script would run the comparison")
def test_gpu_check_skips_without_cuda():
    p = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["status"] == "skipped: no CUDA" and out["cuda_available"] is False
    assert out["reason"]


def test_gpu_check_example_pairs():
    """The pairs it compares: consecutive turns of the example archive's conversations and users."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    hs = mod.histories(500)
    assert sum(len(h) - 1 for h in hs) == 500 and all(len(h) > 1 for h in hs)
    assert all(isinstance(t, str) and t.strip() for h in hs for t in h)
