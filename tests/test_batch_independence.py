"""A user's P(same), embeddings and episodes do not depend on which other users share the run.

The erasure promise (forgetting one user leaves every other user's rows exactly as they were) needs a
user's episode cut to be a function of that user's turns alone. An encoder's output for a row moves
in the last bits with the rows batched beside it (measured on this project's CPUs: the BLAS kernels
differ by matrix shape and row position), so the episodes stage classifies each user in calls of its
own, and the index stage embeds each user's memories in calls of their own. These tests run the shipped
classifier and the base MiniLM encoder on in-repo generated dialogues.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import polars as pl
import pytest

from qumem_pipeline.episodes.continuity import ContinuityClassifier
from qumem_pipeline.episodes.continuity.generated_dialogues import generated_dialogues
from qumem_pipeline.episodes.segmentation import build_episodes_for_users

T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def clf() -> ContinuityClassifier:
    return ContinuityClassifier.load(device="cpu")


@pytest.fixture(scope="module")
def histories() -> list[list[str]]:
    return [list(d.utterances) for d in generated_dialogues("calib")[:12]]


def turns_of(user: str, texts: list[str]) -> pl.DataFrame:
    n = len(texts)
    return pl.DataFrame(
        {"user_id": [user] * n, "turn_index": list(range(n)), "role": ["user"] * n, "text": texts,
         "timestamp": [T0 + timedelta(minutes=i) for i in range(n)]},
        schema_overrides={"timestamp": pl.Datetime("us", "UTC")},
    )


def test_pooling_pairs_of_several_histories_would_move_probabilities(clf, histories):
    """Why the per-user calls exist: one call over every history's pairs (as the stage made before)
    gives some pair of history 5 another float32 P(same) than a call over history 5 alone."""
    pairs_of = lambda hs: [(h[i], h[i + 1]) for h in hs for i in range(len(h) - 1)]
    alone = clf.predict_same_proba(pairs_of([histories[5]]))
    offset = len(pairs_of(histories[:5]))
    pooled = clf.predict_same_proba(pairs_of(histories))[offset : offset + len(alone)]
    assert np.allclose(alone, pooled, atol=1e-6)
    assert not np.array_equal(alone, pooled)


def test_signals_of_a_history_are_bit_identical_alone_and_among_others(clf, histories):
    together = clf.history_signals(histories, embeddings=True)
    for k in (0, 5, 11):
        (p, c, e), = clf.history_signals([histories[k]], embeddings=True)
        assert len(p) == len(histories[k]) - 1 and e.shape == (len(histories[k]), 384)
        assert np.array_equal(p, together[k][0]), f"history {k}: P(same) moved with the other histories"
        assert np.array_equal(e, together[k][2]) and np.array_equal(c, together[k][1])
    reordered = clf.history_signals(histories[::-1], embeddings=True)[::-1]
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[2], b[2]) for a, b in zip(reordered, together))


def test_a_users_episodes_are_the_same_whichever_users_share_the_run(clf, histories):
    users = {f"u{k}": turns_of(f"u{k}", h) for k, h in enumerate(histories)}
    seen: list[list[tuple[str, str]]] = []

    def predict(pairs):
        seen.append(pairs)
        return clf.predict_same_proba(pairs)

    kw = dict(rule=clf.rule, classifier_version=clf.version, similarity=clf.pair_cosine,
              embed_histories=clf.history_embeddings)
    progress: list[tuple[int, int]] = []
    everyone, stats = build_episodes_for_users(users, predict, progress=lambda d, n: progress.append((d, n)), **kw)
    # one call per user, each with exactly that user's adjacent pairs; progress after each
    assert [len(p) for p in seen] == [len(h) - 1 for h in histories]
    assert [d for d, _ in progress] == list(np.cumsum([len(h) - 1 for h in histories]))
    assert {n for _, n in progress} == {sum(len(h) - 1 for h in histories)}
    assert stats.episodes > len(histories)  # the dialogues are joins: every user gets cut
    for drop in ("u0", "u5"):
        rest = {u: t for u, t in users.items() if u != drop}
        without, _ = build_episodes_for_users(rest, clf.predict_same_proba, **kw)
        for u in rest:
            assert without[u].equals(everyone[u]), f"forgetting {drop} moved {u}'s episodes"
    alone, _ = build_episodes_for_users({"u7": users["u7"]}, clf.predict_same_proba, **kw)
    assert alone["u7"].equals(everyone["u7"])


@pytest.fixture(scope="module")
def embedder():
    from qumem_pipeline.index.embeddings import Embedder

    return Embedder.load(device="cpu")


def _memories_of(users: dict[str, list[str]]) -> tuple[pl.DataFrame, dict[str, list[str]]]:
    """Each utterance of a history as one memory of its user, sourced by the utterance after it."""
    rows, sources = [], {}
    for u, texts in users.items():
        for i, t in enumerate(texts[:-1]):
            mid = f"{u}-m{i}"
            rows.append({"memory_id": mid, "user_id": u, "type": "fact", "content": t, "position": i})
            sources[mid] = [texts[i + 1]]
    return pl.DataFrame(rows), sources


def test_a_users_memory_keys_are_the_same_whichever_users_share_the_run(embedder, histories):
    """The index stage embeds a run's memories: each user's in calls of its own, so their keys are
    bit-identical with the user alone, among others and with one of the others forgotten."""
    from qumem_pipeline.index.embeddings import embed_memories, embeddings_matrix

    # why: one encode over every user's texts (as the stage made before) moves history 5's vectors
    offset = sum(len(h) for h in histories[:5])
    pooled = embedder.encode([t for h in histories for t in h], batch_size=32)[offset : offset + len(histories[5])]
    alone = embedder.encode(histories[5], batch_size=32)
    assert np.allclose(alone, pooled, atol=1e-5) and not np.array_equal(alone, pooled)
    users = {f"u{k}": h for k, h in enumerate(histories)}
    mems, sources = _memories_of(users)
    everyone = embed_memories(mems, embedder, sources=sources, batch_size=32)
    assert everyone["memory_id"].to_list() == mems["memory_id"].to_list()  # input order kept
    progress: list[tuple[int, int]] = []
    embed_memories(mems, embedder, sources=sources, batch_size=32, progress=lambda d, n: progress.append((d, n)))
    assert progress[-1] == (mems.height, mems.height) and [d for d, _ in progress] == sorted(d for d, _ in progress)
    for keep in (["u3"], [u for u in users if u != "u0"], list(users)[::-1]):
        part = mems.filter(pl.col("user_id").is_in(keep))
        got = embed_memories(part, embedder, sources=sources, batch_size=32)
        want = everyone.filter(pl.col("user_id").is_in(keep))
        for u in keep:
            a = embeddings_matrix(got.filter(pl.col("user_id") == u))
            b = embeddings_matrix(want.filter(pl.col("user_id") == u))
            assert np.array_equal(a, b), f"user {u}'s memory keys moved with the users beside it ({keep[:3]})"


def test_a_users_retrieval_is_the_same_whichever_users_share_the_query_batch(embedder, histories):
    """The query stage batches every query of a run; each user's query texts are embedded in calls of
    their own, so a user's candidates and their float scores are bit-identical with its queries alone
    and among every other user's (a near tie turned on those bits, and with it the A3 prompt and its paid
    call). Also the persona profiles' content vectors (`profiles.vectors_for`)."""
    from qumem_pipeline.index.embeddings import embed_memories
    from qumem_pipeline.index.vector_store import VectorStore, build_user_indexes
    from qumem_pipeline.query.retrieval import PlannedQuery, RetrievalRequest, execute_plans
    from qumem_pipeline.query.strategies.adamem.profiles import vectors_for

    users = {f"u{k}": h for k, h in enumerate(histories)}
    mems, sources = _memories_of(users)
    emb = embed_memories(mems, embedder, sources=sources)
    store = VectorStore.in_memory([build_user_indexes(emb.filter(pl.col("user_id") == u), u) for u in users])
    # each user asks with the other users' utterances too: many texts of many lengths in one batch
    requests = [RetrievalRequest(f"{u}/q{j}", u, [PlannedQuery(t), PlannedQuery(t[: max(8, len(t) // 2)])])
                for k, u in enumerate(users) for j, t in enumerate(histories[(k + 3) % len(histories)][:6])]
    everyone = execute_plans(requests, store, embedder, k=4)
    for keep in ("u2", "u9"):
        mine = [i for i, r in enumerate(requests) if r.user_id == keep]
        alone = execute_plans([requests[i] for i in mine], store, embedder, k=4)
        assert [[(c.memory_id, c.score) for c in row] for row in alone] == \
            [[(c.memory_id, c.score) for c in everyone[i]] for i in mine], f"{keep}'s retrieval moved with the batch"
    together = vectors_for(mems, None, embedder)
    part = vectors_for(mems.filter(pl.col("user_id") == "u4"), None, embedder)
    assert all(np.array_equal(v, together[m]) for m, v in part.items()) and part
