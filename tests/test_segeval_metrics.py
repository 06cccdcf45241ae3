"""Pk / WindowDiff / boundary F1 against hand-computed cases (gap-string convention)."""

import math

import pytest

from qumem_pipeline.episodes.metrics import boundary_prf, evaluate, pk, window_k, windowdiff


def test_window_k_rule():
    assert window_k(9, 3) == 2  # round(1.5) = 2
    assert window_k(20, 2) == 5
    assert window_k(10, 4) == 2  # round(1.25) = 1 -> max 2
    assert window_k(16, 1) == 8


def test_pk_wd_hand_case():
    # 9 utterances, reference segments 3|4|2 -> k = 2, 7 probe windows
    ref = [0, 0, 1, 0, 0, 0, 1, 0]
    hyp = [0, 1, 0, 0, 0, 0, 0, 0]
    # ref windows (any boundary): F T T F F T T ; hyp: T T F F F F F -> 4 disagreements
    assert pk(ref, hyp, 2) == pytest.approx(4 / 7)
    assert windowdiff(ref, hyp, 2) == pytest.approx(4 / 7)


def test_wd_counts_differ_from_pk():
    ref = [1, 1, 0, 0]
    hyp = [1, 0, 0, 0]
    # k=2, 3 windows. counts ref 2,1,0 ; hyp 1,0,0
    assert pk(ref, hyp, 2) == pytest.approx(1 / 3)
    assert windowdiff(ref, hyp, 2) == pytest.approx(2 / 3)


def test_perfect_and_all_wrong():
    ref = [0, 1, 0, 0, 1, 0]
    assert pk(ref, ref, 2) == 0.0
    assert windowdiff(ref, ref, 2) == 0.0
    # k=1 degenerates to per-gap disagreement rate
    hyp = [1, 0, 1, 1, 0, 1]
    assert pk(ref, hyp, 1) == 1.0


def test_short_dialogue_k_clipped():
    # 2 utterances -> 1 gap; k=2 is clipped to 1
    assert pk([1], [0], 2) == 1.0
    assert windowdiff([0], [0], 2) == 0.0
    with pytest.raises(ValueError):
        pk([], [], 2)


def test_boundary_f1():
    p, r, f = boundary_prf([[0, 1, 0], [1]], [[0, 1, 1], [0]])
    assert (p, r, f) == pytest.approx((0.5, 0.5, 0.5))
    assert boundary_prf([[0, 0]], [[0, 0]]) == (1.0, 1.0, 1.0)
    assert boundary_prf([[1, 0]], [[0, 0]])[2] == 0.0


def test_evaluate_macro_average_and_skips():
    refs = [[0, 0, 1, 0, 0, 0, 1, 0], [1, 1, 0, 0], []]
    hyps = [[0, 1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0], []]
    s = evaluate(refs, hyps)
    # dialogue 2: 5 utterances, 3 segments -> k = max(2, round(0.83)) = 2
    assert s.pk == pytest.approx((4 / 7 + 1 / 3) / 2)
    assert s.windowdiff == pytest.approx((4 / 7 + 2 / 3) / 2)
    assert s.n_skipped == 1 and s.n_dialogues == 3
    assert math.isnan(evaluate([[]], [[]]).pk)
