"""BM25 keyword backoff recovers an exact rare word that dense retrieval (all-MiniLM) misses."""

import numpy as np
import pytest

from qumem_pipeline.query.strategies.adamem.lexical import BM25Index
from tests import adamem_data as data

RARE = "We finally named the new sourdough starter Brembleworth, it bubbles every morning."
TEXTS = data.TEXTS + [RARE]
TARGET = len(TEXTS) - 1
QUESTIONS = ["Did the adoption agency mention Brembleworth?", "Does the adoption agency know about Brembleworth yet?"]


@pytest.fixture(scope="module")
def embedder():
    from qumem_pipeline.index.embeddings import Embedder

    return Embedder.load(device="cpu")


@pytest.mark.parametrize("question", QUESTIONS)
def test_backoff_finds_rare_word_dense_misses(embedder, question):
    vecs = embedder.encode(TEXTS)
    dense_top3 = np.argsort(-(vecs @ embedder.encode([question])[0]), kind="stable")[:3].tolist()
    assert TARGET not in dense_top3, "the fixture must be a dense miss"
    index = BM25Index.build([f"turn:{i}" for i in range(len(TEXTS))], TEXTS, list(range(len(TEXTS))))
    assert index.salient_terms(question) == ["brembleworth"]
    hits = index.backoff(question, 3)
    assert hits[0][0] == f"turn:{TARGET}"
    # as_of before the turn: it is never returned
    assert all(doc != f"turn:{TARGET}" for doc, _, _ in index.backoff(question, 3, as_of_position=TARGET - 1))


def test_bm25_scoring_basics():
    index = BM25Index.build(["a", "b", "c"], ["red apple pie", "green apple", "blue sky sky"], [0, 1, 2])
    s = index.scores("sky")
    assert s[2] > 0 and s[0] == s[1] == 0
    assert [d for d, _, _ in index.search("apple pie", 3)] == ["a", "b"]  # more matched words rank higher
    assert index.search("nothing matches", 3) == [] and index.backoff("the of and", 3) == []
    with pytest.raises(ValueError, match="same length"):
        BM25Index.build(["a"], ["x", "y"], [0])


def _reference_cases():
    from qumem_pipeline.runtime.datasets import shared_datasets_dir

    qs = QUESTIONS + ["red apple pie", "the of and", "adoption agency", *data.TEXTS]
    cases = [(TEXTS, qs)]
    dev = shared_datasets_dir() / "locomo" / "locomo_dev5.json"
    if dev.is_file():  # a real conversation's turns and questions, when the shared datasets are here
        import json

        sample = json.loads(dev.read_text())[0]
        conv = sample["conversation"]
        turns = [t.get("text", "") for k, v in conv.items() if k.startswith("session_") and isinstance(v, list)
                 for t in v]
        cases.append((turns, [q["question"] for q in sample["qa"]]))
    return cases


def test_bm25s_index_ranks_exactly_as_the_hand_written_loop():
    """The bm25s-backed index against the loop it replaced (tests/bm25_reference.py, verbatim)."""
    from tests.bm25_reference import BM25Index as Reference

    for texts, queries in _reference_cases():
        pos = list(range(len(texts)))
        ids = [f"turn:{i}" for i in pos]
        ours, ref = BM25Index.build(ids, texts, pos), Reference.build(ids, texts, pos)
        for q in queries:
            np.testing.assert_allclose(ours.scores(q), ref.scores(q), rtol=1e-12, atol=0)
            assert [d for d, _, _ in ours.search(q, len(texts))] == [d for d, _, _ in ref.search(q, len(texts))], q
            assert ours.salient_terms(q) == ref.salient_terms(q), q
            for as_of in (None, len(texts) // 2):
                assert [d for d, _, _ in ours.backoff(q, 10, as_of)] == [d for d, _, _ in ref.backoff(q, 10, as_of)], q
    empty = BM25Index.build([], [], [])
    assert empty.search("anything", 3) == [] and empty.scores("x").shape == (0,)
