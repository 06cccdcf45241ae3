"""Memory embeddings: every memory's index key (its text plus its source turns) encoded by the MiniLM
embedder (`qumem_pipeline.embedding.minilm`, shared with the episodes stage and re-exported here), one
row per memory with the embedder's version, so an embedding table (and every index built from it) can
tell when the model changed and re-embed without re-running the LLM.

Public API (used by the embeddings asset)::

    emb = Embedder.load()                       # device=None: CUDA when available, else CPU
    vecs = emb.encode(texts)                    # float32 (n, 384), unit-norm rows, input order
    df = embed_memories(memories_df, emb)       # memory_id, user_id, type, position, embedding, embedding_model
    df = embed_memories(memories_df, emb, sources=source_texts(memories_df, turns_df))  # keyed by content + source turns
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl

from qumem_pipeline.embedding.minilm import DIM, MODEL_NAME, Embedder, ProgressFn, model_dir, model_version
from qumem_pipeline.index.memory_keys import SOURCE_WEIGHT, key_vectors, keyed_version

EMBEDDING_COLUMNS = ("memory_id", "user_id", "type", "position", "embedding", "embedding_model")


def embedding_schema(dim: int = DIM) -> pl.Schema:
    return pl.Schema(
        {
            "memory_id": pl.String,
            "user_id": pl.String,
            "type": pl.String,
            "position": pl.Int64,
            "embedding": pl.Array(pl.Float32, dim),
            "embedding_model": pl.String,
        }
    )


def embed_memories(
    memories: pl.DataFrame,
    embedder: Embedder,
    *,
    sources: Mapping[str, Sequence[str]] | None = None,
    source_weight: float | None = None,
    previous: pl.DataFrame | None = None,
    batch_size: int = 128,
    progress: ProgressFn | None = None,
) -> pl.DataFrame:
    """Embed memories (every user of the frame, each in encoder calls of its own: ``_encode_per_user``).

    ``sources`` (memory_id -> its evidence turns' texts, ``memory_keys.source_texts``): each memory
    is keyed by its content and its source turns (``memory_keys``, weight ``source_weight``, default
    ``SOURCE_WEIGHT``); without it, by its content alone. ``embedding_model`` names which.
    ``previous``: an earlier embeddings table; content-only rows whose memory_id and embedding_model
    match are reused instead of re-encoded (memory ids hash the content, so a same id means same
    text). Keyed rows are always encoded again: a key also depends on turn texts, which neither the
    memory id nor the table records (an episode id names a turn span, not its text), and MiniLM is
    cheap next to the LLM calls that made the memories. Output rows follow the input's order.
    """
    schema = embedding_schema(embedder.dim)
    if memories.height == 0:
        return pl.DataFrame(schema=schema)
    weight = (SOURCE_WEIGHT if source_weight is None else float(source_weight)) if sources is not None else 0.0
    version = keyed_version(embedder.version, weight)
    mids = memories["memory_id"].to_list()
    contents = memories["content"].to_list()
    vecs = np.zeros((len(mids), embedder.dim), dtype=np.float32)
    todo = list(range(len(mids)))
    if not weight and previous is not None and previous.height and "embedding" in previous.columns:
        prev = previous.filter(pl.col("embedding_model") == version)
        if prev.height:
            pos = {m: i for i, m in enumerate(prev["memory_id"].to_list())}
            pvecs = np.asarray(prev["embedding"].to_numpy(), dtype=np.float32).reshape(prev.height, -1)
            if pvecs.shape[1] == embedder.dim:
                todo = []
                for i, m in enumerate(mids):
                    j = pos.get(m)
                    if j is None:
                        todo.append(i)
                    else:
                        vecs[i] = pvecs[j]
    if todo:
        _encode_per_user(vecs, todo, memories["user_id"].to_list(), mids, contents, sources or {}, embedder, weight,
                         batch_size, progress)
    return pl.DataFrame(
        {
            "memory_id": memories["memory_id"].cast(pl.String),
            "user_id": memories["user_id"].cast(pl.String),
            "type": memories["type"].cast(pl.String),
            "position": memories["position"].cast(pl.Int64),
            "embedding": pl.Series("embedding", vecs, dtype=pl.Array(pl.Float32, embedder.dim)),
            "embedding_model": pl.Series("embedding_model", [version] * len(mids), dtype=pl.String),
        },
        schema=schema,
    )


def _encode_per_user(vecs: np.ndarray, todo: list[int], users: list, mids: list, contents: list,
                     sources: Mapping[str, Sequence[str]], embedder, weight: float, batch_size: int,
                     progress: ProgressFn | None) -> None:
    """Fill ``vecs[todo]``, each user's memories (and their source texts) in encoder calls of their own.

    Why: a vector's float32 bits depend on the rows batched beside it (padding length, BLAS kernels by
    shape and row position: tests/test_batch_independence.py), so one call over a run's users made a
    user's keys, and the ranks of near ties, depend on who else was in the run."""
    by_user: dict[object, list[int]] = {}
    for i in todo:
        by_user.setdefault(users[i], []).append(i)
    done, total = 0, len(todo)
    for idx in by_user.values():
        def step(d: int, _n: int, base: int = done) -> None:
            if progress is not None:
                progress(base + d, total)
        vecs[idx] = key_vectors([contents[i] for i in idx], [list(sources.get(mids[i], ())) for i in idx], embedder,
                                weight, batch_size=batch_size, progress=step)
        done += len(idx)


def embeddings_matrix(df: pl.DataFrame) -> np.ndarray:
    """The embedding column of an embeddings table as a contiguous float32 (n, dim) matrix."""
    if df.height == 0:
        return np.zeros((0, DIM), dtype=np.float32)
    arr = df["embedding"].to_numpy()
    if arr.dtype == object:  # a List column (e.g. read back from another writer)
        arr = np.stack([np.asarray(v, dtype=np.float32) for v in arr])
    return np.ascontiguousarray(arr, dtype=np.float32).reshape(df.height, -1)


__all__ = ["Embedder", "embed_memories", "embedding_schema", "embeddings_matrix", "model_dir", "model_version", "MODEL_NAME", "DIM"]
