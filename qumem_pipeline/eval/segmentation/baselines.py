"""Unsupervised / trivial segmentation baselines, all producing gap strings (see :mod:`.metrics`).

- ``fixed_window``: a boundary every ``size`` utterances. Default ``size = 4``: the mean segment
  length of TIAGE *train* (4,692 utterances / 1,187 segments = 3.95), fixed so that the baseline never
  sees the evaluated file's reference.
- ``texttiling``: embedding-similarity TextTiling (Hearst 1997 with sentence embeddings): utterances
  are embedded with the base all-MiniLM-L6-v2 (mean pooling, L2-normalised); at every gap the cosine
  between the mean embedding of the ``window`` utterances before and the ``window`` after (default
  2) is the gap's coherence; depth score = (left peak - s) + (right peak - s) where the peaks are
  found by climbing while the similarity rises; a gap is a boundary when its depth is a local maximum
  and exceeds ``mean - std / 2`` of the dialogue's depth scores (Hearst's cutoff).
- ``all_continue``: no boundary at all.
- ``random``: each gap independently a boundary with probability ``rate`` (default 0.2 ≈ the TIAGE
  train boundary rate 887 / 4,392), seeded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from qumem_pipeline.runtime.batching import length_buckets, pad_batch

DEFAULT_FIXED_SIZE = 4
DEFAULT_RANDOM_RATE = 0.2


def fixed_window(n_utterances: int, size: int = DEFAULT_FIXED_SIZE) -> list[int]:
    return [1 if (i + 1) % size == 0 else 0 for i in range(max(0, n_utterances - 1))]


def all_continue(n_utterances: int) -> list[int]:
    return [0] * max(0, n_utterances - 1)


def random_boundaries(n_utterances: int, rng: np.random.Generator, rate: float = DEFAULT_RANDOM_RATE) -> list[int]:
    return [int(x) for x in (rng.random(max(0, n_utterances - 1)) < rate)]


def depth_scores(sims: Sequence[float]) -> np.ndarray:
    s = np.asarray(sims, dtype=np.float64)
    out = np.zeros_like(s)
    for i in range(len(s)):
        lp = s[i]
        j = i
        while j > 0 and s[j - 1] >= lp:
            lp = s[j - 1]
            j -= 1
        rp = s[i]
        j = i
        while j < len(s) - 1 and s[j + 1] >= rp:
            rp = s[j + 1]
            j += 1
        out[i] = (lp - s[i]) + (rp - s[i])
    return out


def texttiling_from_embeddings(emb: np.ndarray, window: int = 2) -> list[int]:
    """Gap boundaries for one dialogue from its (n, d) L2-normalised utterance embeddings."""
    n = len(emb)
    if n < 2:
        return []
    sims = []
    for i in range(n - 1):
        left = emb[max(0, i - window + 1) : i + 1].mean(0)
        right = emb[i + 1 : i + 1 + window].mean(0)
        den = float(np.linalg.norm(left) * np.linalg.norm(right))
        sims.append(float(left @ right) / den if den > 0 else 1.0)
    depth = depth_scores(sims)
    if len(depth) < 2 or float(depth.max()) <= 0:
        return [0] * (n - 1)
    cutoff = depth.mean() - depth.std() / 2.0
    out = []
    for i, d in enumerate(depth):
        local_max = (i == 0 or d >= depth[i - 1]) and (i == len(depth) - 1 or d >= depth[i + 1])
        out.append(int(d > 0 and d > cutoff and local_max))
    return out


class SentenceEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (mean pooling + L2 norm), length-bucketed batches."""

    def __init__(self, device: str | torch.device | None = None, max_len: int = 128):
        from qumem_pipeline.embedding.base_model import load_base_model, load_tokenizer
        from qumem_pipeline.episodes.continuity.inference import resolve_device

        self.device = resolve_device(device)
        self.tok = load_tokenizer()
        self.model = load_base_model().to(self.device)
        self.max_len = max_len

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], batch_size: int = 128) -> np.ndarray:
        dim = self.model.config.hidden_size
        out = np.zeros((len(texts), dim), dtype=np.float32)
        if not texts:
            return out
        enc = self.tok([t or "" for t in texts], truncation=True, max_length=self.max_len, padding=False,
                       return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        pad = self.tok.pad_token_id or 0
        for idx in length_buckets([len(x) for x in enc], batch_size):
            ids, mask = (t.to(self.device) for t in pad_batch(enc, idx, pad))
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                h = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            m = mask.unsqueeze(-1).float()
            e = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
            e = torch.nn.functional.normalize(e, dim=-1)
            out[idx] = e.cpu().numpy()
        return out
