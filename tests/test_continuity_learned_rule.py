"""The learned decision rule (decoding step 5): its per-gap features, the logistic fit, the rule's
JSON and version, the CV chooser, and the episodes stage applying it."""

import json

import numpy as np
import pytest

from qumem_pipeline.episodes.continuity.decoding import (
    RULE_NAME_LEARNED,
    DecisionRule,
    LearnedScore,
    artifact_version,
    version_of_config,
)
from qumem_pipeline.episodes.continuity.gap_features import (
    check_feature_names,
    depth,
    feature_matrix,
    fit_logistic,
    logit,
)


def test_features_by_name_on_a_hand_made_history():
    p = np.array([0.9, 0.5, 0.9, 0.9])
    c = np.array([0.6, 0.6, 0.2, 0.6])
    names = ["lp", "c", "c_rel1", "c_rel2", "c_depth1", "c_lmin", "lp_lmin", "edge", "lp_rel1"]
    X = feature_matrix(names, p, c)
    assert X.shape == (4, len(names))
    col = {n: X[:, k] for k, n in enumerate(names)}
    np.testing.assert_allclose(col["lp"], np.log(p / (1 - p)))
    np.testing.assert_allclose(col["c"], c)
    np.testing.assert_allclose(col["c_rel1"], [0.0, 0.6 - 0.4, 0.2 - 0.6, 0.6 - 0.2])
    np.testing.assert_allclose(col["c_rel2"], [0.6 - 0.4, 0.6 - (0.6 + 0.2 + 0.6) / 3, 0.2 - 0.6, 0.6 - 0.4])
    # 0.4 below both neighbours; negative where a neighbour is lower (the value stands above it)
    np.testing.assert_allclose(col["c_depth1"], [0.0, -0.4, 0.8, -0.4])
    assert col["c_lmin"].tolist() == [0, 0, 1, 0]
    assert col["lp_lmin"].tolist() == [0, 1, 0, 0]
    assert col["edge"].tolist() == [1, 0, 0, 1]
    assert depth(np.array([0.5]), 3).tolist() == [0.0]  # no neighbours on either side
    assert feature_matrix(["lp", "c_rel4"], [], []).shape == (0, 2)
    assert logit([0.0, 1.0]).tolist() == pytest.approx([np.log(1e-4 / (1 - 1e-4)), np.log((1 - 1e-4) / 1e-4)])
    for bad in (["cos"], ["c_rel0"], ["lp_depth"], ["c", "c"]):
        with pytest.raises(ValueError, match="feature"):
            check_feature_names(bad)
    with pytest.raises(ValueError, match="3 cosines for 4"):
        feature_matrix(["c"], p, c[:3])


def test_fit_logistic_recovers_the_separating_direction_and_its_weights():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 3)) * [1.0, 10.0, 0.1]  # scales differ: the fit standardises
    z = 2.0 * X[:, 0] - 0.3 * X[:, 1] + 0.5
    y = (rng.random(400) < 1 / (1 + np.exp(-z))).astype(float)
    coef, b = fit_logistic(X, y, l2=1e-6)
    assert coef[0] == pytest.approx(2.0, rel=0.35) and coef[1] == pytest.approx(-0.3, rel=0.35)
    assert abs(coef[2]) < 3.0 and b == pytest.approx(0.5, abs=0.5)
    # the unpenalised optimum has a zero gradient: weights multiply the data's pull
    w = np.where(y == 1, 3.0, 1.0)
    coef_w, b_w = fit_logistic(X, y, w, l2=0.0)
    pr = 1 / (1 + np.exp(-(X @ coef_w + b_w)))
    np.testing.assert_allclose(np.column_stack([X, np.ones(len(y))]).T @ (w * (pr - y)), 0.0, atol=1e-6)
    assert b_w > fit_logistic(X, y, l2=0.0)[1]  # up-weighting positives raises the intercept


def _learned(cutoff=0.5, local_max=False):
    return LearnedScore(("lp", "c_rel1"), (-1.0, -20.0), 0.0, cutoff, local_max)


def test_learned_rule_applies_the_score_and_keeps_the_classifier_rule_as_reference():
    rule = DecisionRule(0.42, learned=_learned())
    p = np.array([0.9, 0.5, 0.9, 0.3])
    c = np.array([0.6, 0.6, 0.2, 0.2])
    z = -np.log(p / (1 - p)) - 20.0 * feature_matrix(["c_rel1"], p, c)[:, 0]
    want = (1 / (1 + np.exp(-z)) > 0.5).astype(int)
    assert rule.needs_similarity and not rule.has_sim_dips and not rule.is_plain_threshold
    assert rule.boundaries(p, c).tolist() == want.tolist() == [0, 0, 1, 1]
    assert rule.without_similarity() == DecisionRule(0.42)
    assert rule.without_similarity().boundaries(p).tolist() == [0, 0, 0, 1]
    # local maxima only: of two adjacent candidates, the higher score stays
    lm = DecisionRule(0.42, learned=_learned(0.5, True))
    assert lm.boundaries(p, c).tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError, match="needs the adjacent cosine"):
        rule.boundaries(p)
    # a learned score over P(same) alone needs no cosine
    alone = DecisionRule(0.42, learned=LearnedScore(("lp",), (-1.0,), 0.0, 0.5))
    assert not alone.needs_similarity and alone.boundaries(p).tolist() == [0, 0, 0, 1]
    assert not alone.is_plain_threshold and alone != DecisionRule(0.42)
    assert "logistic score over 2 per-gap features (lp, c_rel1)" in rule.describe()
    assert "P(same) < 0.42" in rule.describe()


def test_learned_rule_validates_its_fields():
    with pytest.raises(ValueError, match="2 coefficients for 1 features"):
        LearnedScore(("lp",), (1.0, 2.0), 0.0, 0.5)
    with pytest.raises(ValueError, match="cutoff"):
        LearnedScore(("lp",), (1.0,), 0.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        LearnedScore(("lp",), (float("nan"),), 0.0, 0.5)
    with pytest.raises(ValueError, match="unknown feature"):
        LearnedScore(("lp", "length"), (1.0, 1.0), 0.0, 0.5)
    with pytest.raises(ValueError, match="not both"):
        DecisionRule(0.42, sim_threshold=0.2, learned=_learned())


def test_learned_rule_json_round_trip_and_version():
    rule = DecisionRule(0.42, learned=_learned(0.61, True))
    d = json.loads(json.dumps(rule.to_json()))
    assert d["rule"] == RULE_NAME_LEARNED and d["learned"]["coef"] == [-1.0, -20.0]
    assert not any(k.startswith("sim_") for k in d)
    assert DecisionRule.from_json({**d, "selection": {"cv_pk_mean": 0.2}}) == rule
    assert DecisionRule.from_config({"threshold": 0.42, "decision": d}) == rule
    with pytest.raises(ValueError, match="'learned' block is missing"):
        DecisionRule.from_json({k: v for k, v in d.items() if k != "learned"})
    with pytest.raises(ValueError, match="not allowed"):
        DecisionRule.from_json({**d, "sim_window": 4})
    with pytest.raises(ValueError, match="needs rule"):
        DecisionRule.from_json({**d, "rule": "smooth-threshold-peaks-v1"})
    with pytest.raises(ValueError, match="unknown field"):
        DecisionRule.from_json({**d, "learned": {**d["learned"], "scale": 2}})
    # the version covers every coefficient: one number changed is another classifier
    v = artifact_version("w-1", rule)
    other = DecisionRule(0.42, learned=LearnedScore(("lp", "c_rel1"), (-1.0, -10.5), 0.0, 0.61, True))
    assert artifact_version("w-1", other) != v != artifact_version("w-1", DecisionRule(0.42))
    cfg = {"weights_version": "w-1", "threshold": 0.42, "decision": d, "version": v}
    assert version_of_config(cfg) == v
    edited = json.loads(json.dumps(cfg))
    edited["decision"]["learned"]["cutoff"] = 0.7
    with pytest.raises(ValueError, match="does not match"):
        version_of_config(edited)


def _two_domains(seed=0):
    """Domain A (TIAGE-like): boundaries have low P(same), the cosine is noise. Domain B (joined
    excerpts): P(same) barely moves at boundaries, the cosine dips below its neighbours."""
    rng = np.random.default_rng(seed)

    def dom(kind, n_dial=30):
        probs, sims, refs = [], [], []
        for _ in range(n_dial):
            r = (rng.random(16) < (0.25 if kind == "A" else 0.15)).astype(int)
            if kind == "A":
                p = np.where(r == 1, rng.uniform(0.05, 0.4, 16), rng.uniform(0.5, 0.95, 16))
                c = rng.uniform(0.0, 0.3, 16)
            else:
                p = np.where(r == 1, rng.uniform(0.7, 0.85, 16), rng.uniform(0.75, 0.9, 16))
                c = np.where(r == 1, rng.uniform(0.05, 0.2, 16), rng.uniform(0.4, 0.6, 16))
            probs.append(p)
            sims.append(c)
            refs.append(list(r))
        return probs, sims, refs

    return dom("A"), dom("B")


def test_choose_learned_fits_both_domains_by_cross_validation():
    from qumem_pipeline.episodes.continuity.tune_decoding import PkScorer, choose_learned

    a, bb = _two_domains()
    feature_sets = {"p": ("lp",), "p+c": ("lp", "c"), "p+c+rel": ("lp", "c", "c_rel2")}
    rule, sel = choose_learned(DecisionRule(0.42), [a, bb], names=["A", "B"], feature_sets=feature_sets,
                               l2s=(1.0,), n_folds=3)
    assert rule.learned is not None and rule.without_similarity() == DecisionRule(0.42)
    assert sel["feature_set"] in ("p+c", "p+c+rel")  # P(same) alone cannot find B's boundaries
    assert sel["cv_pk"]["B"] < 0.15 and sel["cv_pk"]["A"] < 0.15
    assert len(sel["candidates"]) == 3 * 1 * 2
    by_fs = {(r["features"], r["local_max"]): r["cv_pk_mean"] for r in sel["candidates"]}
    assert sel["cv_pk_mean"] == min(by_fs.values()) < by_fs[("p", False)]
    # the stored rule is the fitted one: its boundaries reproduce the reported in-sample Pk
    for name, (probs, sims, refs) in zip(["A", "B"], [a, bb]):
        got = PkScorer(refs)([rule.boundaries(p, c) for p, c in zip(probs, sims)])
        assert round(got, 4) == sel["fitted_pk"][name]
    # the plain classifier rule misses every boundary of B
    probs, sims, refs = bb
    assert PkScorer(refs)([DecisionRule(0.42).boundaries(p) for p in probs]) > 0.2
    # deterministic: same input, same rule
    again, _ = choose_learned(DecisionRule(0.42), [a, bb], names=["A", "B"], feature_sets=feature_sets,
                              l2s=(1.0,), n_folds=3)
    assert again == rule


def test_the_episodes_stage_applies_a_learned_rule_with_the_cosine():
    from qumem_pipeline.episodes.segmentation import build_episodes_for_users, segment

    p = [0.9, 0.8, 0.9, 0.9]
    c = [0.6, 0.6, 0.1, 0.6]
    rule = DecisionRule(0.42, learned=_learned())
    assert segment(p, rule, c) == [(0, 3), (3, 5)]
    import polars as pl
    from datetime import datetime, timezone

    n = 5
    turns = {"alice": pl.DataFrame({
        "user_id": ["alice"] * n, "turn_index": list(range(n)), "role": ["user"] * n,
        "text": [f"utterance {i}" for i in range(n)],
        "timestamp": [datetime(2026, 1, 1, tzinfo=timezone.utc)] * n})}
    calls = []
    out, stats = build_episodes_for_users(
        turns, lambda pairs: np.array(p, np.float32), rule=rule,
        similarity=lambda pairs: calls.append(pairs) or np.array(c, np.float32), classifier_version="v-learned")
    assert len(calls) == 1 and out["alice"]["turn_ids"].to_list() == [[0, 1, 2], [3, 4]]
    assert out["alice"]["classifier_version"].to_list() == ["v-learned"] * 2 and stats.episodes == 2


def _unit(rng, n, d=8):
    e = rng.normal(size=(n, d))
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def test_block_and_locally_standardised_features_by_name():
    from qumem_pipeline.episodes.continuity.gap_features import block_cosine, local_zscore, uses_embeddings

    # two topics of three utterances each: the block cosine is lowest at the gap between them (1/sqrt 2
    # where one block straddles the change)
    a, b = np.eye(4)[0], np.eye(4)[1]
    emb = np.array([a, a, a, b, b, b])
    p, c = np.full(5, 0.8), np.array([1.0, 1.0, 0.0, 1.0, 1.0])
    names = ["b2", "b3_rel4", "b2_depth1", "b2_lmin", "z2:lp", "z32:c", "z1:b2"]
    X = feature_matrix(names, p, c, emb)
    col = {n: X[:, k] for k, n in enumerate(names)}
    h = 1 / np.sqrt(2)
    np.testing.assert_allclose(col["b2"], [1.0, h, 0.0, h, 1.0], atol=1e-6)
    np.testing.assert_allclose(col["b2"], block_cosine(emb, 2), atol=1e-12)
    assert col["b2_lmin"].tolist() == [0, 0, 1, 0, 0] and col["b2_depth1"][2] == pytest.approx(2 * h, abs=1e-6)
    assert col["b3_rel4"][2] == pytest.approx(-(2 + 1) / np.sqrt(5) / 2) and col["z2:lp"].tolist() == [0.0] * 5  # a flat window divides by 1
    np.testing.assert_allclose(col["z32:c"], (c - c.mean()) / c.std())  # the window covers the whole history
    # the window is local: gap 0 standardised over gaps 0-1 only
    x = np.array([1.0, 3.0, 10.0, 10.0])
    assert local_zscore(x, 1)[0] == pytest.approx((1.0 - 2.0) / 1.0)
    assert uses_embeddings(names) and not uses_embeddings(["lp", "z4:c_rel2"])
    with pytest.raises(ValueError, match="utterance embeddings"):
        feature_matrix(["b2"], p, c)
    with pytest.raises(ValueError, match="6 utterance embeddings for 4 gaps"):
        feature_matrix(["b2"], p[:4], c[:4], emb)
    for bad in (["b0"], ["b10"], ["z0:lp"], ["z4:z4:lp"], ["z4:"], ["bb2"]):
        with pytest.raises(ValueError, match="feature"):
            check_feature_names(bad)


def test_a_history_growing_at_its_end_changes_no_decision_far_back():
    """Nightly rebuilds: a user's new turns must not reshuffle their old episodes. Every feature of
    the shipped kind reaches at most 10 gaps (b6_rel4), the z32 window 32 more, local maxima 1."""
    from qumem_pipeline.episodes.continuity.tune_learned import block_features

    rng = np.random.default_rng(3)
    feats = block_features((2, 3, 4, 6), z=True)
    rule = DecisionRule(0.42, learned=LearnedScore(feats, tuple(rng.normal(size=len(feats))), -0.5, 0.5, True))
    n = 300
    emb, p = _unit(rng, n + 40), rng.uniform(0.05, 0.95, n + 39)
    c = np.einsum("ij,ij->i", emb[:-1], emb[1:])
    old = rule.boundaries(p[: n - 1], c[: n - 1], emb[:n])
    new = rule.boundaries(p, c, emb)
    assert 0 < old.sum() < len(old)
    reach = 10 + 32 + 1
    assert new[: n - 1 - reach].tolist() == old[: n - 1 - reach].tolist()
    assert new[: n - 1].tolist() != old.tolist()  # near the end, the new turns do count


def test_choose_learned_block_keeps_the_guard_and_finds_joins_by_block_similarity():
    from qumem_pipeline.episodes.continuity.tune_decoding import PkScorer
    from qumem_pipeline.episodes.continuity.tune_learned import choose_learned_block

    rng = np.random.default_rng(0)

    def dialogues(kind, n_dial):
        out = {"p": [], "c": [], "emb": [], "refs": []}
        for _ in range(n_dial):
            n_utt = 24
            refs = np.zeros(n_utt - 1, int)
            if kind == "tiage":  # boundaries: low P(same); topics not visible in the embeddings
                refs[rng.choice(n_utt - 1, 5, replace=False)] = 1
                p = np.where(refs == 1, rng.uniform(0.05, 0.5, n_utt - 1), rng.uniform(0.3, 0.95, n_utt - 1))
                emb = _unit(rng, n_utt)
            else:  # joins: P(same) flat, each excerpt near its own topic vector
                refs[[7, 15]] = 1
                p = rng.uniform(0.7, 0.9, n_utt - 1)
                topic = np.repeat(_unit(rng, 3, 16), 8, axis=0)
                emb = topic + 0.6 * _unit(rng, n_utt, 16)
                emb /= np.linalg.norm(emb, axis=1, keepdims=True)
            out["p"].append(p)
            out["emb"].append(emb)
            out["c"].append(np.einsum("ij,ij->i", emb[:-1], emb[1:]))
            out["refs"].append(list(refs))
        return out

    S = {"train": dialogues("tiage", 30), "dev": dialogues("tiage", 15), "ood_calib": dialogues("join", 15),
         "gen_calib": dialogues("join", 15)}
    alone = DecisionRule(0.42)
    fs = {"pc": ("lp", "c"), "block": ("lp", "c", "b3", "b3_rel4")}
    rule, sel = choose_learned_block(alone, S, feature_sets=fs, l2s=(1.0,), n_folds=3)
    assert sel["feature_set"] == "block" and rule.needs_embeddings
    assert rule.without_similarity() == alone
    floor = PkScorer(S["dev"]["refs"])([alone.boundaries(p) for p in S["dev"]["p"]])
    assert sel["dev_pk_classifier_alone"] == round(floor, 4) and sel["cv_pk"]["dev"] <= sel["dev_pk_classifier_alone"]
    joins = S["ood_calib"]
    got = PkScorer(joins["refs"])([rule.boundaries(p, c, e) for p, c, e in zip(joins["p"], joins["c"], joins["emb"])])
    assert got < 0.1 < PkScorer(joins["refs"])([alone.boundaries(p) for p in joins["p"]])
    assert len(sel["candidates"]) == 2 * 1 * 2
    again, _ = choose_learned_block(alone, S, feature_sets=fs, l2s=(1.0,), n_folds=3)
    assert again == rule


def test_the_episodes_stage_passes_each_users_embeddings_to_a_block_rule():
    import polars as pl
    from datetime import datetime, timezone

    from qumem_pipeline.episodes.segmentation import build_episodes_for_users

    texts = {"alice": ["a0", "a1", "a2", "a3", "a4"], "bob": ["b0", "b1", "b2"]}
    vec = {t: v for t, v in zip(sorted({t for x in texts.values() for t in x}), _unit(np.random.default_rng(1), 8))}
    turns = {u: pl.DataFrame({"user_id": [u] * len(x), "turn_index": list(range(len(x))), "role": ["user"] * len(x),
                              "text": x, "timestamp": [datetime(2026, 1, 1, tzinfo=timezone.utc)] * len(x)})
             for u, x in texts.items()}
    rule = DecisionRule(0.42, learned=LearnedScore(("lp", "b2", "c"), (-1.0, -3.0, -1.0), 0.5, 0.5))
    calls = []

    def embed(histories):
        calls.append(histories)
        return [np.array([vec[t] for t in h]) for h in histories]

    probs = np.full(6, 0.8, np.float32)
    out, stats = build_episodes_for_users(turns, lambda pairs: probs[: len(pairs)], rule=rule,
                                          embed_histories=embed, classifier_version="v")
    assert calls == [[texts["alice"]], [texts["bob"]]]  # one call per user (batch independence), in order
    for u, x in texts.items():
        e = np.array([vec[t] for t in x])
        c = np.einsum("ij,ij->i", e[:-1], e[1:])
        want = [0] + [int(i) + 1 for i in np.flatnonzero(rule.boundaries(np.full(len(x) - 1, 0.8), c, e))]
        assert out[u]["first_turn_index"].to_list() == want
    with pytest.raises(ValueError, match="embed_histories"):
        build_episodes_for_users(turns, lambda pairs: probs[: len(pairs)], rule=rule, classifier_version="v",
                                 similarity=lambda pairs: np.zeros(len(pairs)))
