"""A user's P(same), embeddings and episodes do not depend on which other users share the run.

The erasure promise (forgetting one user leaves every other user's rows exactly as they were) needs a
user's episode cut to be a function of that user's turns alone. An encoder's output for a row moves
in the last bits with the rows batched beside it (measured on this project's CPUs: the BLAS kernels
differ by matrix shape and row position), so the episodes stage classifies each user in calls of its
own. These tests run the shipped classifier and the base MiniLM encoder on in-repo generated dialogues.
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
