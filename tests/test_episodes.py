"""Episode construction on hand-made decision sequences (no model needed)."""

from datetime import datetime, timedelta, timezone

import numpy as np
import polars as pl
import pytest

from qumem_pipeline.episodes.continuity.decoding import DecisionRule
from qumem_pipeline.episodes.segmentation import (
    build_episodes_for_users,
    build_units,
    build_user_episodes,
    enforce_budget,
    episode_id,
    segment,
)

T0 = datetime(2024, 1, 1, tzinfo=timezone.utc)


def history(roles, user="alice", text="word " * 8):
    n = len(roles)
    return pl.DataFrame(
        {
            "user_id": [user] * n,
            "turn_index": list(range(n)),
            "role": roles,
            "text": [f"{text}{i}" for i in range(n)],
            "timestamp": [T0 + timedelta(minutes=i) for i in range(n)],
        },
        schema_overrides={"timestamp": pl.Datetime("us", "UTC")},
    )


def eps(roles, p, threshold=0.5, budget=10_000, **kw):
    return build_user_episodes(history(roles, **kw), np.array(p, dtype=np.float32), threshold=threshold,
                               classifier_version="test-v1", token_budget=budget)


def test_units_keep_replies_and_leading_context():
    units = build_units(["assistant", "user", "assistant", "user", "other", "other"], list(range(6)), [1] * 6)
    assert [u.turn_ids for u in units] == [[0, 1, 2], [3, 4, 5]]


def test_units_move_a_new_sessions_opening_context_to_its_first_utterance():
    roles = ["user", "assistant", "other", "user", "assistant", "other"]
    sessions = ["s1", "s1", "s2", "s2", "s2", "s3"]  # "other" opens s2; a trailing s3 turn stays last
    units = build_units(roles, list(range(6)), [1] * 6, sessions)
    assert [u.turn_ids for u in units] == [[0, 1], [2, 3, 4, 5]]
    assert [u.turn_ids for u in build_units(roles, list(range(6)), [1] * 6)] == [[0, 1, 2], [3, 4, 5]]


def test_a_new_session_always_starts_an_episode():
    roles = ["user", "assistant", "other", "user", "assistant", "user"]
    df = history(roles).with_columns(conversation_id=pl.lit("c1"), session_id=pl.Series(["s1", "s1", "s2", "s2", "s2", "s2"]))
    p = np.array([0.99, 0.99], dtype=np.float32)  # the classifier says "same event" throughout
    split = build_user_episodes(df, p, threshold=0.5, classifier_version="t")
    assert split["turn_ids"].to_list() == [[0, 1], [2, 3, 4, 5]]
    assert split["boundary_prob"][1] == pytest.approx(0.01, abs=1e-6)  # the classifier's view is kept
    assert not split["forced_split"][1]  # a session break, not a token-budget split
    whole = build_user_episodes(df, p, threshold=0.5, classifier_version="t", break_on_session=False)
    assert whole["turn_ids"].to_list() == [list(range(6))]
    # another conversation with the same session id is another session too
    conv = df.with_columns(session_id=pl.lit("s"), conversation_id=pl.Series(["a", "a", "a", "a", "a", "b"]))
    assert build_user_episodes(conv, p, threshold=0.5, classifier_version="t")["turn_ids"].to_list() == [[0, 1, 2, 3, 4], [5]]


def test_first_utterance_only():
    df = eps(["user", "assistant"], [])
    assert df.height == 1 and df["turn_ids"].to_list() == [[0, 1]]
    assert df["boundary_prob"][0] is None and df["min_continuity"][0] is None


def test_all_continue_is_one_episode_with_all_turns():
    df = eps(["user", "assistant"] * 4, [0.9, 0.8, 0.95])
    assert df.height == 1
    assert df["turn_ids"][0].to_list() == list(range(8))
    assert df["n_user_turns"][0] == 4 and df["min_continuity"][0] == pytest.approx(0.8)
    assert df["start_ts"][0] == T0 and df["end_ts"][0] == T0 + timedelta(minutes=7)


def test_all_break_gives_one_episode_per_user_utterance():
    df = eps(["user", "assistant"] * 3, [0.1, 0.2])
    assert df["turn_ids"].to_list() == [[0, 1], [2, 3], [4, 5]]
    assert df["boundary_prob"].to_list()[1:] == pytest.approx([0.9, 0.8])
    assert df["episode_index"].to_list() == [0, 1, 2]


def test_mixed_decisions():
    assert segment([0.9, 0.1, 0.9, 0.4], 0.5) == [(0, 2), (2, 4), (4, 5)]


def test_segment_applies_the_artifacts_decision_rule():
    p = [0.9, 0.5, 0.9, 0.1, 0.2, 0.9]
    # plain: only the two strong breaks
    assert segment(p, DecisionRule(0.3)) == [(0, 4), (4, 5), (5, 7)]
    # + a local dip below 0.6 at gap 1; min segment 2 drops the weaker of the adjacent breaks 3/4
    rule = DecisionRule(0.3, peak_threshold=0.6, min_segment=2)
    assert segment(p, rule) == [(0, 2), (2, 4), (4, 7)]
    assert segment([], rule) == [(0, 1)]
    df = build_user_episodes(history(["user"] * 7), np.array(p, dtype=np.float32), rule=rule,
                             classifier_version="v2", token_budget=10_000)
    assert df["turn_ids"].to_list() == [[0, 1], [2, 3], [4, 5, 6]]
    # boundary_prob stays the raw classifier output at each episode start
    assert df["boundary_prob"].to_list()[1:] == pytest.approx([0.5, 0.9])


def test_rule_or_threshold_exactly_one():
    with pytest.raises(ValueError, match="exactly one of rule="):
        build_user_episodes(history(["user"] * 2), np.array([0.5]), classifier_version="v")
    with pytest.raises(ValueError, match="exactly one of rule="):
        build_user_episodes(history(["user"] * 2), np.array([0.5]), threshold=0.5, rule=DecisionRule(0.5),
                            classifier_version="v")


def test_forced_split_at_weakest_link_is_counted():
    # 4 units of ~equal size; all continue, but the budget fits only 2 units.
    tokens = [10, 10, 10, 10]
    spans, forced, oversize = enforce_budget([(0, 4)], [0.9, 0.6, 0.8], tokens, budget=20)
    assert spans == [(0, 2), (2, 4)] and forced == {2} and oversize == 0
    df = eps(["user", "assistant"] * 4, [0.9, 0.6, 0.8], budget=30)  # each unit ~ 2 x 3 tokens
    assert df["forced_split"].to_list() == [False] + [True] * (df.height - 1)
    # nothing lost: every turn in exactly one episode
    assert sorted(t for ids in df["turn_ids"].to_list() for t in ids) == list(range(8))


def test_oversize_single_unit_kept_whole():
    spans, forced, oversize = enforce_budget([(0, 2)], [0.9], [50, 5], budget=20)
    assert spans == [(0, 1), (1, 2)] and oversize == 1


def test_wrong_number_of_decisions_is_an_error():
    with pytest.raises(ValueError, match="2 decisions for 2 user utterances"):
        eps(["user", "user"], [0.5, 0.5])


def test_one_classifier_call_per_user_and_stable_ids():
    calls = []

    def predict(pairs):
        calls.append(len(pairs))
        return np.array([0.9 if i % 2 == 0 else 0.1 for i in range(len(pairs))], dtype=np.float32)

    turns = {"alice": history(["user", "assistant"] * 3), "bob": history(["user"] * 4, user="bob")}
    out, stats = build_episodes_for_users(turns, predict, threshold=0.5, classifier_version="v")
    assert calls == [2, 3], "one classifier call per user, with that user's pairs only (batch independence)"
    assert stats.users == 2 and stats.decisions == 5 and stats.user_utterances == 7
    out2, _ = build_episodes_for_users(turns, predict, threshold=0.5, classifier_version="v")
    assert out["alice"]["episode_id"].to_list() == out2["alice"]["episode_id"].to_list()
    assert out["alice"]["episode_id"][0] == episode_id("alice", 0, 3)


def test_the_rule_with_similarity_dips_reads_the_cosine_of_the_same_pairs():
    # 5 user utterances, P(same) confident everywhere but gap 1; the cosine dips at gap 2
    p = [0.9, 0.3, 0.8, 0.9]
    c = [0.6, 0.5, 0.1, 0.7]
    rule = DecisionRule(0.42, sim_threshold=0.2, sim_gate=0.9)
    assert segment(p, rule, c) == [(0, 2), (2, 3), (3, 5)]
    assert segment(p, rule.without_similarity()) == [(0, 2), (2, 5)]
    turns = {"alice": history(["user", "assistant"] * 5), "bob": history(["user"] * 2, user="bob")}
    seen = []
    per_user = {4: (p, c), 1: ([0.95], [0.05])}  # bob's single gap: cosine 0.05 but P(same) 0.95 > gate

    def similarity(pairs):
        seen.append(list(pairs))
        return np.array(per_user[len(pairs)][1], dtype=np.float32)

    out, stats = build_episodes_for_users(
        turns, lambda pairs: np.array(per_user[len(pairs)][0], dtype=np.float32), rule=rule, similarity=similarity,
        classifier_version="v-sim")
    assert [len(x) for x in seen] == [4, 1], "one similarity call per user, for the classifier's own pairs"
    assert seen[0][2] == ("word word word word word word word word 4", "word word word word word word word word 6")
    assert out["alice"]["turn_ids"].to_list() == [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert out["bob"]["turn_ids"].to_list() == [[0, 1]]
    # boundary_prob stays 1 - P(same): a dip boundary says how sure the classifier was of continuity
    assert out["alice"]["boundary_prob"].to_list()[1:] == pytest.approx([0.7, 0.2])
    assert stats.episodes == 4


def test_a_rule_with_dips_without_similarity_is_a_clear_error():
    rule = DecisionRule(0.42, sim_threshold=0.2)
    turns = {"alice": history(["user"] * 3)}
    with pytest.raises(ValueError, match="needs similarity="):
        build_episodes_for_users(turns, lambda pairs: np.full(len(pairs), 0.9, np.float32), rule=rule,
                                 classifier_version="v")
    with pytest.raises(ValueError, match="1 cosines for 2 pairs"):
        build_episodes_for_users(turns, lambda pairs: np.full(len(pairs), 0.9, np.float32), rule=rule,
                                 similarity=lambda pairs: np.zeros(1, np.float32), classifier_version="v")
    # the plain rule never calls it
    out, _ = build_episodes_for_users(turns, lambda pairs: np.full(len(pairs), 0.9, np.float32),
                                      rule=DecisionRule(0.42), similarity=lambda pairs: 1 / 0, classifier_version="v")
    assert out["alice"].height == 1
