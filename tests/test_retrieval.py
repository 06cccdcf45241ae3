"""Plan execution (batched, as_of-filtered, merged + de-duplicated) and the single top-k baseline."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import polars as pl
import pytest

from qumem_pipeline.index import vector_store as vi
from qumem_pipeline.index.embeddings import embedding_schema
from qumem_pipeline.query.retrieval import (
    PlannedQuery,
    RetrievalRequest,
    execute_plans,
    retrieve_baseline,
)
from qumem_pipeline.storage.layout import DataLayout

DIM = 8


class FakeEmbedder:
    """Texts 'e<i>' map to basis vector i (others to a fixed mix); counts encode calls."""

    dim = DIM
    version = "fake@0"

    def __init__(self):
        self.calls = []

    def vec(self, text):
        v = np.zeros(DIM, np.float32)
        for part in text.split("+"):
            v[int(part.strip()[1:])] += 1.0
        return v / np.linalg.norm(v)

    def encode(self, texts, batch_size=128, progress=None):
        self.calls.append(list(texts))
        return np.stack([self.vec(t) for t in texts]) if texts else np.zeros((0, DIM), np.float32)


def _store(tmp_path, rows):
    """rows: (user, memory_id, type, position, text) with text an 'e<i>' expression."""
    emb = FakeEmbedder()
    df = pl.DataFrame(
        {
            "memory_id": [r[1] for r in rows],
            "user_id": [r[0] for r in rows],
            "type": [r[2] for r in rows],
            "position": [r[3] for r in rows],
            "embedding": pl.Series(np.stack([emb.vec(r[4]) for r in rows]), dtype=pl.Array(pl.Float32, DIM)),
            "embedding_model": ["fake@0"] * len(rows),
        },
        schema=embedding_schema(DIM),
    )
    layout = DataLayout(tmp_path)
    for u in df["user_id"].unique().to_list():
        vi.build_and_write_user_indexes(layout, df, u, use_gpu=False)
    return vi.VectorStore(layout)


ROWS = [
    ("alice", "f_swim", "fact", 2, "e0"),
    ("alice", "f_swim_late", "fact", 50, "e0"),  # best match for e0, but in the future for as_of=10
    ("alice", "f_run", "fact", 3, "e1"),
    ("alice", "p_calm", "preference", 4, "e0+e2"),
    ("alice", "p_tea", "preference", 5, "e3"),
    ("alice", "i_lowkey", "insight", 6, "e0+e2+e4"),
    ("bob", "b_fact", "fact", 1, "e0"),
]


def test_plan_merge_dedup_max_score_and_batching(tmp_path):
    store = _store(tmp_path, ROWS)
    emb = FakeEmbedder()
    req = RetrievalRequest(
        "q1", "alice",
        [PlannedQuery("e0", ("F", "P")), PlannedQuery("e2", ("preference", "insight")), PlannedQuery("e0", ("fact",))],
        as_of_position=10,
    )
    other = RetrievalRequest("q2", "bob", [PlannedQuery("e0", ("fact",))], as_of_position=None)
    out = execute_plans([req, other], store, emb, k=2)
    # one encode call per user, each with that user's unique texts (batch independence across users)
    assert sorted(sorted(c) for c in emb.calls) == [["e0"], ["e0", "e2"]]
    cands = out[0]
    ids = [c.memory_id for c in cands]
    assert len(ids) == len(set(ids))  # de-duplicated
    assert "f_swim_late" not in ids  # never future evidence
    assert ids[0] == "f_swim" and cands[0].score == pytest.approx(1.0)
    by = {c.memory_id: c for c in cands}
    # p_calm found by sub-queries 0 (score 1/sqrt2) and 1 (same): merged once, max score kept
    assert by["p_calm"].sub_queries == [0, 1]
    assert by["p_calm"].score == pytest.approx(1 / np.sqrt(2), abs=1e-5)
    assert by["f_swim"].sub_queries == [0, 2]
    assert by["i_lowkey"].type == "insight"
    assert all(cands[i].score >= cands[i + 1].score for i in range(len(cands) - 1))
    assert [c.memory_id for c in out[1]] == ["b_fact"]  # users never mix


def test_plan_respects_chosen_stores_and_k(tmp_path):
    store = _store(tmp_path, ROWS)
    out = execute_plans([RetrievalRequest("q", "alice", [PlannedQuery("e3", ("P",))], 100)], store, FakeEmbedder(), k=1)
    assert [(c.memory_id, c.type) for c in out[0]] == [("p_tea", "preference")]
    # as_of None sees the late memory: both e0 facts tie for the top, so k=2 must return both
    out = execute_plans([RetrievalRequest("q", "alice", [PlannedQuery("e0", ("F",))])], store, FakeEmbedder(), k=2)
    assert sorted(c.memory_id for c in out[0]) == ["f_swim", "f_swim_late"]


def test_planned_query_validation():
    assert PlannedQuery("x", ["F", "fact", "I"]).types == ("fact", "insight")
    with pytest.raises(ValueError):
        PlannedQuery("x", ())
    with pytest.raises(ValueError):
        PlannedQuery("x", ("episodes",))
    with pytest.raises(ValueError):
        PlannedQuery("  ", ("F",))


def test_baseline_single_topk_over_all_types(tmp_path):
    store = _store(tmp_path, ROWS)
    emb = FakeEmbedder()
    res = retrieve_baseline([("q1", "alice", "e0", 10), ("q2", "alice", "e2", 10), ("q3", "nobody", "e0", None)],
                            store, emb, k=3)
    assert sorted(sorted(c) for c in emb.calls) == [["e0"], ["e0", "e2"]]  # one encode call per user
    assert [c.memory_id for c in res[0]] == ["f_swim", "p_calm", "i_lowkey"]  # across types, global top-3
    assert len(res[1]) == 3 and all(c.position <= 10 for r in res[:2] for c in r)
    assert res[2] == []


def test_baseline_with_real_embedder(tmp_path):
    from qumem_pipeline.index.embeddings import Embedder, embed_memories

    emb = Embedder.load(device="cpu")
    mem = pl.DataFrame(
        {
            "memory_id": ["m1", "m2", "m3", "m4"],
            "user_id": ["alice"] * 4,
            "type": ["fact", "preference", "insight", "preference"],
            "content": [
                "Alice adopted a golden retriever puppy named Max.",
                "Alice prefers aisle seats on flights.",
                "Alice tends to pick quiet, low-pressure places to relax.",
                "Alice now prefers window seats on flights.",
            ],
            "position": [1, 2, 3, 9],
        }
    )
    layout = DataLayout(tmp_path)
    vi.build_and_write_user_indexes(layout, embed_memories(mem, emb), "alice", use_gpu=False)
    store = vi.VectorStore(layout)
    res = retrieve_baseline([("q1", "alice", "What kind of dog does Alice have?", 5),
                             ("q2", "alice", "Which seat does Alice like on a plane?", 5)], store, emb, k=1)
    assert res[0][0].memory_id == "m1"
    assert res[1][0].memory_id == "m2"  # m4 (later) is out of reach at as_of=5
