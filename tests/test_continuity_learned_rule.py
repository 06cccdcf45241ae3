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
