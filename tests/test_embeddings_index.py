"""Embedder (offline MiniLM), per-type FAISS indexes: build/write/load, stable ids, no future evidence."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import faiss
import numpy as np
import polars as pl
import pytest

from qumem_pipeline.index import vector_store as vi
from qumem_pipeline.index.embeddings import DIM, Embedder, embed_memories, embedding_schema, embeddings_matrix
from qumem_pipeline.storage.layout import DataLayout


@pytest.fixture(scope="module")
def embedder():
    return Embedder.load(device="cpu")


def _unit(rng, n, dim=DIM):
    v = rng.normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _emb_frame(user, mids, types, positions, vecs, model="test-model@0"):
    return pl.DataFrame(
        {
            "memory_id": mids,
            "user_id": [user] * len(mids),
            "type": types,
            "position": positions,
            "embedding": pl.Series(vecs, dtype=pl.Array(pl.Float32, vecs.shape[1])),
            "embedding_model": [model] * len(mids),
        },
        schema=embedding_schema(vecs.shape[1]),
    )


# ---------------------------------------------------------------------------------------- embedder


def test_embedder_offline_normalised_and_ordered(embedder):
    assert embedder.dim == 384
    assert embedder.version.startswith("all-MiniLM-L6-v2@") and len(embedder.version.split("@")[1]) == 12
    texts = ["I adopted a golden retriever puppy.", "word " * 400, "", "My dog is a golden retriever."]
    v = embedder.encode(texts, batch_size=2)
    assert v.dtype == np.float32 and v.shape == (4, 384)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    # length-sorted batching does not change results or order
    single = np.stack([embedder.encode([t])[0] for t in texts])
    np.testing.assert_allclose(v, single, atol=1e-5)
    assert v[0] @ v[3] > v[0] @ v[1]
    assert embedder.encode([]).shape == (0, 384)


def test_embedder_matches_sentence_transformers(embedder):
    st = pytest.importorskip("sentence_transformers")
    from qumem_pipeline.index.embeddings import model_dir

    ref = st.SentenceTransformer(model_dir(), device="cpu")
    texts = ["I prefer window seats on long flights.", "The user joined a swimming club."]
    np.testing.assert_allclose(embedder.encode(texts), ref.encode(texts, normalize_embeddings=True), atol=1e-5)


def test_embed_memories_schema_and_reuse(embedder):
    mem = pl.DataFrame(
        {
            "memory_id": ["m1", "m2", "m3"],
            "user_id": ["alice", "alice", "bob"],
            "type": ["fact", "preference", "insight"],
            "content": ["Alice moved to Lisbon.", "Alice prefers window seats.", "Bob likes calm places."],
            "position": [3, 5, 1],
        }
    )
    df = embed_memories(mem, embedder)
    assert df.schema == embedding_schema(384)
    assert df["memory_id"].to_list() == ["m1", "m2", "m3"]
    assert set(df["embedding_model"].to_list()) == {embedder.version}
    mat = embeddings_matrix(df)
    np.testing.assert_allclose(np.linalg.norm(mat, axis=1), 1.0, atol=1e-5)

    # rows with a matching (memory_id, model) are reused, not re-encoded
    fake_prev = df.with_columns(
        pl.when(pl.col("memory_id") == "m1").then(pl.lit("m1")).otherwise(pl.lit("gone")).alias("memory_id")
    )
    marker = np.zeros((1, 384), np.float32)
    marker[0, 0] = 1.0
    fake_prev = fake_prev.head(1).with_columns(pl.Series("embedding", marker, dtype=pl.Array(pl.Float32, 384)))
    again = embed_memories(mem, embedder, previous=fake_prev)
    np.testing.assert_array_equal(embeddings_matrix(again)[0], marker[0])
    np.testing.assert_allclose(embeddings_matrix(again)[1:], mat[1:], atol=1e-6)
    # a different model version is never reused
    other = fake_prev.with_columns(pl.lit("other-model@1").alias("embedding_model"))
    np.testing.assert_allclose(embeddings_matrix(embed_memories(mem, embedder, previous=other)), mat, atol=1e-6)
    assert embed_memories(mem.head(0), embedder).height == 0


# ---------------------------------------------------------------------------------------- ids


def test_stable_ids_deterministic_nonnegative():
    a = vi.stable_id("mem-123")
    assert a == vi.stable_id("mem-123") and 0 <= a < 2**63
    ids = vi.assign_ids([f"m{i}" for i in range(1000)])
    assert ids.dtype == np.int64 and (ids >= 0).all() and len(set(ids.tolist())) == 1000
    # the same memory keeps its id whatever else is in the batch
    assert vi.assign_ids(["x", "m5"])[1] == ids[5]


def test_id_collision_detected(monkeypatch):
    monkeypatch.setattr(vi, "stable_id", lambda m: 42)
    with pytest.raises(vi.IdCollisionError):
        vi.assign_ids(["a", "b"])
    vi.assign_ids(["a", "a"])  # the same memory twice is not a collision


# ---------------------------------------------------------------------------------------- index


def test_build_write_load_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    n = 30
    vecs = _unit(rng, n)
    types = [vi.MEMORY_TYPES[i % 3] for i in range(n)]
    df = _emb_frame("alice", [f"m{i}" for i in range(n)], types, list(range(n)), vecs)
    layout = DataLayout(tmp_path)
    ux, paths = vi.build_and_write_user_indexes(layout, df, "alice", use_gpu=False)
    assert ux.built_on == "cpu"
    rows = layout.read_user_table("indexes", "alice")
    assert sorted(rows["type"]) == sorted(vi.MEMORY_TYPES) and rows["faiss"].dtype == pl.Binary
    assert not list(tmp_path.rglob("*.faiss")), "indexes are table rows, not per-user files"
    idmap = layout.read_user_table("index_ids", "alice")
    assert idmap.height == n and idmap["id"].dtype == pl.Int64
    assert dict(zip(idmap["memory_id"], idmap["id"])) == {f"m{i}": vi.stable_id(f"m{i}") for i in range(n)}
    assert not list(tmp_path.rglob(".tmp-*"))

    loaded = vi.load_user_indexes(layout, "alice")
    assert isinstance(loaded.by_type["fact"].index, faiss.IndexIDMap2)
    assert loaded.embedding_model == "test-model@0"
    for t in vi.MEMORY_TYPES:
        assert loaded.by_type[t].ntotal == sum(1 for x in types if x == t)
    # each memory is its own best match, with the right id/position
    store = vi.VectorStore(layout)
    hits = store.search("alice", "preference", vecs[[1, 4]], k=1)
    assert [h[0][0] for h in hits] == ["m1", "m4"] and hits[0][0][2] == 1
    assert hits[0][0][1] == pytest.approx(1.0, abs=1e-5)
    # rebuilding gives the same ids
    ux2 = vi.build_user_indexes(df.reverse(), "alice", use_gpu=False)
    assert set(ux2.by_type["fact"].ids.tolist()) == set(ux.by_type["fact"].ids.tolist())
    # unknown user: empty results, not an error
    assert store.search("nobody", "fact", vecs[:2], k=3) == [[], []]


def test_batched_load_equals_per_user_load(tmp_path):
    """`preload` reads every user's indexes in one read per table: the same indexes as one user at a time."""
    rng = np.random.default_rng(2)
    layout = DataLayout(tmp_path)
    for user, n in (("alice", 7), ("bob", 4)):
        vecs = _unit(rng, n)
        types = [vi.MEMORY_TYPES[i % 3] for i in range(n)]
        vi.build_and_write_user_indexes(layout, _emb_frame(user, [f"{user}{i}" for i in range(n)], types,
                                                           list(range(n)), vecs), user, use_gpu=False)
    batched = vi.load_users_indexes(layout, ["bob", "nobody", "alice"])
    assert list(batched) == ["bob", "nobody", "alice"] and batched["nobody"] is None
    for user in ("alice", "bob"):
        one = vi.load_user_indexes(layout, user)
        for t in vi.MEMORY_TYPES:
            a, b = batched[user].by_type[t], one.by_type[t]
            assert a.ids.tolist() == b.ids.tolist() and a.memory_ids == b.memory_ids
            assert a.positions.tolist() == b.positions.tolist() and a.ntotal == b.ntotal
    store = vi.VectorStore(layout)
    store.preload(["alice", "bob", "nobody"])
    probe = _unit(rng, 1)
    assert store.search("alice", "fact", probe, k=3) == vi.VectorStore(layout).search("alice", "fact", probe, k=3)
    assert store.search("nobody", "fact", probe, k=3) == [[]]


def test_empty_types_and_stale_detection(tmp_path):
    rng = np.random.default_rng(1)
    vecs = _unit(rng, 2)
    df = _emb_frame("bob", ["a", "b"], ["fact", "fact"], [0, 1], vecs)
    layout = DataLayout(tmp_path)
    vi.build_and_write_user_indexes(layout, df, "bob", use_gpu=False)
    loaded = vi.load_user_indexes(layout, "bob")
    assert loaded.by_type["insight"].ntotal == 0
    assert loaded.search("insight", vecs, k=5) == [[], []]
    # an index file that disagrees with the id map is refused, not served
    other = vi.build_user_indexes(_emb_frame("bob", ["c"], ["fact"], [0], vecs[:1]), "bob", use_gpu=False)
    layout.write_user_table("indexes", "bob", vi.index_frame(other))
    with pytest.raises(vi.StaleIndexError):
        vi.load_user_indexes(layout, "bob")


def test_unknown_type_rejected():
    assert vi.normalize_type("F") == "fact" and vi.normalize_type("preferences") == "preference"
    with pytest.raises(ValueError):
        vi.normalize_type("episodes")


# ---------------------------------------------------------------------------------------- as_of


@pytest.mark.parametrize("use_selector", [True, False])
def test_no_future_evidence_even_when_best_match(tmp_path, use_selector):
    """A memory after as_of is never retrieved, even when it is the exact best match."""
    rng = np.random.default_rng(2)
    n = 40
    vecs = _unit(rng, n)
    positions = list(range(n))
    df = _emb_frame("carol", [f"m{i}" for i in range(n)], ["fact"] * n, positions, vecs)
    layout = DataLayout(tmp_path)
    vi.build_and_write_user_indexes(layout, df, "carol", use_gpu=False)
    store = vi.VectorStore(layout)
    # queries are exactly the future memories' vectors (the best possible matches)
    future = [35, 36, 37, 38, 39]
    for as_of in (0, 5, 20, 34):
        res = store.search("carol", "fact", vecs[future], k=5, as_of_position=as_of, use_selector=use_selector)
        for qi, hits in enumerate(res):
            assert all(p <= as_of for _, _, p in hits)
            assert len(hits) == min(5, as_of + 1)  # filtered results are refilled up to k
            # and they are the best eligible memories, in score order
            q = vecs[future[qi]]
            eligible = np.argsort(-(vecs[: as_of + 1] @ q))[: len(hits)]
            assert [h[0] for h in hits] == [f"m{i}" for i in eligible]
    # before any memory: nothing
    df2 = df.with_columns((pl.col("position") + 100).alias("position"))
    vi.build_and_write_user_indexes(layout, df2, "carol", use_gpu=False)
    store.invalidate("carol")
    assert store.search("carol", "fact", vecs[:3], k=5, as_of_position=99, use_selector=use_selector) == [[], [], []]
    # as_of None: everything eligible
    assert store.search("carol", "fact", vecs[39], k=1, as_of_position=None)[0][0][0] == "m39"


def test_per_row_as_of_matches_single_as_of_searches():
    """One search with a different as_of per query row == separate exact searches; never a future memory."""
    rng = np.random.default_rng(5)
    n = 60
    vecs = _unit(rng, n)
    positions = rng.permutation(n).tolist()
    ux = vi.build_user_indexes(_emb_frame("fay", [f"m{i}" for i in range(n)], ["fact"] * n, positions, vecs), use_gpu=False)
    # queries are the latest memories' own vectors: each is the best match for itself
    latest = np.argsort(positions)[-8:]
    as_ofs = [0, 3, 10, None, 30, 58, 59, 5]
    batched = ux.search("fact", vecs[latest], k=4, as_of_position=as_ofs)
    for r, a in enumerate(as_ofs):
        single = ux.search("fact", vecs[latest[r]], k=4, as_of_position=a)[0]
        assert [h[0] for h in batched[r]] == [h[0] for h in single]
        assert a is None or all(p <= a for _, _, p in batched[r])
        assert len(batched[r]) == min(4, n if a is None else a + 1)


def test_search_at_or_before_is_inclusive():
    rng = np.random.default_rng(3)
    vecs = _unit(rng, 3)
    ux = vi.build_user_indexes(_emb_frame("dan", ["a", "b", "c"], ["insight"] * 3, [2, 7, 9], vecs), use_gpu=False)
    assert [h[0] for h in ux.search("I", vecs[1], k=3, as_of_position=7)[0]] == ["b", "a"]


# ---------------------------------------------------------------------------------------- GPU


def _gpu_skip_reason() -> str | None:
    if not hasattr(faiss, "StandardGpuResources"):
        return "faiss has no GPU support (faiss-cpu installed)"
    try:
        if faiss.get_num_gpus() == 0:
            return "no CUDA GPU visible to faiss"
    except Exception as e:  # pragma: no cover
        return f"faiss GPU query failed: {e}"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=_gpu_skip_reason() or "")
def test_gpu_build_matches_cpu(tmp_path):
    rng = np.random.default_rng(4)
    n = 200
    vecs = _unit(rng, n)
    df = _emb_frame("erin", [f"m{i}" for i in range(n)], [vi.MEMORY_TYPES[i % 3] for i in range(n)], list(range(n)), vecs)
    layout = DataLayout(tmp_path)
    gpu_ux, _ = vi.build_and_write_user_indexes(layout, df, "erin", use_gpu=True)
    assert gpu_ux.built_on == "gpu"
    assert vi.gpu_resources() is vi.gpu_resources()  # one StandardGpuResources reused
    cpu_ux = vi.build_user_indexes(df, "erin", use_gpu=False)
    loaded = vi.load_user_indexes(layout, "erin")
    q = vecs[:10]
    for t in vi.MEMORY_TYPES:
        a = loaded.search(t, q, k=5, as_of_position=120)
        b = cpu_ux.search(t, q, k=5, as_of_position=120)
        assert [[h[0] for h in r] for r in a] == [[h[0] for h in r] for r in b]
