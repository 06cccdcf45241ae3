"""Step 2 of the LoCoMo harness, rank: order a conversation's units for each question.

Enters: units (``units.py``), the questions' unit-norm vectors and the embedder. Leaves: an
(items x units) similarity matrix per scoring rule (``unit_scores``) or, for the query strategies,
ranked unit lists per question (``strategy_ranked_units``). Ties keep unit order (stable sort).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qumem_pipeline.eval.locomo.units import Conversation, EvalUnit, text_unit

SCORINGS = ("text", "best_turn", "mean_turn")
DEFAULT_SCORING = "text"
SINGLE_PIECE_KINDS = ("turns", "memories")  # scored by their own text only


def scorings_for(key: str) -> tuple[str, ...]:
    """A single-turn or single-memory unit has no turns to pool: ``text`` is its only scoring."""
    return ("text",) if key in SINGLE_PIECE_KINDS else SCORINGS


def unit_scores(units: list[EvalUnit], q_vecs: np.ndarray, scoring: str, *, unit_vecs: np.ndarray | None = None,
                turn_vecs: np.ndarray | None = None) -> np.ndarray:
    """(items x units) similarities under one scoring rule (see ``SCORINGS``).

    ``text`` embeds the unit's own text (MiniLM reads its first 256 word pieces only);
    ``best_turn`` scores a unit by its best-matching turn; ``mean_turn`` by the normalised mean of
    its turns' vectors. The last two need the unit's turns (``turn_rows``) and the turn vectors.
    """
    if not units:
        return np.zeros((len(q_vecs), 0), dtype=np.float32)
    if scoring == "text":
        return q_vecs @ unit_vecs.T
    if turn_vecs is None or any(not u.turn_rows for u in units):
        raise ValueError(f"scoring {scoring!r} needs turn-based units and the turn vectors")
    if scoring == "best_turn":
        per_turn = q_vecs @ turn_vecs.T
        return np.stack([per_turn[:, list(u.turn_rows)].max(axis=1) for u in units], axis=1)
    if scoring == "mean_turn":
        means = np.stack([turn_vecs[list(u.turn_rows)].mean(axis=0) for u in units])
        means /= np.clip(np.linalg.norm(means, axis=1, keepdims=True), 1e-12, None)
        return q_vecs @ means.T
    raise ValueError(f"unknown scoring {scoring!r}; expected one of {SCORINGS}")


def rank_order(scores_row: np.ndarray) -> np.ndarray:
    """Unit indices best score first; equal scores keep unit order."""
    return np.argsort(-scores_row, kind="stable")


def embed_units(units: list[EvalUnit], embedder, batch_size: int, turn_vecs: np.ndarray | None = None,
                single_turns: bool = False, source_weight: float = 0.0) -> np.ndarray:
    """Unit vectors; single-turn units reuse the conversation's turn vectors when already computed.

    ``source_weight``: memories are keyed as the product's index keys them (``index.memory_keys``):
    their text plus that weight times their source turns' mean vector (``source_rows`` of ``turn_vecs``)."""
    if single_turns and turn_vecs is not None:
        return turn_vecs
    vecs = embedder.encode([u.text for u in units], batch_size=batch_size)
    if source_weight and any(u.source_rows for u in units):
        from qumem_pipeline.index.memory_keys import combine

        if turn_vecs is None:
            raise ValueError("keying memories by their source turns needs the turn vectors")
        vecs = combine(vecs, [turn_vecs[list(u.source_rows)] if u.source_rows else None for u in units], source_weight)
    return vecs


def strategy_ranked_units(conv: Conversation, questions: Sequence[str], q_vecs: np.ndarray,
                          strategies: Sequence[str], embedder, memories, episodes, *, llm=None,
                          qumem_stats: dict | None = None, source_weight: float | None = None) -> dict[str, list[list[EvalUnit]]]:
    """strategy -> per question, its ranked units (each hit one ``text_unit``); see ``adamem_units``."""
    from qumem_pipeline.eval.locomo.adamem_units import strategy_rankings
    from qumem_pipeline.index.memory_keys import SOURCE_WEIGHT

    return strategy_rankings(conv, questions, q_vecs, strategies, embedder, memories, episodes, text_unit,
                             llm=llm, qumem_stats=qumem_stats,
                             source_weight=SOURCE_WEIGHT if source_weight is None else source_weight)
