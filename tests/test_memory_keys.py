"""Memory index keys: a memory's text plus its source turns (index.memory_keys), in the product and the harness."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from datetime import datetime, timezone

import numpy as np
import polars as pl
import pytest

from qumem_pipeline.index.embeddings import Embedder, embed_memories, embeddings_matrix
from qumem_pipeline.index.memory_keys import SOURCE_WEIGHT, combine, keyed_version, source_texts


@pytest.fixture(scope="module")
def embedder():
    return Embedder.load(device="cpu")


def test_combine_by_hand():
    c = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], np.float32)
    # memory 0: one source turn [0, 1]; memory 1: none; memory 2: two turns whose mean is [0.5, 0.5]
    src = [np.array([[0.0, 1.0]]), None, np.array([[1.0, 0.0], [0.0, 1.0]])]
    k = combine(c, src, 2.0)
    np.testing.assert_allclose(k[0], np.array([1.0, 2.0]) / np.sqrt(5), atol=1e-6)
    np.testing.assert_allclose(k[1], [0.0, 1.0], atol=1e-6)  # no sources: its content alone
    m = np.array([0.5, 0.5]) / np.linalg.norm([0.5, 0.5])
    want = np.array([0.6, 0.8]) + 2 * m
    np.testing.assert_allclose(k[2], want / np.linalg.norm(want), atol=1e-6)
    np.testing.assert_allclose(combine(c, src, 0.0), c)  # weight 0: content vectors as they are
    assert keyed_version("mini@abc", 0) == "mini@abc" and keyed_version("mini@abc", 2.0) == "mini@abc+sources*2"


def _memories(rows):
    return pl.DataFrame(rows, schema={"memory_id": pl.String, "user_id": pl.String, "type": pl.String,
                                      "content": pl.String, "episode_id": pl.String,
                                      "evidence_turn_ids": pl.List(pl.Int64), "position": pl.Int64})


def test_source_texts_look_up_the_owners_turns():
    turns = pl.DataFrame({"user_id": ["u1", "u1", "u2"], "turn_index": [0, 1, 0], "speaker": ["Ann", None, "Bo"],
                          "text": ["I moved to Lyon.", "ok", "I sail."]})
    mems = _memories([
        {"memory_id": "m1", "user_id": "u1", "type": "fact", "content": "Ann lives in Lyon.", "episode_id": "e",
         "evidence_turn_ids": [0, 1, 7], "position": 1},
        {"memory_id": "m2", "user_id": "u2", "type": "fact", "content": "Bo sails.", "episode_id": "e",
         "evidence_turn_ids": [0], "position": 0},
    ])
    # another user's turn 0 is never a source; an id with no turn (7) is skipped; no speaker: text alone
    assert source_texts(mems, turns) == {"m1": ["Ann: I moved to Lyon.", "ok"], "m2": ["Bo: I sail."]}


def test_keys_rank_a_memory_by_what_its_turn_said(embedder):
    """A memory worded away from the question is found through its source turn."""
    mems = _memories([
        {"memory_id": "gift", "user_id": "u", "type": "fact", "content": "Caroline keeps a necklace as a gift.",
         "episode_id": "e", "evidence_turn_ids": [0], "position": 0},
        {"memory_id": "pets", "user_id": "u", "type": "fact", "content": "Caroline has a cat and a dog.",
         "episode_id": "e", "evidence_turn_ids": [1], "position": 1},
    ])
    sources = {"gift": ["Caroline: My grandma gave me this necklace back home in Sweden, where she grew up."],
               "pets": ["Caroline: The cat and the dog keep me busy."]}
    q = embedder.encode(["Which country is Caroline's grandmother from?"])[0]
    plain = embed_memories(mems, embedder)
    keyed = embed_memories(mems, embedder, sources=sources)
    assert set(plain["embedding_model"]) == {embedder.version}
    assert set(keyed["embedding_model"]) == {keyed_version(embedder.version, SOURCE_WEIGHT)}
    gap = lambda df: float(embeddings_matrix(df) @ q @ np.array([1.0, -1.0]))  # score(gift) - score(pets)
    assert gap(keyed) > gap(plain) + 0.1
    np.testing.assert_allclose(np.linalg.norm(embeddings_matrix(keyed), axis=1), 1.0, atol=1e-5)
    # never served from an earlier table: a source turn's text may have changed under the same memory id
    edited = {**sources, "gift": ["Caroline: My aunt gave me this necklace at a fair in Lyon."]}
    again = embed_memories(mems, embedder, sources=edited, previous=keyed)
    assert not np.allclose(embeddings_matrix(again)[0], embeddings_matrix(keyed)[0], atol=1e-3)
    np.testing.assert_allclose(embeddings_matrix(again)[1], embeddings_matrix(keyed)[1], atol=1e-5)
    # content-only rows are not passed off as keys either
    np.testing.assert_allclose(embeddings_matrix(embed_memories(mems, embedder, sources=sources, previous=plain)),
                               embeddings_matrix(keyed), atol=1e-5)


def test_pipeline_keys_memories_by_their_turns(tmp_path, embedder):
    """The embeddings asset's path: turns table -> source texts -> keyed rows the index is built from."""
    from qumem_pipeline.index import vector_store as vi

    ts = datetime(2023, 5, 1, tzinfo=timezone.utc)
    turns = pl.DataFrame({"user_id": ["u", "u"], "turn_index": [0, 1], "speaker": [None, None],
                          "text": ["We adopted a greyhound named Pip.", "Work was long today."],
                          "timestamp": [ts, ts]})
    mems = _memories([
        {"memory_id": "m-dog", "user_id": "u", "type": "fact", "content": "The user has a new family member.",
         "episode_id": "e", "evidence_turn_ids": [0], "position": 0},
        {"memory_id": "m-work", "user_id": "u", "type": "fact", "content": "The user had a long day.",
         "episode_id": "e", "evidence_turn_ids": [1], "position": 1},
    ])
    emb = embed_memories(mems, embedder, sources=source_texts(mems, turns))
    store = vi.VectorStore.in_memory([vi.build_user_indexes(emb, "u")])
    hits = store.search("u", "fact", embedder.encode(["What breed is the user's dog?"]), 2, None)[0]
    assert [h[0] for h in hits][0] == "m-dog"


def test_harness_ranks_memory_units_by_the_same_keys(embedder):
    """The LoCoMo harness keys memory units exactly as the product keys memories (weight 0: text alone)."""
    from qumem_pipeline.eval.locomo.rank import embed_units
    from qumem_pipeline.eval.locomo.units import EvalUnit
    from qumem_pipeline.index.memory_keys import key_vectors

    turns = ["Caroline: My grandma is from Sweden.", "Melanie: I painted a lake.", "Caroline: Nice!"]
    tv = embedder.encode(turns)
    units = [EvalUnit("Caroline's grandma is Swedish.", [(frozenset({"D1:1"}), 4)], source_rows=(0,)),
             EvalUnit("Melanie painted a lake.", [(frozenset({"D1:2", "D1:3"}), 4)], source_rows=(1, 2)),
             EvalUnit("A memory citing nothing that resolved.", [(frozenset(), 6)])]
    plain = embed_units(units, embedder, 8, tv, source_weight=0.0)
    np.testing.assert_allclose(plain, embedder.encode([u.text for u in units]), atol=1e-6)
    keyed = embed_units(units, embedder, 8, tv, source_weight=SOURCE_WEIGHT)
    want = key_vectors([u.text for u in units], [[turns[0]], [turns[1], turns[2]], []], embedder, SOURCE_WEIGHT)
    np.testing.assert_allclose(keyed, want, atol=1e-5)
    np.testing.assert_allclose(keyed[2], plain[2], atol=1e-6)
    with pytest.raises(ValueError, match="turn vectors"):
        embed_units(units, embedder, 8, None, source_weight=SOURCE_WEIGHT)
