"""GPU path: CUDA in float32 (the default) gives CPU float32's decisions; bf16 autocast (opt-in) stays
close. Skips without CUDA; scripts/gpu_check.sh is the same comparison on 4,096 pairs."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU available (torch.cuda.is_available() is False)"),
]

PAIRS = [("i just adopted a puppy", "what breed is she ?"), ("i just adopted a puppy", "i work as an accountant")] * 50


def test_cuda_fp32_gives_the_cpu_decisions():
    from qumem_pipeline.episodes.continuity import ContinuityClassifier

    cpu_clf = ContinuityClassifier.load(device="cpu")
    cpu = cpu_clf.predict_same_proba(PAIRS)
    gpu_clf = ContinuityClassifier.load(device="cuda")
    assert not gpu_clf.use_bf16 and gpu_clf.version == cpu_clf.version
    gpu = gpu_clf.predict_same_proba(PAIRS, batch_size=32)
    assert gpu.dtype == np.float32
    np.testing.assert_allclose(gpu, cpu, atol=1e-4)
    np.testing.assert_array_equal(gpu < cpu_clf.threshold, cpu < cpu_clf.threshold)


def test_cuda_bf16_stays_close_and_says_so_in_its_version():
    from qumem_pipeline.episodes.continuity import ContinuityClassifier

    cpu_clf = ContinuityClassifier.load(device="cpu")
    gpu_clf = ContinuityClassifier.load(device="cuda", precision="bf16")
    assert gpu_clf.use_bf16 and gpu_clf.version == cpu_clf.version + "+bf16"
    np.testing.assert_allclose(gpu_clf.predict_same_proba(PAIRS, batch_size=32), cpu_clf.predict_same_proba(PAIRS), atol=0.05)
