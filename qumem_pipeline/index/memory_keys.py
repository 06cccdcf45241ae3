"""A memory's index key: its content and the turns it was drawn from, in one vector.

Why: a memory is found by how a question is worded, and a small model often words a fact apart from
how it will be asked for. For LoCoMo's "What country is Caroline's grandma from?", the memory "... a
necklace ... given to her by her grandma in her home country, Sweden" ranks below many other
"Caroline ..." memories by its content alone. Its source turns say the same thing in the speaker's
own words. So a memory is indexed by ``normalize(c + w * normalize(mean(s)))``: ``c`` is
its content's vector and ``s`` the vectors of its evidence turns. It stays one vector per memory, so
the per-type indexes, the id map and the ``as_of`` filter are unchanged. What the answer step is shown
is still the memory's own text.

``SOURCE_WEIGHT`` (w) was chosen from {0.5, 1, 2, 4, 8} on LoCoMo conv-26 and conv-30 (4 and 8 are
level there; 4 keeps the content a larger part of the key) and then checked on conv-41..43, whose
memories were decomposed while it was chosen and never looked at for it (README, "Memories against
single turns"). ``keyed_version`` names the rule next to the embedder, so a table keyed another way is
embedded again, never mixed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl

SOURCE_WEIGHT = 4.0


def keyed_version(embedder_version: str, weight: float) -> str:
    """The embeddings table's ``embedding_model``: the embedder, plus the key rule when sources count."""
    return embedder_version if not weight else f"{embedder_version}+sources*{weight:g}"


def combine(content_vecs: np.ndarray, source_vecs: Sequence[np.ndarray | None], weight: float) -> np.ndarray:
    """Unit-norm keys: each content vector plus ``weight`` times its sources' normalised mean.

    ``source_vecs[i]`` is an (n_i, dim) array of memory i's source turn vectors, or None/empty when
    none resolved (that memory is keyed by its content alone)."""
    keys = np.array(content_vecs, dtype=np.float32, copy=True)
    if weight:
        for i, s in enumerate(source_vecs):
            if s is None or len(s) == 0:
                continue
            m = np.asarray(s, dtype=np.float32).mean(axis=0)
            norm = float(np.linalg.norm(m))
            if norm > 0:
                keys[i] += weight * m / norm
    keys /= np.clip(np.linalg.norm(keys, axis=1, keepdims=True), 1e-12, None)
    return keys


def turn_text(speaker: str | None, text: str | None) -> str:
    """A turn as it is keyed: ``"Speaker: text"`` when it has a speaker (as the LoCoMo harness renders it)."""
    return f"{speaker}: {text or ''}" if speaker else (text or "")


def source_texts(memories: pl.DataFrame, turns: pl.DataFrame) -> dict[str, list[str]]:
    """memory_id -> the texts of its evidence turns, looked up in the same user's turns."""
    by_user: dict[str, dict[int, str]] = {}
    for u, g in turns.group_by("user_id"):
        speakers = g["speaker"].to_list() if "speaker" in g.columns else [None] * g.height
        by_user[u[0]] = {int(t): turn_text(sp, tx) for t, sp, tx in
                         zip(g["turn_index"].to_list(), speakers, g["text"].to_list())}
    out: dict[str, list[str]] = {}
    for mid, uid, ev in memories.select("memory_id", "user_id", "evidence_turn_ids").iter_rows():
        lines = by_user.get(uid, {})
        out[mid] = [lines[t] for t in (ev or []) if t in lines]
    return out


def key_vectors(contents: Sequence[str], sources: Sequence[Sequence[str]], embedder, weight: float = SOURCE_WEIGHT,
                *, batch_size: int = 128, progress=None) -> np.ndarray:
    """Encode contents and (each distinct one once) source texts, then ``combine``."""
    content_vecs = embedder.encode(list(contents), batch_size=batch_size, progress=progress)
    if not weight:
        return content_vecs
    distinct = list(dict.fromkeys(t for src in sources for t in src))
    enc = embedder.encode(distinct, batch_size=batch_size) if distinct else np.zeros((0, embedder.dim), np.float32)
    row = {t: i for i, t in enumerate(distinct)}
    return combine(content_vecs, [enc[[row[t] for t in src]] if src else None for src in sources], weight)


def keys_for(memories: pl.DataFrame, sources: Mapping[str, Sequence[str]], embedder, weight: float = SOURCE_WEIGHT,
             **kw) -> np.ndarray:
    """Keys of a memories frame's rows, in row order (``sources``: memory_id -> source texts)."""
    mids = memories["memory_id"].to_list()
    return key_vectors(memories["content"].to_list(), [list(sources.get(m, ())) for m in mids], embedder, weight, **kw)


__all__ = ["SOURCE_WEIGHT", "combine", "key_vectors", "keyed_version", "keys_for", "source_texts", "turn_text"]
