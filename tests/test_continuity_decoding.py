"""The boundary decision rule on hand-made P(same) sequences, its artifact round trip, and the
dev-only tuner (nested CV keeps the plain threshold unless a richer rule really generalises)."""

import json

import numpy as np
import pytest

from qumem_pipeline.episodes.continuity.decoding import RULE_NAME, DecisionRule, as_rule
from qumem_pipeline.episodes.continuity.tune_decoding import (
    ARTIFACT_FORMAT_V2,
    PkScorer,
    best_rule,
    family_rules,
    tune,
    versioned_config,
    write_config_atomic,
)
from qumem_pipeline.episodes.metrics import evaluate


def b(rule, p):
    return rule.boundaries(np.array(p, dtype=np.float32)).tolist()


def test_plain_threshold_is_strictly_below():
    r = DecisionRule(0.5)
    assert r.is_plain_threshold
    assert b(r, [0.9, 0.1, 0.5, 0.49]) == [0, 1, 0, 1]
    assert b(r, []) == []
    assert b(r, [0.2]) == [1]
    assert as_rule(0.5) == r and as_rule(r) is r


def test_peaks_add_strict_local_minima_only():
    r = DecisionRule(0.3, peak_threshold=0.6)
    # 0.5 dips below both neighbours -> boundary; 0.2 is below the threshold anyway
    assert b(r, [0.9, 0.5, 0.9, 0.2, 0.8]) == [0, 1, 0, 1, 0]
    # a plateau is not a strict minimum; above peak_threshold never counts
    assert b(r, [0.9, 0.5, 0.5, 0.9]) == [0, 0, 0, 0]
    assert b(r, [0.9, 0.65, 0.9]) == [0, 0, 0]
    # edge gaps have one neighbour
    assert b(r, [0.4, 0.9, 0.9, 0.45]) == [1, 0, 0, 1]
    assert b(r, [0.4]) == [1]


def test_smoothing_uses_existing_neighbours():
    r = DecisionRule(0.5, smoothing=0.5)
    np.testing.assert_allclose(r.smoothed([0.9, 0.3, 0.9]), [0.6, 0.6, 0.6])
    assert b(r, [0.9, 0.3, 0.9]) == [0, 0, 0]  # an isolated dip is smoothed away
    assert b(r, [0.9, 0.3, 0.3, 0.9]) == [0, 1, 1, 0]  # (0.3 + (0.9+0.3)/2) / 2 = 0.45
    assert b(r, [0.3]) == [1]  # one gap: nothing to smooth with


def test_min_segment_keeps_strongest_first():
    p = [0.1, 0.2, 0.9, 0.3]
    assert b(DecisionRule(0.5), p) == [1, 1, 0, 1]
    assert b(DecisionRule(0.5, min_segment=2), p) == [1, 0, 0, 1]
    assert b(DecisionRule(0.5, min_segment=3), p) == [1, 0, 0, 1]  # segments of 1 and 3 (gap 0 -> 3)
    assert b(DecisionRule(0.5, min_segment=4), p) == [1, 0, 0, 0]
    # the stronger (lower) of two neighbours wins, wherever it is
    assert b(DecisionRule(0.5, min_segment=2), [0.4, 0.1, 0.9]) == [0, 1, 0]


def test_invalid_rules_name_the_field():
    with pytest.raises(ValueError, match="threshold"):
        DecisionRule(1.5)
    with pytest.raises(ValueError, match="peak_threshold"):
        DecisionRule(0.5, peak_threshold=0.4)
    with pytest.raises(ValueError, match="smoothing"):
        DecisionRule(0.5, smoothing=1.0)
    with pytest.raises(ValueError, match="min_segment"):
        DecisionRule(0.5, min_segment=0)


def test_json_round_trip_and_v1_configs():
    r = DecisionRule(0.41, 0.55, 0.1, 2)
    d = json.loads(json.dumps(r.to_json()))
    assert d["rule"] == RULE_NAME
    assert DecisionRule.from_json({**d, "selection": {"family": "peaks"}}) == r
    assert DecisionRule.from_config({"threshold": 0.42}) == DecisionRule(0.42)  # v1 artifact
    assert DecisionRule.from_config({"threshold": 0.9, "decision": d}) == r
    with pytest.raises(ValueError, match="unknown decision rule"):
        DecisionRule.from_json({**d, "rule": "something-else"})
    with pytest.raises(ValueError, match="window"):
        DecisionRule.from_json({**d, "window": 3})


def test_pk_scorer_matches_metrics():
    rng = np.random.default_rng(0)
    refs = [list((rng.random(n) < 0.25).astype(int)) for n in rng.integers(1, 30, size=40)]
    hyps = [list((rng.random(len(r)) < 0.3).astype(int)) for r in refs]
    refs.append([])
    hyps.append([])  # a one-utterance dialogue is skipped by both
    assert PkScorer(refs)(hyps) == pytest.approx(evaluate(refs, hyps).pk, abs=1e-12)


def _dialogues(seed, n_dial, kind):
    """Synthetic P(same) sequences. ``plain``: boundaries have low P(same), a threshold separates them.
    ``peaks``: boundaries are isolated dips to 0.6 between 0.9s, while continuing gaps include
    plateaus of 0.5 — only the local-minimum rule tells them apart."""
    rng = np.random.default_rng(seed)
    probs, refs = [], []
    for _ in range(n_dial):
        p, r = [], []
        while len(p) < 14:
            if kind == "plain":
                bnd = rng.random() < 0.25
                p.append(rng.uniform(0.05, 0.35) if bnd else rng.uniform(0.45, 0.95))
                r.append(int(bnd))
            else:
                if rng.random() < 0.4:
                    p += [0.9, 0.6, 0.9]
                    r += [0, 1, 0]
                else:
                    p += [0.9, 0.5, 0.5]
                    r += [0, 0, 0]
        probs.append(np.array(p))
        refs.append(r)
    return probs, refs


def test_tune_keeps_plain_threshold_when_it_suffices():
    probs, refs = _dialogues(0, 40, "plain")
    rule, rep = tune(probs, refs)
    assert rep["family"] == "plain" and rule.is_plain_threshold
    assert 0.35 <= rule.threshold <= 0.45
    assert rep["dev_pk"] == 0.0 and set(rep["cv_pk"]) == {"plain", "peaks", "smooth", "min_segment"}


def test_tune_picks_peaks_when_only_peaks_separate():
    probs, refs = _dialogues(1, 40, "peaks")
    plain, plain_pk = best_rule(probs, refs, family_rules("plain"))
    assert plain_pk > 0.1  # no threshold separates 0.6 dips from 0.5 plateaus
    rule, rep = tune(probs, refs)
    assert rep["family"] == "peaks"
    assert rule.peak_threshold is not None and rule.threshold < 0.5 < 0.6 < rule.peak_threshold
    assert rep["dev_pk"] == 0.0 and rep["cv_pk"]["peaks"] < rep["cv_pk"]["plain"]


def test_tune_rejects_misaligned_input():
    with pytest.raises(ValueError, match="dialogue 1: 2 probabilities for 3 gaps"):
        tune([np.array([0.5]), np.array([0.5, 0.5])], [[0], [0, 1, 0]])


def test_versioned_config_bumps_version_with_the_rule(tmp_path):
    v1 = {"format": "continuity-minilm-lora-v1", "version": "continuity-minilm-lora-v1-abc", "threshold": 0.42,
          "metrics": {}}
    a = versioned_config(v1, DecisionRule(0.42), {"family": "plain"})
    b_ = versioned_config(v1, DecisionRule(0.42, 0.6), {"family": "peaks"})
    assert a["format"] == ARTIFACT_FORMAT_V2 and a["version"].startswith(ARTIFACT_FORMAT_V2 + "-")
    assert a["version"] != b_["version"] and a["weights_version"] == "continuity-minilm-lora-v1-abc"
    assert versioned_config(a, DecisionRule(0.42), {"family": "plain"})["version"] == a["version"]  # idempotent
    assert b_["threshold"] == 0.42 and DecisionRule.from_config(b_) == DecisionRule(0.42, 0.6)
    write_config_atomic(tmp_path, b_)
    assert json.loads((tmp_path / "config.json").read_text()) == b_
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temp file left behind


# ---- similarity dips (decision step 4) ------------------------------------------------------
P = [0.9, 0.3, 0.85, 0.7, 0.95]
C = [0.6, 0.5, 0.1, 0.05, 0.7]


def bc(rule, p, c):
    return rule.boundaries(np.array(p, dtype=np.float32), np.array(c, dtype=np.float32)).tolist()


def test_sim_dips_are_or_ed_with_the_classifier_rule():
    # classifier alone: only gap 1 (0.3 < 0.42)
    assert b(DecisionRule(0.42), P) == [0, 1, 0, 0, 0]
    # cosine < 0.2 at gaps 2 and 3; no gate, no local-minimum condition: both added
    assert bc(DecisionRule(0.42, sim_threshold=0.2, sim_local_min=False), P, C) == [0, 1, 1, 1, 0]
    # strict local minimum of the cosine: 0.1 has the lower 0.05 beside it -> only gap 3
    assert bc(DecisionRule(0.42, sim_threshold=0.2), P, C) == [0, 1, 0, 1, 0]
    # the P(same) gate (raw P, 0.85 >= 0.8) removes gap 2 without the local-minimum condition
    assert bc(DecisionRule(0.42, sim_threshold=0.2, sim_gate=0.8, sim_local_min=False), P, C) == [0, 1, 0, 1, 0]
    # gate 0.6: P(same) 0.7 at gap 3 is too confident; 0.3 at gap 1 was a boundary anyway
    assert bc(DecisionRule(0.42, sim_threshold=0.2, sim_gate=0.6, sim_local_min=False), P, C) == [0, 1, 0, 0, 0]
    # strictly below: a cosine equal to the threshold is no dip; edges have one neighbour
    assert bc(DecisionRule(0.1, sim_threshold=0.3), [0.9, 0.9, 0.9], [0.3, 0.5, 0.29]) == [0, 0, 1]
    assert bc(DecisionRule(0.1, sim_threshold=0.3), [], []) == []


def test_sim_rule_needs_the_cosine_and_validates():
    r = DecisionRule(0.42, sim_threshold=0.2, sim_gate=0.9)
    assert r.needs_similarity and not r.is_plain_threshold
    assert r.without_similarity() == DecisionRule(0.42) and not DecisionRule(0.42).needs_similarity
    with pytest.raises(ValueError, match="needs the adjacent cosine"):
        r.boundaries(np.array(P))
    with pytest.raises(ValueError, match="2 cosines for 5"):
        r.boundaries(np.array(P), np.array([0.1, 0.2]))
    with pytest.raises(ValueError, match="sim_threshold"):
        DecisionRule(0.42, sim_threshold=1.5)
    with pytest.raises(ValueError, match="sim_gate"):
        DecisionRule(0.42, sim_threshold=0.2, sim_gate=1.2)
    with pytest.raises(ValueError, match="need a sim_threshold"):
        DecisionRule(0.42, sim_gate=0.9)
    # a rule without dips ignores a cosine it is given
    assert DecisionRule(0.42).boundaries(np.array(P), np.array(C)).tolist() == [0, 1, 0, 0, 0]


def test_sim_rule_json_and_plain_json_unchanged():
    from qumem_pipeline.episodes.continuity.decoding import RULE_NAME_SIM

    r = DecisionRule(0.42, sim_threshold=0.15, sim_gate=None, sim_local_min=True)
    d = json.loads(json.dumps(r.to_json()))
    assert d["rule"] == RULE_NAME_SIM and d["sim_threshold"] == 0.15 and d["sim_gate"] is None
    assert DecisionRule.from_json({**d, "selection": {"x": 1}}) == r
    # the plain rule's JSON is exactly the v1 JSON: versions of artifacts without dips do not move
    assert DecisionRule(0.42).to_json() == {"rule": RULE_NAME, "threshold": 0.42, "peak_threshold": None,
                                            "smoothing": 0.0, "min_segment": 1}
    with pytest.raises(ValueError, match="sim_threshold / sim_window not allowed"):
        DecisionRule.from_json({**DecisionRule(0.42).to_json(), "sim_threshold": 0.2})
    with pytest.raises(ValueError, match="sim_threshold / sim_window missing"):
        DecisionRule.from_json({**DecisionRule(0.42).to_json(), "rule": RULE_NAME_SIM})
    assert "cosine < 0.15 and a strict local minimum" in r.describe()


def test_version_is_derived_from_weights_and_rule():
    from qumem_pipeline.episodes.continuity.decoding import artifact_version, version_of_config

    plain = versioned_config({"version": "w-1"}, DecisionRule(0.42), {"family": "plain"})
    dips = versioned_config(plain, DecisionRule(0.42, sim_threshold=0.2), {"family": "plain"})
    other = versioned_config(plain, DecisionRule(0.42, sim_threshold=0.25), {"family": "plain"})
    assert len({plain["version"], dips["version"], other["version"]}) == 3
    assert dips["weights_version"] == "w-1" and dips["version"] == artifact_version("w-1", DecisionRule(0.42, sim_threshold=0.2))
    assert "OOD calib" in dips["threshold_rule"]
    assert version_of_config(dips) == dips["version"]
    # a hand edit of the rule without a new version is caught, never silently kept
    edited = json.loads(json.dumps(dips))
    edited["decision"]["sim_threshold"] = 0.3
    with pytest.raises(ValueError, match="does not match its weights and decision rule"):
        version_of_config(edited)
    assert version_of_config({k: v for k, v in edited.items() if k != "version"}) == artifact_version(
        "w-1", DecisionRule(0.42, sim_threshold=0.3))
    # v1 artifacts (no weights_version) keep their stored version
    assert version_of_config({"version": "continuity-minilm-lora-v1-abc", "threshold": 0.4}) == "continuity-minilm-lora-v1-abc"


def test_choose_sim_dip_keeps_dev_and_lowers_calib():
    from qumem_pipeline.episodes.continuity.tune_decoding import SIM_DIP_GRID, choose_sim_dip

    # dev: the cosine is low everywhere (TIAGE-like), so any ungated dip adds false boundaries;
    # calib: a join at gap 2 that the classifier misses (P(same) 0.7) and the cosine shows
    dev = ([np.array([0.9, 0.2, 0.9, 0.9, 0.9])], [np.array([0.1, 0.1, 0.1, 0.1, 0.1])], [[0, 1, 0, 0, 0]])
    cal = ([np.array([0.9, 0.9, 0.7, 0.9, 0.9])], [np.array([0.6, 0.6, 0.08, 0.6, 0.6])], [[0, 0, 1, 0, 0]])
    rule, sel = choose_sim_dip(DecisionRule(0.42), dev, cal)
    assert rule.needs_similarity and rule.without_similarity() == DecisionRule(0.42)
    assert sel["calib_pk"] == 0.0 < sel["calib_pk_without_dips"]
    assert sel["dev_pk"] <= sel["dev_pk_without_dips"] == 0.0
    # the join's cosine 0.08 needs threshold 0.1; its P(same) 0.7 needs gate 0.8 (0.6, 0.7 gate it out);
    # dev's 0.1 is not below 0.1: first in grid order among the ties
    want = (0.1, None, None, 0.8, False)
    assert (rule.sim_threshold, rule.sim_window, rule.sim_drop, rule.sim_gate, rule.sim_local_min) == want
    assert SIM_DIP_GRID.index(want) < SIM_DIP_GRID.index((0.1, None, None, 0.8, True))
    # when no dip keeps dev, the rule stays without dips
    dev_bad = ([np.array([0.9, 0.2, 0.5, 0.9, 0.9])], [np.array([0.5, 0.5, 0.01, 0.5, 0.5])], [[0, 1, 0, 0, 0]])
    only, sel2 = choose_sim_dip(DecisionRule(0.42), dev_bad, cal,
                                grid=[(0.05, None, None, None, False), (0.05, None, None, 0.6, True),
                                      (None, 1, 0.1, None, False)])
    assert only == DecisionRule(0.42) and "none kept" in sel2["kept"]


def test_relative_dips_compare_with_the_neighbours_mean():
    from qumem_pipeline.episodes.continuity.decoding import neighbour_mean

    np.testing.assert_allclose(neighbour_mean(np.array([0.6, 0.6, 0.2, 0.6, 0.6]), 1), [0.6, 0.4, 0.6, 0.4, 0.6])
    np.testing.assert_allclose(neighbour_mean(np.array([1.0, 2.0, 3.0, 4.0]), 2), [2.5, 8 / 3, 7 / 3, 2.5])
    np.testing.assert_allclose(neighbour_mean(np.array([0.3]), 3), [0.3])  # no neighbours: its own value
    assert neighbour_mean(np.zeros(0), 2).shape == (0,)
    high = [0.6, 0.6, 0.2, 0.6, 0.6]  # c - mean = 0, 0.2, -0.4, 0.2, 0
    p = [0.9] * 5
    rel = DecisionRule(0.42, sim_window=1, sim_drop=0.3, sim_local_min=False)
    assert bc(rel, p, high) == [0, 0, 1, 0, 0]
    assert bc(DecisionRule(0.42, sim_window=1, sim_drop=0.45, sim_local_min=False), p, high) == [0] * 5
    # a low-similarity domain: every cosine is below an absolute 0.2, only the relative dip stands out
    low = [0.1, 0.1, 0.05, 0.1]  # c - mean(1 each side) = 0, 0.025, -0.05, 0.05
    assert bc(DecisionRule(0.42, sim_threshold=0.2, sim_local_min=False), [0.9] * 4, low) == [1, 1, 1, 1]
    assert bc(DecisionRule(0.42, sim_window=1, sim_drop=0.03, sim_local_min=False), [0.9] * 4, low) == [0, 0, 1, 0]
    # absolute and relative together: both must hold; the gate still applies
    both = DecisionRule(0.42, sim_threshold=0.04, sim_window=1, sim_drop=0.03, sim_local_min=False)
    assert bc(both, [0.9] * 4, low) == [0, 0, 0, 0]
    assert bc(DecisionRule(0.42, sim_window=1, sim_drop=0.03, sim_gate=0.8), [0.9] * 4, low) == [0, 0, 0, 0]
    assert bc(DecisionRule(0.42, sim_window=5, sim_drop=0.1), [0.9], [0.0]) == [0]  # one gap never dips
    with pytest.raises(ValueError, match="go together"):
        DecisionRule(0.42, sim_window=2)
    with pytest.raises(ValueError, match="sim_window"):
        DecisionRule(0.42, sim_window=0, sim_drop=0.1)
    d = json.loads(json.dumps(rel.to_json()))
    assert DecisionRule.from_json(d) == rel and rel.needs_similarity
    assert "more than 0.3 below the mean of 1 gaps each side" in rel.describe()


def test_choose_sim_dip_refuses_a_dip_that_costs_one_fold_of_dev():
    from qumem_pipeline.episodes.continuity.tune_decoding import choose_sim_dip

    # three dev dialogues, confident P(same) everywhere; a cosine dip finds the boundary in two of
    # them (per-dialogue Pk 1/3 -> 0) and adds a false one in the third (0 -> 1/2): dev as a whole
    # improves (0.222 -> 0.167), but with one dialogue per fold one fold gets worse -> refused
    p = np.array([0.9] * 7)
    dev = ([p, p, p],
           [np.array([0.6, 0.6, 0.05, 0.6, 0.6, 0.6, 0.6]), np.array([0.6, 0.6, 0.6, 0.6, 0.6, 0.05, 0.6]),
            np.array([0.6, 0.6, 0.6, 0.05, 0.6, 0.6, 0.6])],
           [[0, 0, 1, 0, 0, 0, 0], [0] * 7, [0, 0, 0, 1, 0, 0, 0]])
    cal = ([p], [dev[1][0]], [dev[2][0]])
    grid = [(0.1, None, None, None, False)]
    rule, sel = choose_sim_dip(DecisionRule(0.42), dev, cal, grid=grid, n_folds=3)
    assert rule == DecisionRule(0.42) and "none kept" in sel["kept"]
    # one fold (all of dev together): the same dip is kept
    rule, sel = choose_sim_dip(DecisionRule(0.42), dev, cal, grid=grid, n_folds=1)
    assert rule.sim_threshold == 0.1 and sel["dev_pk"] < sel["dev_pk_without_dips"] and sel["calib_pk"] == 0.0
