"""Dynamic episode construction (QUMem §3.2) from continuity decisions between user utterances.

The classifier sees only adjacent *user* utterances; assistant (or other-speaker) turns stay
with the user utterance they follow, as context. An episode is a maximal run of user
utterances the classifier judged continuous. A run that exceeds the token budget (what the
decomposition LLM can read at once) is split at its weakest continuity point, recursively,
and every forced split is counted — nothing is ever truncated.

Boundaries come from the classifier artifact's decision rule; when it has similarity dips it also
reads the base-MiniLM cosine of the same adjacent user-utterance pairs (``similarity=``, the
classifier's ``pair_cosine``), so the stage applies exactly the rule `qumem eval segmentation-ood`
reports. Each user's pairs go through the encoders in calls of their own, so a user's episodes are a
function of its own turns whichever users share the run (:func:`build_episodes_for_users`).
"""

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import polars as pl

from qumem_pipeline.episodes.continuity.decoding import DecisionRule, as_rule
from qumem_pipeline.episodes.continuity.similarity import history_signals_of
from qumem_pipeline.runtime.faults import fault_point
from qumem_pipeline.episodes.version import stage_version

EPISODE_SCHEMA = {
    "episode_id": pl.String,
    "user_id": pl.String,
    "episode_index": pl.Int64,
    "first_turn_index": pl.Int64,
    "last_turn_index": pl.Int64,
    "turn_ids": pl.List(pl.Int64),
    "n_turns": pl.Int64,
    "n_user_turns": pl.Int64,
    "start_ts": pl.Datetime("us", "UTC"),
    "end_ts": pl.Datetime("us", "UTC"),
    "boundary_prob": pl.Float64,  # P(new event) at this episode's start; null for the first
    "min_continuity": pl.Float64,  # weakest P(same) inside the episode; null for one utterance
    "forced_split": pl.Boolean,  # this episode starts at a budget-forced split
    "token_estimate": pl.Int64,
    "classifier_version": pl.String,
    "code_version": pl.String,
}

DEFAULT_TOKEN_BUDGET = 1536


def estimate_tokens(text: str) -> int:
    """~4 characters per token: cheap, deterministic, and conservative for English chat."""
    return max(1, math.ceil(len(text) / 4))


@dataclass(frozen=True)
class Unit:
    """One user utterance with the non-user turns that follow it (its context)."""

    turn_ids: list[int]
    tokens: int


def build_units(roles: Sequence[str], turn_indices: Sequence[int], token_counts: Sequence[int],
                sessions: Sequence[object] | None = None) -> list[Unit]:
    """Group a user's history into units; turns before the first user utterance join the first unit.

    With ``sessions``, non-user turns that open a new session (the other speaker starting the next
    day's chat) lead the next user utterance's unit instead of trailing the previous one; context
    after the last user utterance stays with it.
    """
    units: list[list[int]] = []
    tokens: list[int] = []
    unit_session: list[object] = []
    leading: list[int] = []
    leading_tokens = 0
    for k, (role, ti, tok) in enumerate(zip(roles, turn_indices, token_counts)):
        sess = sessions[k] if sessions is not None else None
        if role == "user":
            units.append(leading + [ti])
            tokens.append(leading_tokens + tok)
            unit_session.append(sess)
            leading, leading_tokens = [], 0
        elif units and not leading and sess == unit_session[-1]:
            units[-1].append(ti)
            tokens[-1] += tok
        else:
            leading.append(ti)
            leading_tokens += tok
    if leading and units:  # context after the last user utterance, in a later session
        units[-1] += leading
        tokens[-1] += leading_tokens
    elif leading:  # a history with no user utterance at all is one context-only unit
        units.append(leading)
        tokens.append(leading_tokens)
    return [Unit(u, t) for u, t in zip(units, tokens)]


def segment(p_same: Sequence[float], rule: DecisionRule | float,
            cosine: Sequence[float] | None = None, embeddings: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Units [start, end) per episode: a boundary wherever the decision rule puts one.

    ``rule`` is the classifier artifact's :class:`DecisionRule` (the same one `qumem eval
    segmentation` applies); a bare float is the plain rule "boundary where P(same) < threshold".
    ``cosine``: the adjacent cosine per link, for a rule with similarity dips; ``embeddings``: the
    user utterances' embeddings, for a learned rule with block features.
    """
    n = len(p_same) + 1
    cuts = np.flatnonzero(as_rule(rule).boundaries(p_same, cosine, embeddings)) if len(p_same) else []
    starts = [0] + [int(i) + 1 for i in cuts]
    return [(s, e) for s, e in zip(starts, starts[1:] + [n])]


def _one_rule(rule: DecisionRule | None, threshold: float | None) -> DecisionRule:
    if (rule is None) == (threshold is None):
        raise ValueError("pass exactly one of rule= (the classifier's DecisionRule) or threshold=")
    return rule if rule is not None else as_rule(threshold)


def enforce_budget(
    spans: list[tuple[int, int]], p_same: Sequence[float], unit_tokens: Sequence[int], budget: int
) -> tuple[list[tuple[int, int]], set[int], int]:
    """Split over-budget spans at their weakest internal link; returns (spans, forced starts, oversize singles)."""
    out: list[tuple[int, int]] = []
    forced: set[int] = set()
    oversize = 0
    stack = list(reversed(spans))
    while stack:
        s, e = stack.pop()
        total = sum(unit_tokens[s:e])
        if total <= budget or e - s == 1:
            if total > budget:
                oversize += 1  # one utterance + replies alone exceeds the budget: kept whole, counted
            out.append((s, e))
            continue
        # link i joins unit i and i+1; the internal links of [s, e) are s .. e-2
        cut = min(range(s, e - 1), key=lambda i: (p_same[i], -i))
        forced.add(cut + 1)
        stack.append((cut + 1, e))
        stack.append((s, cut + 1))
    return out, forced, oversize


def split_at(spans: list[tuple[int, int]], starts: set[int]) -> list[tuple[int, int]]:
    """Cut spans so that every unit index in ``starts`` begins an episode."""
    out = []
    for s, e in spans:
        cuts = [s] + sorted(i for i in starts if s < i < e) + [e]
        out += list(zip(cuts, cuts[1:]))
    return out


def session_starts(units: list[Unit], session_of_user_turn: dict[int, object]) -> set[int]:
    """Units whose user utterance is in another session than the previous unit's: a new session
    (another day, another chat) is a new event whatever the utterances say. Without this, on LoCoMo
    85 of 131 episodes spanned a session break and the token budget, not the events, chose most
    boundaries."""
    keys = [next(session_of_user_turn[t] for t in u.turn_ids if t in session_of_user_turn) for u in units]
    return {i for i in range(1, len(keys)) if keys[i] != keys[i - 1]}


def episode_id(user_id: str, first_turn: int, last_turn: int) -> str:
    """Stable across reruns: the same user and turn span always get the same id."""
    return hashlib.sha256(f"{user_id}:{first_turn}:{last_turn}".encode()).hexdigest()[:20]


@dataclass
class EpisodeStats:
    users: int = 0
    user_utterances: int = 0
    decisions: int = 0
    episodes: int = 0
    forced_splits: int = 0
    session_breaks: int = 0
    oversize_single_units: int = 0


def user_texts(turns: pl.DataFrame) -> list[str]:
    """One user's utterances in history order (the classifier's sequence; context turns left out)."""
    return turns.sort("turn_index").filter(pl.col("role") == "user")["text"].to_list()


def user_pairs(turns: pl.DataFrame) -> list[tuple[str, str]]:
    """Adjacent user-utterance pairs of one user's history (N-1 pairs for N user utterances)."""
    texts = user_texts(turns)
    return list(zip(texts[:-1], texts[1:]))


def build_user_episodes(
    turns: pl.DataFrame,
    p_same: np.ndarray,
    *,
    threshold: float | None = None,
    rule: DecisionRule | None = None,
    classifier_version: str,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    count_tokens: Callable[[str], int] = estimate_tokens,
    stats: EpisodeStats | None = None,
    break_on_session: bool = True,
    cosine: np.ndarray | None = None,
    embeddings: np.ndarray | None = None,
) -> pl.DataFrame:
    """Episodes of one user from their turns and the classifier's P(same) for each user pair
    (and, for a rule with similarity dips, the pairs' base-MiniLM ``cosine``; for a learned rule
    with block features, the user utterances' base-MiniLM ``embeddings``).

    ``break_on_session``: a change of (conversation_id, session_id) between user utterances always
    starts a new episode (counted in stats.session_breaks), on top of the classifier's boundaries.
    """
    rule = _one_rule(rule, threshold)
    turns = turns.sort("turn_index")
    if turns.height == 0:
        return pl.DataFrame(schema=EPISODE_SCHEMA)
    user_id = turns["user_id"][0]
    roles = turns["role"].to_list()
    tis = turns["turn_index"].to_list()
    toks = [count_tokens(t) for t in turns["text"].to_list()]
    sessions = None
    if break_on_session:  # tables without session columns are one session
        cols = [turns[c].to_list() if c in turns.columns else [None] * turns.height for c in ("conversation_id", "session_id")]
        sessions = list(zip(*cols))
    units = build_units(roles, tis, toks, sessions)
    n_user = sum(1 for r in roles if r == "user")
    p, c = _checked_signals(user_id, n_user, p_same, cosine, embeddings)
    spans = segment(p, rule, c, embeddings)
    breaks: set[int] = set()
    if break_on_session and n_user > 1:
        user_sessions = {t: k for t, k, r in zip(tis, sessions, roles) if r == "user"}
        breaks = session_starts(units, user_sessions) - {s for s, _ in spans}
        spans = split_at(spans, breaks)
    spans, forced, oversize = enforce_budget(spans, p, [u.tokens for u in units], token_budget)
    rows = _episode_rows(turns, user_id, units, spans, p, forced, classifier_version)
    if stats is not None:
        stats.users += 1
        stats.user_utterances += n_user
        stats.decisions += len(p)
        stats.episodes += len(rows)
        stats.forced_splits += len(forced)
        stats.session_breaks += len(breaks)
        stats.oversize_single_units += oversize
    return pl.DataFrame(rows, schema=EPISODE_SCHEMA)


def _checked_signals(user_id: str, n_user: int, p_same, cosine, embeddings) -> tuple[list[float], list[float] | None]:
    """The decisions' P(same) (and cosines) as floats, after checking they fit the user's utterances."""
    expected = max(n_user - 1, 0)
    if len(p_same) != expected:
        raise ValueError(f"user {user_id}: {len(p_same)} decisions for {n_user} user utterances (need {expected})")
    p = [float(x) for x in p_same]
    c = None if cosine is None else [float(x) for x in cosine]
    if c is not None and len(c) != len(p):
        raise ValueError(f"user {user_id}: {len(c)} cosines for {len(p)} decisions")
    if embeddings is not None and n_user and len(embeddings) != n_user:
        raise ValueError(f"user {user_id}: {len(embeddings)} utterance embeddings for {n_user} user utterances")
    if n_user == 0:  # only context turns: one episode, no decisions
        return [], ([] if c is not None else None)
    return p, c


def _episode_rows(turns: pl.DataFrame, user_id: str, units, spans, p: list[float], forced: set[int],
                  classifier_version: str) -> list[dict]:
    """One row per span of units: its turns, times, the decision that opened it and its weakest link."""
    tis = turns["turn_index"].to_list()
    ts_by_turn = dict(zip(tis, turns["timestamp"].to_list()))
    role_by_turn = dict(zip(tis, turns["role"].to_list()))
    rows = []
    for k, (s, e) in enumerate(spans):
        ids = [t for u in units[s:e] for t in u.turn_ids]
        stamps = [ts_by_turn[t] for t in ids if ts_by_turn[t] is not None]
        rows.append({
            "episode_id": episode_id(user_id, ids[0], ids[-1]),
            "user_id": user_id,
            "episode_index": k,
            "first_turn_index": ids[0],
            "last_turn_index": ids[-1],
            "turn_ids": ids,
            "n_turns": len(ids),
            "n_user_turns": sum(1 for t in ids if role_by_turn[t] == "user"),
            "start_ts": min(stamps) if stamps else None,
            "end_ts": max(stamps) if stamps else None,
            "boundary_prob": None if s == 0 else 1.0 - p[s - 1],
            "min_continuity": min(p[s : e - 1]) if e - s > 1 else None,
            "forced_split": s in forced,
            "token_estimate": sum(u.tokens for u in units[s:e]),
            "classifier_version": classifier_version,
            "code_version": stage_version("episodes"),
        })
    return rows


def build_episodes_for_users(
    turns_by_user: dict[str, pl.DataFrame],
    predict_same: Callable[[list[tuple[str, str]]], np.ndarray],
    *,
    threshold: float | None = None,
    rule: DecisionRule | None = None,
    classifier_version: str,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    count_tokens: Callable[[str], int] = estimate_tokens,
    break_on_session: bool = True,
    similarity: Callable[[list[tuple[str, str]]], np.ndarray] | None = None,
    embed_histories: Callable[[list[list[str]]], list[np.ndarray]] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, pl.DataFrame], EpisodeStats]:
    """Each user's pairs go through the classifier as calls of their own; then episodes per user.

    One user at a time, never batched with other users' pairs: an encoder's output for a row moves in
    the last bits with the rows it is batched with (CPU BLAS kernels differ by matrix shape and row
    position), and a cut near the rule's cutoff could then follow, so forgetting or adding one user
    could move another's episodes. Per user, a user's episodes are a function of its own turns
    (``tests/test_batch_independence.py``); users with one or two dozen utterances pay for it in
    smaller batches.

    ``rule``: the classifier's decision rule (``clf.rule``); ``threshold``: the plain rule.
    ``similarity``: pairs -> base-MiniLM cosine per pair (``clf.pair_cosine``); called only when the
    rule reads the cosine, and required then. ``embed_histories``: utterance lists -> their base-MiniLM
    embeddings (``clf.history_embeddings``); called (with one user's list) when the rule has block
    features (the cosine then comes from the same embeddings). ``progress(pairs done, pairs in all)``
    after each user.
    """
    rule = _one_rule(rule, threshold)
    if rule.needs_embeddings and embed_histories is None:
        raise ValueError(f"the decision rule ({rule.describe()}) needs embed_histories= "
                         "(the classifier's history_embeddings)")
    if rule.needs_similarity and not rule.needs_embeddings and similarity is None:
        raise ValueError(f"the decision rule ({rule.describe()}) needs similarity= (the classifier's pair_cosine)")
    texts_by_user = {u: user_texts(t) for u, t in turns_by_user.items()}
    total = sum(max(len(x) - 1, 0) for x in texts_by_user.values())
    embed = embed_histories if rule.needs_embeddings else None
    sim = similarity if rule.needs_similarity and embed is None else None
    signals: dict[str, tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] = {}
    done = 0
    for u, texts in texts_by_user.items():
        signals[u] = history_signals_of(texts, predict_same, embed_histories=embed, similarity=sim, label=f"user {u}")
        done += max(len(texts) - 1, 0)
        if progress is not None:
            progress(done, total)
    fault_point("episodes.classify")  # crash tests: killed after classifying, before any episode is written
    stats = EpisodeStats()
    out: dict[str, pl.DataFrame] = {}
    for u, t in turns_by_user.items():
        probs, cos, emb = signals[u]
        out[u] = build_user_episodes(
            t, probs, rule=rule, classifier_version=classifier_version, token_budget=token_budget,
            count_tokens=count_tokens, stats=stats, break_on_session=break_on_session, cosine=cos, embeddings=emb,
        )
    return out, stats

