"""GPU path: CUDA + bf16 autocast gives the same decisions as CPU float32."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU available (torch.cuda.is_available() is False)"),
]


def test_cuda_bf16_matches_cpu():
    from qumem_pipeline.episodes.continuity import ContinuityClassifier

    pairs = [("i just adopted a puppy", "what breed is she ?"), ("i just adopted a puppy", "i work as an accountant")] * 50
    cpu = ContinuityClassifier.load(device="cpu").predict_same_proba(pairs)
    gpu_clf = ContinuityClassifier.load(device="cuda")
    assert gpu_clf.use_bf16
    gpu = gpu_clf.predict_same_proba(pairs, batch_size=32)
    assert gpu.dtype == np.float32
    np.testing.assert_allclose(gpu, cpu, atol=0.05)
