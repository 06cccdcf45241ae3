"""Step 3 of the LoCoMo harness, score: evidence recall of a ranking at word budgets.

Enters: units in rank order (or a score matrix) and each QA item's gold evidence dia ids. Leaves:
recall per budget per item (``budgeted_recall``), recall of the top units taken whole
(``recall_at_units``), collected per (unit key, scoring) in a ``Tally``.

Budget rule: units are taken whole while they fit. The unit that crosses the budget is truncated to
the remaining words (rather than dropped, which would penalise large units twice, or counted whole,
which would overspend): its turns are taken in order while they fit, and the turn that crosses
counts as covered only when at least half of its words fit (``MIN_COVER_FRACTION``); a memory is one
piece, so a truncated memory counts only when at least half of its words fit. Then retrieval stops.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from qumem_pipeline.eval.locomo.rank import rank_order
from qumem_pipeline.eval.locomo.units import EvalUnit

BUDGETS = (128, 256, 512, 1024)
MIN_COVER_FRACTION = 0.5
TOP_UNITS = (1, 3, 5)
BUDGET_RULE = (
    "units taken whole in rank order while they fit; the unit crossing the budget is truncated to the "
    "remaining words: its turns count while they fit, the crossing turn (or a memory) counts when >= half "
    "of its words fit"
)


@dataclass
class QAItem:
    sample_id: str
    category: int | None
    question: str
    gold: frozenset


def budgeted_coverage(ranked: Iterable[EvalUnit], budgets: Sequence[int] = BUDGETS,
                      min_fraction: float = MIN_COVER_FRACTION) -> dict[int, set]:
    """Turns covered at each budget by taking units in rank order (see the module's budget rule)."""
    budgets = sorted(budgets)
    out: dict[int, set] = {}
    covered: set = set()
    spent = 0
    bi = 0
    units = iter(ranked)
    exhausted = False
    while bi < len(budgets):
        b = budgets[bi]
        # finish every budget already reached before taking more units
        if exhausted:
            out[b] = set(covered)
            bi += 1
            continue
        try:
            unit = next(units)
        except StopIteration:
            exhausted = True
            continue
        # walk this unit's pieces, closing every budget it crosses
        for ids, w in unit.pieces:
            while bi < len(budgets) and spent + w > budgets[bi]:
                remaining = budgets[bi] - spent
                partial = set(covered)
                if w > 0 and remaining >= min_fraction * w:
                    partial |= ids
                out[budgets[bi]] = partial
                bi += 1
            covered |= ids
            spent += w
        if bi < len(budgets) and spent == budgets[bi]:
            out[budgets[bi]] = set(covered)
            bi += 1
    return out


def budgeted_recall(ranked: Iterable[EvalUnit], gold: Iterable, budgets: Sequence[int] = BUDGETS,
                    min_fraction: float = MIN_COVER_FRACTION) -> dict[int, float]:
    gold = set(gold)
    if not gold:
        raise ValueError("recall needs at least one gold evidence turn")
    cov = budgeted_coverage(ranked, budgets, min_fraction)
    return {b: len(cov[b] & gold) / len(gold) for b in budgets}


def recall_by_scores(units: list[EvalUnit], scores: np.ndarray, items: list[QAItem],
                     budgets: Sequence[int], min_fraction: float = MIN_COVER_FRACTION) -> list[dict[int, float]]:
    """Recall per item from a (items x units) score matrix: units taken best score first."""
    if not units:
        return [{b: 0.0 for b in budgets} for _ in items]
    return [budgeted_recall((units[j] for j in rank_order(scores[qi])), item.gold, budgets, min_fraction)
            for qi, item in enumerate(items)]


def recall_at_units(units: list[EvalUnit], scores: np.ndarray, items: list[QAItem],
                    ks: Sequence[int] = TOP_UNITS) -> list[dict[int, float]]:
    """Recall of the top-k units taken whole, whatever they cost: ranking quality apart from unit size."""
    out = []
    for qi, item in enumerate(items):
        order = rank_order(scores[qi]) if units else []
        rec = {}
        for k in sorted(ks):
            covered = set().union(*(ids for j in order[:k] for ids, _ in units[j].pieces)) if units else set()
            rec[k] = len(covered & item.gold) / len(item.gold)
        out.append(rec)
    return out


Scored = list[tuple[int | None, dict[int, float]]]  # (category, recall per budget) per item


def _new_unit_stats() -> dict:
    return {"n_units": 0, "words": 0, "turns": 0, "over_max_seq": 0, "cross_session": 0, "seconds_embedding": 0.0}


@dataclass
class Tally:
    """Everything the report aggregates, filled conversation by conversation."""

    per_kind: dict[tuple[str, str], Scored] = field(default_factory=lambda: defaultdict(list))  # budgeted recall
    per_rank: dict[tuple[str, str], Scored] = field(default_factory=lambda: defaultdict(list))  # recall at top units
    unit_stats: dict[str, dict] = field(default_factory=lambda: defaultdict(_new_unit_stats))
    mem_conversations: list[str] = field(default_factory=list)
    mem_stats: dict[str, dict] = field(default_factory=dict)
    qumem_stats: dict[str, dict] = field(default_factory=dict)

    def add_scored(self, key: str, scoring: str, units: list[EvalUnit], scores: np.ndarray, items: list[QAItem],
                   budgets: Sequence[int], min_fraction: float) -> None:
        """Both recall figures of one unit kind under one scoring, for every item of a conversation."""
        for it, rec in zip(items, recall_by_scores(units, scores, items, budgets, min_fraction)):
            self.per_kind[(key, scoring)].append((it.category, rec))
        for it, rec in zip(items, recall_at_units(units, scores, items)):
            self.per_rank[(key, scoring)].append((it.category, rec))

    def add_ranked(self, key: str, ranked: list[list[EvalUnit]], items: list[QAItem], budgets: Sequence[int],
                   min_fraction: float) -> None:
        """Budgeted recall of ready-ranked unit lists (one per item), e.g. a query strategy's."""
        for it, units in zip(items, ranked):
            self.per_kind[(key, "text")].append((it.category, budgeted_recall(units, it.gold, budgets, min_fraction)))
