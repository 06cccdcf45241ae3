"""The segmentation metrics cross-checked against nltk.metrics.segmentation on random segmentations.

nltk's ``pk`` / ``windowdiff`` take a boundary string and one k; ours take the same gap strings as
int lists. For every k that nltk accepts (1 <= k <= gaps) both must agree exactly; what ours adds
on top (the per-dialogue k rule, clipping k for short dialogues, the macro average) is checked by
recomputing it around nltk's functions.
"""

import random

import pytest

from qumem_pipeline.episodes.metrics import evaluate, pk, window_k, windowdiff

segmentation = pytest.importorskip("nltk.metrics.segmentation")


def _s(gaps):
    return "".join(map(str, gaps))


def _random_gaps(rng: random.Random, n_gaps: int) -> list[int]:
    p = rng.choice([0.05, 0.2, 0.5, 0.9])
    return [int(rng.random() < p) for _ in range(n_gaps)]


def test_pk_and_windowdiff_equal_nltk_for_every_k():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 60)
        ref, hyp = _random_gaps(rng, n), _random_gaps(rng, n)
        for k in sorted({1, min(2, n), rng.randint(1, n), n}):
            assert pk(ref, hyp, k) == segmentation.pk(_s(ref), _s(hyp), k), (ref, hyp, k)
            assert windowdiff(ref, hyp, k) == segmentation.windowdiff(_s(ref), _s(hyp), k), (ref, hyp, k)


def test_evaluate_is_nltk_with_our_k_rule_clipping_and_macro_average():
    rng = random.Random(1)
    refs, hyps = [], []
    for _ in range(200):
        n = rng.randint(0, 40)  # n gaps: n = 0 is a one-utterance dialogue (skipped)
        refs.append(_random_gaps(rng, n))
        hyps.append(_random_gaps(rng, n))
    pks, wds = [], []
    for r, h in zip(refs, hyps):
        if not r:
            continue
        k = min(window_k(len(r) + 1, sum(r) + 1), len(r))  # our rule, clipped to the dialogue
        pks.append(segmentation.pk(_s(r), _s(h), k))
        wds.append(segmentation.windowdiff(_s(r), _s(h), k))
    got = evaluate(refs, hyps)
    assert got.n_skipped == sum(1 for r in refs if not r) > 0
    assert got.pk == pytest.approx(sum(pks) / len(pks), abs=1e-12)
    assert got.windowdiff == pytest.approx(sum(wds) / len(wds), abs=1e-12)


def test_what_nltk_does_not_do_short_dialogues():
    # nltk refuses a window wider than the dialogue; ours clips it to one probe over the whole dialogue
    ref, hyp = [1, 0], [0, 0]
    with pytest.raises(ValueError):
        segmentation.windowdiff(_s(ref), _s(hyp), 3)
    assert windowdiff(ref, hyp, 3) == segmentation.windowdiff(_s(ref), _s(hyp), 2) == 1.0
    assert pk(ref, hyp, 3) == segmentation.pk(_s(ref), _s(hyp), 2) == 1.0
