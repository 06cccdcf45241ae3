"""The retrieval stage of query-conditioned user-state inference (QUMem §3.4), and its baseline.

Two entry points, both stage-batched (every sub-query of a user's requests embedded in one encode
call of that user's, ``index.per_user_encode.encode_per_user``, then one faiss search per (user, store) holding all of that
group's vectors, each row filtered by its own as_of):

- :func:`execute_plans` runs each request's planned sub-queries (rewritten query + non-empty subset
  of {fact, preference, insight}) against the user's chosen stores, top-k per (sub-query, store),
  only memories at or before the request's ``as_of_position``; results of a request are merged and
  de-duplicated by memory_id keeping the max score (and every sub-query that found it).
- :func:`retrieve_baseline` is the paper's "previous methods" baseline: one top-k over all memory
  types with the raw query (same as_of rule).

Store names accept 'F'/'P'/'I' and plural/singular spellings (see ``vector_index.normalize_type``);
an unknown name raises ``ValueError`` - plan repair/quarantine is the planning agent's job.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from qumem_pipeline.index.per_user_encode import encode_per_user
from qumem_pipeline.index.vector_store import MEMORY_TYPES, VectorStore, normalize_type
from qumem_pipeline.query.strategies.base import RetrievedMemory

DEFAULT_K = 5


@dataclass(frozen=True)
class PlannedQuery:
    """One planned retrieval: a self-contained query and the stores to search."""

    query: str
    types: tuple[str, ...] = MEMORY_TYPES

    def __post_init__(self):
        types = self.types if isinstance(self.types, (list, tuple)) else (self.types,)
        norm = tuple(dict.fromkeys(normalize_type(t) for t in types))
        if not norm:
            raise ValueError("a planned query needs a non-empty set of stores")
        if not isinstance(self.query, str) or not self.query.strip():
            raise ValueError("a planned query needs non-empty text")
        object.__setattr__(self, "types", norm)


@dataclass
class RetrievalRequest:
    """One personalization query's retrieval: which user, up to which turn, which planned queries."""

    query_id: str
    user_id: str
    planned: list[PlannedQuery]
    as_of_position: int | None = None  # None: no temporal limit (all memories)


@dataclass
class Candidate:
    memory_id: str
    type: str
    score: float
    position: int
    sub_queries: list[int] = field(default_factory=list)  # indices into the request's plan

    def as_dict(self) -> dict:
        return asdict(self)


def execute_plans(
    requests: Sequence[RetrievalRequest],
    store: VectorStore,
    embedder,
    k: int = DEFAULT_K,
    *,
    limit: int | None = None,
    batch_size: int = 128,
    query_vectors: dict[str, np.ndarray] | None = None,
) -> list[list[Candidate]]:
    """Candidates per request (input order), merged and de-duplicated, best score first.

    ``k``: top-k per (planned query, store). ``limit``: keep only the best ``limit`` after merging
    (None keeps all). ``query_vectors``: optional precomputed text -> vector (skips encoding those).
    """
    encoded = encode_per_user(embedder, [(req.user_id, pq.query) for req in requests for pq in req.planned
                                         if query_vectors is None or pq.query not in query_vectors], batch_size=batch_size)

    def vec(user_id: str, text: str) -> np.ndarray:
        if query_vectors is not None and text in query_vectors:
            return np.asarray(query_vectors[text], dtype=np.float32)
        return encoded[(user_id, text)]

    # group every (request, sub-query, store) by (user, store): one search per group, each row
    # filtered by its own request's as_of
    groups: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for ri, req in enumerate(requests):
        for si, pq in enumerate(req.planned):
            for t in pq.types:
                groups[(req.user_id, t)].append((ri, si))
    merged: list[dict[str, Candidate]] = [dict() for _ in requests]
    for (user_id, t), members in groups.items():
        q = np.stack([vec(user_id, requests[ri].planned[si].query) for ri, si in members])
        as_ofs = [requests[ri].as_of_position for ri, _ in members]
        hits = store.search(user_id, t, q, k, as_ofs[0] if len(set(as_ofs)) == 1 else as_ofs)
        for (ri, si), row in zip(members, hits):
            as_of = requests[ri].as_of_position
            for memory_id, score, position in row:
                if as_of is not None and position > as_of:  # defence in depth: never future evidence
                    continue
                c = merged[ri].get(memory_id)
                if c is None:
                    merged[ri][memory_id] = Candidate(memory_id, t, score, position, [si])
                else:
                    c.score = max(c.score, score)
                    if si not in c.sub_queries:
                        c.sub_queries.append(si)
    out = []
    for m in merged:
        cands = sorted(m.values(), key=lambda c: (-c.score, c.position, c.memory_id))
        for c in cands:
            c.sub_queries.sort()
        out.append(cands[:limit] if limit is not None else cands)
    return out


def baseline_requests(queries: Sequence[tuple[str, str, str, int | None]]) -> list[RetrievalRequest]:
    """(query_id, user_id, query text, as_of_position) -> one all-store request each."""
    return [RetrievalRequest(qid, uid, [PlannedQuery(text, MEMORY_TYPES)], as_of) for qid, uid, text, as_of in queries]


def retrieve_baseline(
    queries: Sequence[tuple[str, str, str, int | None]],
    store: VectorStore,
    embedder,
    k: int = DEFAULT_K,
    *,
    batch_size: int = 128,
) -> list[list[Candidate]]:
    """Single top-k over all memory types with the raw query (the paper's baseline), batched."""
    return execute_plans(baseline_requests(queries), store, embedder, k, limit=k, batch_size=batch_size)


class TypedMemoryRetriever:
    """The query-state agents' retriever: planned (query, stores) per query -> memories with content.

    Implements ``strategies.base.Retriever`` over the per-user FAISS stores; contents, evidence and
    timestamps come from the memories table.
    """

    def __init__(self, store: VectorStore, embedder, memories):
        self.store, self.embedder = store, embedder
        self.rows = {r["memory_id"]: r for r in memories.iter_rows(named=True)}

    def retrieve(self, requests, k):
        reqs = [
            RetrievalRequest(str(i), user_id, [PlannedQuery(text, tuple(types)) for text, types in plan], as_of)
            for i, (user_id, plan, as_of) in enumerate(requests)
        ]
        out = []
        for cands in execute_plans(reqs, self.store, self.embedder, k):
            row = []
            for c in cands:
                m = self.rows[c.memory_id]
                row.append(RetrievedMemory(c.memory_id, c.type, m["content"], c.position, float(c.score),
                                           list(m["evidence_turn_ids"]), m.get("valid_from")))
            out.append(row)
        return out


__all__ = ["PlannedQuery", "RetrievalRequest", "Candidate", "execute_plans", "baseline_requests",
           "retrieve_baseline", "TypedMemoryRetriever", "DEFAULT_K"]
