"""Segmentation metrics: Pk, WindowDiff and boundary F1.

Convention: a dialogue of ``n`` utterances is a boundary string over its ``n - 1`` *gaps*
(``b[i] = 1`` when utterance ``i + 1`` starts a new segment). Pk and WindowDiff follow the standard
definitions (Beeferman et al. 1999; Pevzner & Hearst 2002) exactly as implemented in
``nltk.metrics.segmentation.pk`` / ``windowdiff`` applied to that gap string: windows
``b[i : i + k]`` for ``i = 0 .. (n - 1) - k``, i.e. ``n - k`` probes, each comparing utterances ``i``
and ``i + k`` — identical to segeval's mass-based definition.

- Pk: a probe errs when reference and hypothesis disagree on "is there a boundary in the window".
- WindowDiff (unweighted): a probe errs when the *number* of boundaries in the window differs.
- ``k`` per dialogue from the reference: ``max(2, round(n / n_segments / 2))`` (Python ``round``,
  i.e. round-half-to-even, as ``int(round(...))`` in nltk).
- Short dialogues: when ``k > n - 1`` the window is clipped to ``k = n - 1`` (one probe spanning the
  whole dialogue); dialogues with fewer than 2 utterances have no gap and are excluded from the Pk/WD
  averages (counted as ``n_skipped``).
- Dialogue scores are averaged with equal weight per dialogue (macro), as in published TIAGE tables.
- Boundary F1: exact-position boundary matches, micro-averaged (TP/FP/FN summed over all gaps of all
  dialogues). With no reference and no predicted boundary at all, F1 is defined as 1.0.

Why not call nltk: ``pk`` / ``windowdiff`` here equal nltk's exactly for every k nltk accepts
(tests/test_segeval_nltk.py, 400 random segmentations), and what this module adds is exactly what
nltk leaves to the caller: the per-dialogue k rule above (nltk's default k comes from the gap
string and boundary count, with no floor of 2), clipping k for short dialogues (nltk's windowdiff
refuses k > gaps), the macro average with skipped one-utterance dialogues, and boundary F1 (none in
nltk). Keeping the two window functions (a dozen lines) keeps nltk out of the product's run-time
dependencies; it is a test dependency only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def window_k(n_utterances: int, n_segments: int) -> int:
    n_segments = max(1, n_segments)
    return max(2, int(round(n_utterances / n_segments / 2.0)))


def _effective_k(n_gaps: int, k: int) -> int:
    return max(1, min(k, n_gaps))


def _windows(ref: Sequence[int], hyp: Sequence[int], k: int, metric: str):
    """The k-wide windows both metrics slide over two gap strings of equal length."""
    if len(ref) != len(hyp):
        raise ValueError(f"length mismatch: {len(ref)} vs {len(hyp)}")
    if len(ref) == 0:
        raise ValueError(f"{metric} is undefined for a dialogue with fewer than 2 utterances")
    k = _effective_k(len(ref), k)
    return [(ref[i : i + k], hyp[i : i + k]) for i in range(len(ref) - k + 1)]


def pk(ref: Sequence[int], hyp: Sequence[int], k: int) -> float:
    """Pk on two gap strings of equal length (nltk definition). Needs ``len(ref) >= 1``."""
    wins = _windows(ref, hyp, k, "Pk")
    return sum(any(r) != any(h) for r, h in wins) / len(wins)


def windowdiff(ref: Sequence[int], hyp: Sequence[int], k: int) -> float:
    """Unweighted WindowDiff on two gap strings of equal length (nltk definition)."""
    wins = _windows(ref, hyp, k, "WindowDiff")
    return sum(sum(r) != sum(h) for r, h in wins) / len(wins)


@dataclass
class Scores:
    pk: float
    windowdiff: float
    f1: float
    precision: float
    recall: float
    n_dialogues: int
    n_skipped: int

    def as_dict(self) -> dict:
        return {"pk": self.pk, "windowdiff": self.windowdiff, "f1": self.f1}


def boundary_prf(refs: Sequence[Sequence[int]], hyps: Sequence[Sequence[int]]) -> tuple[float, float, float]:
    tp = fp = fn = 0
    for r, h in zip(refs, hyps, strict=True):
        for a, b in zip(r, h, strict=True):
            tp += bool(a) and bool(b)
            fp += (not a) and bool(b)
            fn += bool(a) and not b
    if tp + fp + fn == 0:
        return 1.0, 1.0, 1.0
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return p, r, f


def evaluate(refs: Sequence[Sequence[int]], hyps: Sequence[Sequence[int]]) -> Scores:
    """Macro Pk / WindowDiff with per-dialogue k, and micro boundary F1."""
    if len(refs) != len(hyps):
        raise ValueError("refs and hyps must have the same number of dialogues")
    pks, wds, skipped = [], [], 0
    for r, h in zip(refs, hyps):
        if len(r) == 0:
            skipped += 1
            continue
        k = window_k(len(r) + 1, sum(1 for x in r if x) + 1)
        pks.append(pk(r, h, k))
        wds.append(windowdiff(r, h, k))
    p, rec, f = boundary_prf(refs, hyps)
    nan = float("nan")
    return Scores(
        pk=sum(pks) / len(pks) if pks else nan,
        windowdiff=sum(wds) / len(wds) if wds else nan,
        f1=f,
        precision=p,
        recall=rec,
        n_dialogues=len(refs),
        n_skipped=skipped,
    )
