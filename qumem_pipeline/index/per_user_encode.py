"""One user's texts in encoder calls of their own, for every stage that embeds texts of many users.

A module of its own (numpy only, no store): persona profiles, the query stage and AdaMem's retriever all
call it, and none of them should take the vector store's source into its code version by doing so."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def encode_per_user(embedder, pairs: Sequence[tuple[str, str]], *, batch_size: int = 128) -> dict[tuple[str, str], np.ndarray]:
    """(user_id, text) -> its vector, each user's distinct texts in encoder calls of their own.

    Why: a vector's float32 bits depend on the texts batched beside it (padding, BLAS kernels by shape
    and row position), and a near tie between two memories can turn on those bits; one call over every
    user's queries made a user's retrieval, its A3 prompt and so its paid call depend on who else was in
    the batch (a retry of part of a batch would pay again). A user's queries still share calls."""
    by_user: dict[str, dict[str, None]] = {}
    for user_id, text in pairs:
        by_user.setdefault(user_id, {})[text] = None  # distinct, in first-seen order
    out: dict[tuple[str, str], np.ndarray] = {}
    for user_id, distinct in by_user.items():
        texts = list(distinct)
        for text, v in zip(texts, embedder.encode(texts, batch_size=batch_size)):
            out[(user_id, text)] = v
    return out
