"""Answer-quality metrics for LoCoMo QA: token F1 and BLEU-1, scored the way LoCoMo's own evaluation does.

Token F1 follows snap-research/locomo ``task_eval/evaluation.py`` (``normalize_answer``,
``f1_score``, ``f1``, ``eval_question_answering``), so figures are comparable with the papers:

- normalisation (SQuAD-style, plus LoCoMo's two changes): drop commas, lowercase, strip ASCII
  punctuation, drop the words ``a an the`` *and* ``and``, collapse whitespace; tokens are the
  whitespace-separated words, each Porter-stemmed (nltk) for F1;
- F1 = 2PR/(P+R) over the multiset of common tokens (0 when nothing is shared);
- per category, as LoCoMo does: category 1 (multi-hop) splits prediction and gold on commas and
  averages, over gold parts, the best F1 of any predicted part; category 3 keeps the gold answer's
  text before the first ``;``; categories 2 and 4 use plain F1;
- category 5 (adversarial: the question has no answer in the conversation) is not F1: an answer
  scores 1 when it says ``no information available`` or ``not mentioned`` (LoCoMo's rule), else 0.
  It is reported apart from the headline (categories 1-4).

BLEU-1 is what mem0's evaluation reports (mem0ai/mem0 ``evaluation/metrics/utils.py``,
``calculate_bleu_scores``: nltk ``sentence_bleu`` with weights (1, 0, 0, 0)): clipped unigram
precision times the brevity penalty exp(1 - r/c) when the answer (c tokens) is shorter than the
reference (r tokens). Here it is computed on the same normalised tokens as F1 (unstemmed), and a
total miss scores 0 (mem0 tokenises with nltk ``word_tokenize``, keeping punctuation as tokens,
and smooths a zero match count to 0.1 - that needs nltk's punkt data, a download at run time).
"""

import math
import re
import string
from collections import Counter
from functools import lru_cache

_ARTICLES = re.compile(r"\b(a|an|the|and)\b")
_PUNCT = set(string.punctuation)
ABSTAIN_PHRASES = ("no information available", "not mentioned")


def normalize_answer(s: str) -> str:
    """LoCoMo's ``normalize_answer``: commas out, lower, punctuation out, articles (and 'and') out, whitespace."""
    s = str(s).replace(",", "").lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


@lru_cache(maxsize=1)
def _stemmer():
    from nltk.stem import PorterStemmer

    return PorterStemmer()


def tokens(s: str, stem: bool = False) -> list[str]:
    words = normalize_answer(s).split()
    if stem:
        ps = _stemmer()
        words = [ps.stem(w) for w in words]
    return words


def token_f1(prediction: str, gold: str) -> float:
    """LoCoMo's ``f1_score``: F1 over stemmed normalised tokens (multiset overlap)."""
    p, g = tokens(prediction, stem=True), tokens(gold, stem=True)
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def multi_answer_f1(prediction: str, gold: str) -> float:
    """LoCoMo's ``f1`` (category 1): comma-separated parts; mean over gold parts of the best predicted part."""
    preds = [p.strip() for p in str(prediction).split(",")]
    golds = [g.strip() for g in str(gold).split(",")]
    return sum(max(token_f1(p, g) for p in preds) for g in golds) / len(golds)


def bleu1(prediction: str, gold: str) -> float:
    """Sentence BLEU-1 against one reference: clipped unigram precision x brevity penalty."""
    p, g = tokens(prediction), tokens(gold)
    if not p or not g:
        return 0.0
    clipped = sum((Counter(p) & Counter(g)).values())
    if clipped == 0:
        return 0.0
    bp = 1.0 if len(p) > len(g) else math.exp(1 - len(g) / len(p))
    return bp * clipped / len(p)


def abstains(prediction: str) -> bool:
    low = str(prediction).lower()
    return any(ph in low for ph in ABSTAIN_PHRASES)


def score_answer(prediction: str | None, gold: str | None, category: int | None) -> dict:
    """Per-question scores: ``f1`` and ``bleu1`` (categories 1-4, LoCoMo's per-category F1 rule);
    for category 5 ``abstain`` (1/0, LoCoMo's rule). A missing prediction scores 0 everywhere."""
    pred = prediction or ""
    if category == 5:
        return {"abstain": 1.0 if abstains(pred) else 0.0}
    gold = "" if gold is None else str(gold)
    if category == 3:
        gold = gold.split(";")[0].strip()
    f1 = multi_answer_f1(pred, gold) if category == 1 else token_f1(pred, gold)
    return {"f1": f1, "bleu1": bleu1(pred, gold)}
