"""Persona profiles (AdaMem's persona memory): compact, stable traits distilled from a user's
preference and insight memories.

Near-duplicates are grouped first: memories whose embeddings are within ``SIMILARITY`` (cosine) of
each other are linked, and each connected component is one group - so "likes hiking" stated five
times becomes one entry, not five. A group of one becomes an entry as it is; each larger group gets
exactly one schema-constrained LLM merge call (all groups of a run in one batch), which names the
aspect and writes one summary. Every entry cites the memories of its group (by construction, not
by the model), and its ``position`` is the latest of them, so a query can never see a profile entry
built from evidence after its as_of. A merge the model fails twice falls back to the group's most
recent memory, and says so in ``merged_by``.

Each merge request names its user and stage (``call_tags``), so the asset can send the batch through
``memories.call_ledger.CheckpointedLLM``: a merge finished by an earlier (killed or failed) run is
replayed from its checkpoint, and every merge call is a ``persona_merge`` row of the ledger.
"""

import hashlib
import json
from collections.abc import Sequence
from datetime import datetime, timezone

import numpy as np
import polars as pl

from qumem_pipeline.llm.base import ChatRequest, LLMBackend
from qumem_pipeline.llm.retry import generate_with_retry
from qumem_pipeline.memories.call_ledger import PERSONA_MERGE, call_tags
from qumem_pipeline.query.version import stage_version
from qumem_pipeline.index.per_user_encode import encode_per_user

PROFILE_TYPES = ("preference", "insight")
SIMILARITY = 0.75
MERGE_MAX_TOKENS = 160
MERGE_SYSTEM = (
    "You maintain a user's persona profile. The statements below say nearly the same thing about the "
    "user. Name the aspect they describe in two or three words and merge them into one concise, "
    "stable statement; where they differ, keep the most recent. Answer with JSON only."
)
MERGE_SCHEMA = {
    "type": "object",
    "properties": {"aspect": {"type": "string", "maxLength": 40}, "summary": {"type": "string", "maxLength": 200}},
    "required": ["aspect", "summary"],
    "additionalProperties": False,
}
PROFILE_PROMPT_VERSION = "persona-v1-" + hashlib.sha256(
    json.dumps([MERGE_SYSTEM, MERGE_SCHEMA, SIMILARITY], sort_keys=True).encode()).hexdigest()[:10]
PROFILE_SCHEMA = pl.Schema({
    "user_id": pl.String, "profile_id": pl.String, "aspect": pl.String, "summary": pl.String,
    "memory_ids": pl.List(pl.String), "types": pl.List(pl.String), "position": pl.Int64, "merged_by": pl.String,
    "model": pl.String, "prompt_version": pl.String, "code_version": pl.String, "created_at": pl.Datetime("us", "UTC"),
})


def near_duplicate_groups(vectors: np.ndarray, threshold: float = SIMILARITY) -> list[list[int]]:
    """Connected components of the graph linking rows with cosine >= threshold (unit-norm rows)."""
    n = len(vectors)
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    if n:
        sims = vectors @ vectors.T
        for i, j in zip(*np.nonzero(np.triu(sims >= threshold, k=1))):
            parent[find(int(i))] = find(int(j))
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def profile_id(user_id: str, memory_ids: list[str]) -> str:
    """Stable id of a group: memory ids hash their content, so equal ids mean an equal merge input."""
    return hashlib.sha256(f"{user_id}\x1f{'|'.join(sorted(memory_ids))}".encode()).hexdigest()[:16]


def reusable_merges(previous: pl.DataFrame | None, model: str) -> dict[str, tuple[str, str, str]]:
    """profile_id -> (aspect, summary, merged_by) of finished merge calls, same model and prompt version.

    A rerun after a crash later in the run (or a nightly rebuild of an unchanged user) must not pay
    for the same merge call twice. Finished means answered: merged, or answered unusably twice and
    fallen back (temperature 0 would answer the same again), as decomposition's checkpoints keep
    quarantined calls. A changed group has a different profile_id and is merged again.
    """
    if previous is None or previous.height == 0:
        return {}
    done = previous.filter((pl.col("model") == model) & (pl.col("prompt_version") == PROFILE_PROMPT_VERSION)
                           & ((pl.col("merged_by") == "llm") | pl.col("merged_by").str.starts_with("fallback")))
    return {r["profile_id"]: (r["aspect"], r["summary"], r["merged_by"]) for r in done.iter_rows(named=True)}


def build_profiles(memories: pl.DataFrame, vectors: dict[str, np.ndarray], llm: LLMBackend,
                   created_at: datetime | None = None, previous: pl.DataFrame | None = None) -> pl.DataFrame:
    """Profile entries for every user in ``memories`` (one merge batch for all users' groups).

    ``previous``: earlier profile rows of these users; their finished merges are reused, not re-asked,
    unless ``llm`` can replay the merge from a checkpoint (``would_replay``, ``call_ledger.CheckpointedLLM``),
    which also puts the call back in the run's ledger.
    """
    created_at = created_at or datetime.now(timezone.utc)
    reuse = reusable_merges(previous, llm.model_name)
    mems = memories.filter(pl.col("type").is_in(PROFILE_TYPES)).sort(["user_id", "position", "memory_id"])
    missing = [m for m in mems["memory_id"].to_list() if m not in vectors]
    if missing:
        raise ValueError(f"memories without an embedding: {missing[:5]} (materialize memory_embeddings)")
    groups: list[tuple[str, list[dict]]] = []
    for (user_id,), df in mems.group_by(["user_id"], maintain_order=True):
        rows = df.to_dicts()
        vecs = np.stack([vectors[r["memory_id"]] for r in rows]).astype(np.float32)
        groups += [(user_id, [rows[i] for i in g]) for g in near_duplicate_groups(vecs)]
    pids = [profile_id(u, [r["memory_id"] for r in g]) for u, g in groups]
    requests = {gi: merge_request(user_id, pids[gi], g) for gi, (user_id, g) in enumerate(groups) if len(g) > 1}
    replayable = getattr(llm, "would_replay", None)
    merge = [gi for gi, req in requests.items()
             if pids[gi] not in reuse or (replayable is not None and replayable(req))]
    results = dict(zip(merge, generate_with_retry(llm, [requests[gi] for gi in merge])))
    out = []
    for gi, (user_id, g) in enumerate(groups):
        ids = [r["memory_id"] for r in g]
        latest = max(g, key=lambda r: (r["position"], r["memory_id"]))
        r = results.get(gi)
        if r is None and pids[gi] in reuse:
            aspect, summary, how = reuse[pids[gi]]
        elif r is None:
            aspect, summary, how = latest["type"], latest["content"], "single"
        elif r.ok and r.parsed["summary"].strip():
            aspect, summary, how = r.parsed["aspect"].strip() or latest["type"], r.parsed["summary"].strip(), "llm"
        else:
            aspect, summary, how = latest["type"], latest["content"], f"fallback: {r.error or 'empty summary'}"[:200]
        out.append({
            "user_id": user_id, "profile_id": pids[gi],
            "aspect": aspect, "summary": summary, "memory_ids": ids, "types": sorted({x["type"] for x in g}),
            "position": int(latest["position"]), "merged_by": how,
            "model": llm.model_name if (r is not None or pids[gi] in reuse) else None, "prompt_version": PROFILE_PROMPT_VERSION,
            "code_version": stage_version("persona_profiles"), "created_at": created_at,
        })
    return pl.DataFrame(out, schema=PROFILE_SCHEMA) if out else PROFILE_SCHEMA.to_frame()


def merge_request(user_id: str, pid: str, group: list[dict]) -> ChatRequest:
    """The one merge call of a group (its statements oldest first), named by the group's profile id."""
    return ChatRequest(f"{user_id}/profile-{pid}/merge",
                       [{"role": "system", "content": MERGE_SYSTEM},
                        {"role": "user", "content": "Statements (oldest first):\n" + "\n".join(f"- {r['content']}" for r in group)
                         + '\n\nReturn {"aspect": "...", "summary": "..."}.'}],
                       MERGE_SCHEMA, MERGE_MAX_TOKENS, "persona_merge", metadata=call_tags(user_id, PERSONA_MERGE, pid))


def uncited_profiles(profiles: pl.DataFrame, memories: pl.DataFrame) -> list[str]:
    """Profile ids citing no memory, or a memory id that is not in the memories table."""
    known = set(memories["memory_id"].to_list())
    return [p for p, ids in zip(profiles["profile_id"].to_list(), profiles["memory_ids"].to_list())
            if not ids or any(m not in known for m in ids)]


def vectors_for(memories: pl.DataFrame, embeddings: pl.DataFrame | None, embedder) -> dict[str, np.ndarray]:
    """Memory vectors from the embeddings table when it matches the embedder, else freshly encoded."""
    vec: dict[str, np.ndarray] = {}
    if embeddings is not None and embeddings.height and set(embeddings["embedding_model"].unique()) == {embedder.version}:
        vec = dict(zip(embeddings["memory_id"].to_list(), embeddings["embedding"].to_numpy()))
    todo = [r for r in memories.select("memory_id", "user_id", "content").iter_rows() if r[0] not in vec]
    # each user's contents in calls of its own: a user's groups never depend on the run's other users
    enc = encode_per_user(embedder, [(u, c) for _, u, c in todo])
    vec.update({m: enc[(u, c)] for m, u, c in todo})
    return vec


__all__: Sequence[str] = ["build_profiles", "near_duplicate_groups", "uncited_profiles", "vectors_for",
                          "PROFILE_SCHEMA", "PROFILE_PROMPT_VERSION"]
