"""Step 1 of the LoCoMo harness, build units: what a conversation can be retrieved as.

Enters: a ``Conversation`` (one user's validated turns, dia ids per user) and, for the product's
units, that user's episodes or a memories table. Leaves: ``EvalUnit`` lists - each unit's text
(what gets embedded) and its pieces (the dia ids it covers and the words it costs, in text order).
A turn-based unit costs exactly the words of the text it carries (speaker prefix included).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

UNIT_KINDS = ("turns", "fixed_chunks", "sessions", "episodes", "memories")
WINDOW_SIZES = (2, 4, 8)


def word_count(text: str | None) -> int:
    return len(text.split()) if text else 0


@dataclass
class EvalUnit:
    """A retrievable unit: its text (embedded) and pieces, each covering turns at a word cost."""

    text: str
    pieces: list[tuple[frozenset, int]]  # (dia_ids covered, words), in text order
    turn_rows: tuple[int, ...] = ()  # rows of Conversation.lines() it holds (empty for memories)
    source_rows: tuple[int, ...] = ()  # a memory's evidence turns (rows of Conversation.lines()), for its index key

    @property
    def words(self) -> int:
        return sum(w for _, w in self.pieces)


@dataclass
class Conversation:
    sample_id: str
    user_id: str  # speaker_a's user: whose history holds both speakers' turns
    user_ids: list[str]
    turns: pl.DataFrame  # that user's validated turns, sorted by turn_index
    dia_by_user_turn: dict[str, dict[int, str]]  # user -> turn_index -> dia_id
    speaker_prefix: bool = True
    turns_by_user: dict[str, pl.DataFrame] | None = None  # every user's turns (decomposition input)

    def lines(self) -> list[tuple[str, str, str]]:
        """(dia_id, session_id, rendered text) per turn."""
        return [
            (d, s, f"{sp}: {t}" if sp and self.speaker_prefix else t)
            for d, s, sp, t in zip(self.turns["source_ref"].to_list(), self.turns["session_id"].to_list(),
                                   self.turns["speaker"].to_list(), self.turns["text"].to_list())
        ]


def _unit_from_rows(lines: Sequence[tuple[str, str, str]], rows: Sequence[int]) -> EvalUnit:
    """A unit holding these turns: its text is exactly what it costs (one piece per turn)."""
    ls = [lines[r] for r in rows]
    return EvalUnit("\n".join(l[2] for l in ls), [(frozenset([l[0]]), word_count(l[2])) for l in ls], tuple(rows))


def turn_units(conv: Conversation) -> list[EvalUnit]:
    lines = conv.lines()
    return [_unit_from_rows(lines, [i]) for i in range(len(lines))]


def window_units(conv: Conversation, size: int) -> list[EvalUnit]:
    """Non-overlapping windows of `size` consecutive turns, never crossing a session boundary."""
    lines = conv.lines()
    out: list[EvalUnit] = []
    for rows in _session_rows(lines):
        for i in range(0, len(rows), size):
            out.append(_unit_from_rows(lines, rows[i : i + size]))
    return out


def session_units(conv: Conversation) -> list[EvalUnit]:
    lines = conv.lines()
    return [_unit_from_rows(lines, rows) for rows in _session_rows(lines)]


def _session_rows(lines) -> list[list[int]]:
    groups: list[list[int]] = []
    prev = None
    for i, l in enumerate(lines):
        if not groups or prev != l[1]:
            groups.append([])
        groups[-1].append(i)
        prev = l[1]
    return groups


def episode_units(conv: Conversation, episodes: pl.DataFrame | None) -> list[EvalUnit]:
    if episodes is None or episodes.height == 0:
        return []
    lines = conv.lines()
    row_of = {ti: i for i, ti in enumerate(conv.turns["turn_index"].to_list())}
    out = []
    for ids in episodes.sort("episode_index")["turn_ids"].to_list():
        rows = [row_of[t] for t in ids if t in row_of]
        if rows:
            out.append(_unit_from_rows(lines, rows))
    return out


def matched_window_units(conv: Conversation, episodes: pl.DataFrame | None) -> list[EvalUnit]:
    """The control for episodes: in every session, as many contiguous equal-length windows as the
    product made episodes there. Same sessions, same unit count, same total words; only where the
    boundaries fall differs, so this row isolates what the continuity classifier's boundaries are worth."""
    eps = episode_units(conv, episodes)
    if not eps:
        return []
    lines = conv.lines()
    per_session: dict[str, int] = defaultdict(int)
    for u in eps:
        per_session[lines[u.turn_rows[0]][1]] += 1
    out: list[EvalUnit] = []
    for rows in _session_rows(lines):
        k = min(per_session.get(lines[rows[0]][1], 1), len(rows))  # a session without episodes: one window
        out += [_unit_from_rows(lines, list(part)) for part in np.array_split(np.asarray(rows), k)]
    return out


def memory_units(conv: Conversation, memories: pl.DataFrame) -> list[EvalUnit]:
    """Memories of the conversation's users; evidence turn ids mapped to dia_ids via each user's turns."""
    out = []
    row_of = {l[0]: i for i, l in enumerate(conv.lines())}
    rows = memories.filter(pl.col("user_id").is_in(conv.user_ids))
    for uid, content, ev in zip(rows["user_id"].to_list(), rows["content"].to_list(), rows["evidence_turn_ids"].to_list()):
        m = conv.dia_by_user_turn.get(uid, {})
        dias = frozenset(m[t] for t in (ev or []) if t in m)
        text = content or ""
        out.append(EvalUnit(text, [(dias, word_count(text))], source_rows=tuple(sorted(row_of[d] for d in dias if d in row_of))))
    return out


def text_unit(dia_ids, text: str) -> EvalUnit:
    """One piece covering these dia ids at the text's word cost (how strategies' hits become units)."""
    return EvalUnit(text, [(frozenset(dia_ids), word_count(text))])


def memory_stats(units: list[EvalUnit], lines: Sequence[tuple[str, str, str]], budgets: Sequence[int]) -> dict:
    """What the memories row rests on: a memory is credited with every turn it cites, whatever it says.

    When all memories together fit in a budget, ranking plays no part there: recall is just the
    union of cited turns. ``cited_turn_words_per_memory_word`` shows how much text a memory claims
    to stand for (a tiny model citing 8 turns for "The user..." scores as perfect compression).
    """
    words_of = {l[0]: word_count(l[2]) for l in lines}
    total = sum(u.words for u in units)
    cited = [ids for u in units for ids, _ in u.pieces]
    cited_words = sum(words_of.get(d, 0) for ids in cited for d in ids)
    return {
        "n_memories": len(units),
        "total_words": total,
        "mean_evidence_turns": round(sum(len(ids) for ids in cited) / max(len(units), 1), 2),
        "turns_cited_by_any": len(set().union(*cited)) if cited else 0,
        "cited_turn_words_per_memory_word": round(cited_words / max(total, 1), 2),
        "budgets_holding_every_memory": [b for b in budgets if total <= b],
    }


UnitBuilder = Callable[[Conversation], list[EvalUnit]]


def unit_builders(units: Sequence[str], window_sizes: Sequence[int] = WINDOW_SIZES,
                  episodes_by_user: dict[str, pl.DataFrame] | None = None,
                  memories: pl.DataFrame | None = None) -> list[tuple[str, UnitBuilder]]:
    """(result key, builder) per unit kind to score, in report order.

    ``fixed_chunks`` gives one ``window_N`` key per size; ``episodes`` needs ``episodes_by_user``
    and brings its control ``matched_windows``; ``memories`` is built whenever a table is given.
    """
    kinds: list[tuple[str, UnitBuilder]] = []
    if "turns" in units:
        kinds.append(("turns", turn_units))
    if "fixed_chunks" in units:
        for s in window_sizes:
            kinds.append((f"window_{s}", lambda c, s=s: window_units(c, s)))
    if "sessions" in units:
        kinds.append(("sessions", session_units))
    if episodes_by_user is not None and "episodes" in units:
        kinds.append(("episodes", lambda c: episode_units(c, episodes_by_user.get(c.user_id))))
        kinds.append(("matched_windows", lambda c: matched_window_units(c, episodes_by_user.get(c.user_id))))
    if memories is not None:
        kinds.append(("memories", lambda c: memory_units(c, memories)))
    return kinds
