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
