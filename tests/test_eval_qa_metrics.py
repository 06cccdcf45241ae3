"""LoCoMo QA metrics on hand-computed cases (LoCoMo's normalisation and per-category F1 rule, BLEU-1)."""

import math

import numpy as np
import pytest

from qumem_pipeline.eval.locomo.qa_metrics import (
    bleu1, multi_answer_f1, normalize_answer, score_answer, token_f1, tokens,
)


def test_normalisation_drops_commas_punctuation_articles_and_and():
    assert normalize_answer("The cat, and a dog!") == "cat dog"
    assert normalize_answer("  An   apple's  core. ") == "apples core"
    assert normalize_answer("Theatre, anthem") == "theatre anthem"  # whole words only
    assert tokens("running races", stem=True) == ["run", "race"]


def test_token_f1_hand_computed():
    assert token_f1("7 May 2023", "7 May 2023") == 1.0
    # {in, may, 2023} vs {7, may, 2023}: 2 common, P = R = 2/3
    assert token_f1("in May 2023", "7 May 2023") == pytest.approx(2 / 3)
    # stems: [run, race] vs [she, run, race] ("a" dropped): P = 1, R = 2/3 -> F1 = 0.8
    assert token_f1("running races", "she runs a race") == pytest.approx(0.8)
    assert token_f1("nothing shared", "7 May 2023") == 0.0
    assert token_f1("", "7 May 2023") == 0.0
    # multiset overlap: "tea tea" vs "tea": 1 common, P = 1/2, R = 1 -> 2/3
    assert token_f1("tea tea", "tea") == pytest.approx(2 / 3)


def test_multi_answer_f1_category_1():
    # gold parts pottery / camping / painting -> best predicted part 1, 1, 0 -> mean 2/3
    assert multi_answer_f1("pottery, camping", "pottery, camping, painting") == pytest.approx(2 / 3)
    assert multi_answer_f1("camping, pottery", "pottery, camping") == 1.0


def test_bleu1_hand_computed():
    # clipped precision 2/2, brevity penalty exp(1 - 3/2)
    assert bleu1("May 2023", "7 May 2023") == pytest.approx(math.exp(-0.5))
    # "cat" clipped to its one reference count: 1/3, longer than the reference -> no penalty
    assert bleu1("cat cat cat", "cat dog") == pytest.approx(1 / 3)
    assert bleu1("a the an", "cat") == 0.0  # nothing left after normalisation
    assert bleu1("dog", "cat") == 0.0


def test_bleu1_matches_nltk_sentence_bleu_on_the_same_tokens():
    from nltk.translate.bleu_score import sentence_bleu

    for pred, gold in [("May 2023", "7 May 2023"), ("cat cat cat", "cat dog"),
                       ("she went to the lgbtq support group on 7 May", "7 May 2023"),
                       ("green tea and coffee", "coffee, green tea")]:
        ours = bleu1(pred, gold)
        ref = sentence_bleu([tokens(gold)], tokens(pred), weights=(1,))
        assert ours == pytest.approx(ref), (pred, gold)


def test_score_answer_per_category_rules():
    # category 3 keeps the gold text before ';': [like, no] vs [no] -> P 1, R 1/2 -> 2/3; BLEU-1 exp(1 - 2)
    s3 = score_answer("no", "Likely no; she switched to tea", 3)
    assert s3["f1"] == pytest.approx(2 / 3)
    assert s3["bleu1"] == pytest.approx(math.exp(-1))
    assert score_answer("coffee, green tea", "coffee, green tea", 1) == {"f1": 1.0, "bleu1": 1.0}
    assert score_answer("May 2023", "8 May 2023", 2)["f1"] == pytest.approx(0.8)
    # category 5: LoCoMo's abstention rule, no F1
    assert score_answer("Not mentioned in the conversation", "Rex", 5) == {"abstain": 1.0}
    assert score_answer("No information available.", "Rex", 5) == {"abstain": 1.0}
    assert score_answer("Rex", "Rex", 5) == {"abstain": 0.0}
    assert score_answer(None, "Rex", 4) == {"f1": 0.0, "bleu1": 0.0}
    assert score_answer(None, "Rex", 5) == {"abstain": 0.0}


def test_paired_difference_by_hand():
    from qumem_pipeline.eval.locomo.qa_summary import paired_difference

    same = paired_difference([0.5, 1.0, 0.75], [0.0, 0.5, 0.25])  # every gap is 0.5: no spread to sample
    assert same == {"n": 3, "delta": 0.5, "ci95": [0.5, 0.5]}
    mixed = paired_difference([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0])  # gaps 1, -1, 0, 0
    assert mixed["delta"] == 0.0 and mixed["ci95"][0] < 0 < mixed["ci95"][1]
    assert paired_difference([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]) == mixed  # seeded
    assert paired_difference([], []) == {"n": 0, "delta": None, "ci95": None}


def test_paired_difference_resamples_a_question_asked_twice_as_one():
    """PersonaMem's two contexts ask the same questions: the interval over both must not shrink as if
    the repeats were new questions (a cluster bootstrap by question text)."""
    from qumem_pipeline.eval.locomo.qa_summary import paired_difference

    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 2, 60).astype(float), rng.integers(0, 2, 60).astype(float)
    labels = [f"q{i}" for i in range(60)]
    once = paired_difference(a, b)
    twice_rows = paired_difference(np.r_[a, a], np.r_[b, b])
    twice_clustered = paired_difference(np.r_[a, a], np.r_[b, b], clusters=labels + labels)
    width = lambda r: r["ci95"][1] - r["ci95"][0]  # noqa: E731
    assert once["delta"] == twice_rows["delta"] == twice_clustered["delta"]
    assert width(twice_rows) < 0.8 * width(once)  # rows: the repeats pass for new evidence
    assert abs(width(twice_clustered) - width(once)) < 0.15 * width(once)
    assert twice_clustered["clusters"] == 60 and twice_clustered["n"] == 120
    # one question per cluster resamples like the plain bootstrap (same spread, same point)
    single = paired_difference(a, b, clusters=labels)
    assert single["delta"] == once["delta"] and abs(width(single) - width(once)) < 0.15 * width(once)


def test_paired_against_uses_only_questions_both_answered():
    from qumem_pipeline.eval.locomo.qa_contexts import QAQuestion
    from qumem_pipeline.eval.locomo.qa_summary import paired_against

    qs = [QAQuestion(f"c#{i}", "c", cat, "q", "a") for i, cat in enumerate([1, 2, 4, 5])]
    done = {("topk_turns", "c#0"): {"f1": 0.5}, ("topk_turns", "c#1"): {"f1": 0.0}, ("topk_turns", "c#2"): {"f1": 1.0},
            ("topk_turns", "c#3"): {"f1": 0.0},
            ("qumem", "c#0"): {"f1": 1.0}, ("qumem", "c#1"): {"f1": 0.5}, ("qumem", "c#3"): {"f1": 1.0}}
    got = paired_against(qs, ["topk_turns", "qumem"], done)
    # c#2 unanswered by qumem and c#3 (category 5) are left out: gaps 0.5 and 0.5
    assert got == {"qumem": {"n": 2, "delta": 0.5, "ci95": [0.5, 0.5]}}
    assert paired_against(qs, ["qumem"], done) == {}
