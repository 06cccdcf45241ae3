"""Adjacent-utterance cosine of the base all-MiniLM-L6-v2 embeddings: the decision rule's second signal.

Why a separate encoder and not the classifier's own pass: the classifier is a cross-encoder over
the *pair* with its LoRA merged into the weights and a trained token-type table, so neither its
forward nor peft's ``disable_adapter()`` yields the base model's single-sentence embedding. The shared
embedder, :class:`~qumem_pipeline.embedding.minilm.Embedder` (the index stage's too), is exactly that model (the same weights
file the classifier verifies at load, mean pooling + L2 norm), so it is reused, and every distinct
text is encoded once: the N-1 pairs of a history cost N single-sentence forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def pair_cosine(pairs: Sequence[tuple[str, str]], encode: Callable[[list[str]], np.ndarray]) -> np.ndarray:
    """Cosine per (previous, next) pair, float32, input order; ``encode`` returns unit-norm rows."""
    if not pairs:
        return np.zeros(0, dtype=np.float32)
    index: dict[str, int] = {}
    for a, b in pairs:
        for t in (a or "", b or ""):
            index.setdefault(t, len(index))
    emb = np.asarray(encode(list(index)), dtype=np.float32)
    ia = np.fromiter((index[a or ""] for a, _ in pairs), dtype=np.int64, count=len(pairs))
    ib = np.fromiter((index[b or ""] for _, b in pairs), dtype=np.int64, count=len(pairs))
    return np.einsum("ij,ij->i", emb[ia], emb[ib]).astype(np.float32)


def history_embeddings(histories: Sequence[Sequence[str]], encode: Callable[[list[str]], np.ndarray]) -> list[np.ndarray]:
    """Unit-norm embedding rows (float32) per history, one per utterance, in order; every distinct
    text across all histories is encoded once, in one call (the learned rule's block features)."""
    index: dict[str, int] = {}
    for h in histories:
        for t in h:
            index.setdefault(t or "", len(index))
    if not index:
        return [np.zeros((0, 0), dtype=np.float32) for _ in histories]
    emb = np.asarray(encode(list(index)), dtype=np.float32)
    return [emb[np.fromiter((index[t or ""] for t in h), dtype=np.int64, count=len(h))] for h in histories]


def adjacent_cosine(embeddings: np.ndarray) -> np.ndarray:
    """Cosine of each utterance with the next (unit-norm rows): what :func:`pair_cosine` gives for
    the history's consecutive pairs, from embeddings already at hand."""
    e = np.asarray(embeddings, dtype=np.float32)
    if len(e) < 2:
        return np.zeros(0, dtype=np.float32)
    return np.einsum("ij,ij->i", e[:-1], e[1:]).astype(np.float32)


def history_signals_of(history: Sequence[str], predict_same: Callable[[list[tuple[str, str]]], np.ndarray], *,
                       embed_histories: Callable[[list[list[str]]], list[np.ndarray]] | None = None,
                       similarity: Callable[[list[tuple[str, str]]], np.ndarray] | None = None,
                       label: str = "history") -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(P(same) per gap, cosine per gap or None, embeddings or None) of ONE history, from calls that
    see only its pairs and texts: an encoder's output for a row moves in the last bits with the rows
    batched beside it, so a history's signals (and the episode cut they give) are a function of the
    history alone only when no call mixes histories. With ``embed_histories`` the cosine comes from the
    embeddings; else ``similarity`` (pairs -> cosine) gives it; neither: no cosine."""
    pairs = [(history[i], history[i + 1]) for i in range(len(history) - 1)]
    probs = np.asarray(predict_same(pairs), dtype=np.float32) if pairs else np.zeros(0, dtype=np.float32)
    if len(probs) != len(pairs):
        raise ValueError(f"{label}: predict_same returned {len(probs)} values for {len(pairs)} pairs")
    if embed_histories is not None:
        got = embed_histories([list(history)])
        if len(got) != 1:
            raise ValueError(f"{label}: embed_histories returned {len(got)} histories for 1")
        return probs, adjacent_cosine(got[0]), got[0]
    if similarity is not None:
        cos = np.asarray(similarity(pairs), dtype=np.float32) if pairs else np.zeros(0, dtype=np.float32)
        if len(cos) != len(pairs):
            raise ValueError(f"{label}: similarity returned {len(cos)} cosines for {len(pairs)} pairs")
        return probs, cos, None
    return probs, None, None
