"""Building one flat inner-product FAISS index, on the GPU when faiss can: the index stage's only
GPU code. Kept apart from `vector_store` (which needs polars and the table store) so that
scripts/gpu_check.py runs exactly this code on a GPU machine that has faiss and numpy and nothing
else of the pipeline's dependencies."""

from __future__ import annotations

import threading

import faiss
import numpy as np

_GPU_LOCK = threading.Lock()
_GPU_RES = None


def gpu_available() -> bool:
    """faiss was built with GPU support and sees at least one GPU."""
    if not hasattr(faiss, "StandardGpuResources"):
        return False
    try:
        return faiss.get_num_gpus() > 0
    except Exception:
        return False


def gpu_resources():
    """One StandardGpuResources per process, reused by every build."""
    global _GPU_RES
    with _GPU_LOCK:
        if _GPU_RES is None:
            _GPU_RES = faiss.StandardGpuResources()
        return _GPU_RES


def new_index(dim: int) -> faiss.IndexIDMap2:
    """The empty index every user's per-type store is: exact inner product, with our int64 ids."""
    return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))


def build_index(vectors: np.ndarray, ids: np.ndarray, dim: int, use_gpu: bool | None = None) -> tuple[faiss.Index, str]:
    """An IndexIDMap2(IndexFlatIP) holding the vectors; returns (CPU index, 'gpu'|'cpu')."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1, dim)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if use_gpu is None:
        use_gpu = gpu_available()
    if use_gpu and len(ids):
        res = gpu_resources()
        gpu = faiss.index_cpu_to_gpu(res, 0, new_index(dim))
        gpu.add_with_ids(vectors, ids)
        return faiss.index_gpu_to_cpu(gpu), "gpu"
    index = new_index(dim)
    if len(ids):
        index.add_with_ids(vectors, ids)
    return index, "cpu"
