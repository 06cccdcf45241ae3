"""LoCoMo retrieval harness: evidence recall at equal word budgets for different retrieval units.

For every conversation of a LoCoMo-format file, each QA item is answered with as_of = the end of
the conversation. Retrieval runs over units built from the conversation and the question; units are
ranked by cosine similarity (all-MiniLM-L6-v2, unit-norm vectors) and taken in rank order until a
word budget (128 / 256 / 512 / 1024 words of retrieved text) is spent. Recall is the share of the
item's gold evidence turns (``evidence`` dia_ids that name a turn of the conversation) covered by
the retrieved text, averaged over items with at least one valid evidence id.

Units (each covers a set of turns and costs its own word count):

- ``turns``: one turn, text ``"<speaker>: <text>"`` (photo captions as the importer renders them);
- ``fixed_chunks``: non-overlapping windows of 2, 4 and 8 consecutive turns within a session (the
  last window of a session may be shorter); each size is reported, and ``fixed_chunks`` holds the
  size with the best mean recall over the four budgets (``window_turns`` says which);
- ``sessions``: a whole session;
- ``episodes``: the product's episodes (``build_episodes_for_users``: continuity classifier over
  the primary user's utterances, the other speaker's turns as context, default token budget);
  text and cost exactly like windows (speaker prefix included);
- ``episodes_matched_windows`` (with episodes): the control for episode boundaries - in every
  session as many contiguous equal-length windows as there are episodes there (same unit count and
  words, only the boundaries differ);
- ``memories``: typed memories from a memories Parquet table (``--memories``), or built here
  (``--decompose``: every speaker's episodes through the decomposition step with the configured
  LLM, written per user under ``--memories-out``); a memory costs the words of its content and
  covers its evidence turns. Both speakers' memories are pooled (a question may concern either).

Both users of a conversation hold the whole conversation (LoCoMo importer), so turn-based units are
built once from speaker_a's user history; the evidence is the same turns for both.

Budget rule: units are taken whole while they fit. The unit that crosses the budget is truncated to
the remaining words (rather than dropped, which would penalise large units twice, or counted whole,
which would overspend): its turns are taken in order while they fit, and the turn that crosses
counts as covered only when at least half of its words fit (``MIN_COVER_FRACTION``); a memory is one
piece, so a truncated memory counts only when at least half of its words fit. Then retrieval stops.

Scoring multi-turn units (windows, sessions, episodes; ``SCORINGS``): ``text`` embeds the unit's
text, which MiniLM truncates at 256 word pieces - a 20-turn episode is ranked by its first ~8
turns only; ``best_turn`` ranks a unit by its best-matching turn; ``mean_turn`` by the mean of its
turns' vectors. ``--unit-scoring`` picks the headline; ``retrieval_by_scoring`` has all three.
A unit always costs its whole text, whatever the scoring. ``recall_at_top_units`` (top 1/3/5
units taken whole, cost ignored) separates ranking quality from unit size; ``units`` gives each
kind's mean words, mean turns and the share of units longer than the embedder reads.

Episodes are the product's: the continuity classifier's boundaries, a new episode at every new
session, and the token budget's forced splits.

Slices (``--conversations``, ``--max-sessions N``) keep the QA items whose evidence lies in the
kept sessions, so every unit kind (memories included) is compared on the same data.

Headline figures (``retrieval``) are over categories 1-4; ``retrieval_with_adversarial`` adds
category 5 (adversarial). ``per_category`` has every category.

Strategies side by side (``--strategies qumem,adamem,topk``): each query strategy's ranked retrieval
under the same word budgets, one row per strategy in every table (see ``qumem_pipeline.eval.locomo.adamem_units``).
``qumem`` runs A1/A2 planning with the run's LLM backend (``--llm-kind``, or the one ``--decompose``
builds) over the memories (``--memories`` or ``--decompose``); without either it is skipped with the
reason. Its A1/A2 token totals and plan repairs are in ``qumem_planning``.

CLI: ``python -m qumem_pipeline.eval.locomo.harness PATH [--json] [--memories PARQUET_DIR | --decompose]
[--conversations IDS] [--max-sessions N] [--limit-conversations N] [--unit-scoring text|best_turn|mean_turn]
[--strategies qumem,adamem,topk]``;
with ``--json`` the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

BUDGETS = (128, 256, 512, 1024)
WINDOW_SIZES = (2, 4, 8)
MIN_COVER_FRACTION = 0.5
UNIT_KINDS = ("turns", "fixed_chunks", "sessions", "episodes", "memories")
SCORINGS = ("text", "best_turn", "mean_turn")
DEFAULT_SCORING = "text"
HEADLINE_CATEGORIES = (1, 2, 3, 4)
ALL_CATEGORIES = (1, 2, 3, 4, 5)
BUDGET_RULE = (
    "units taken whole in rank order while they fit; the unit crossing the budget is truncated to the "
    "remaining words: its turns count while they fit, the crossing turn (or a memory) counts when >= half "
    "of its words fit"
)


# ---------------------------------------------------------------------------------------- units


def word_count(text: str | None) -> int:
    return len(text.split()) if text else 0


@dataclass
class EvalUnit:
    """A retrievable unit: its text (embedded) and pieces, each covering turns at a word cost."""

    text: str
    pieces: list[tuple[frozenset, int]]  # (dia_ids covered, words), in text order
    turn_rows: tuple[int, ...] = ()  # rows of Conversation.lines() it holds (empty for memories)

    @property
    def words(self) -> int:
        return sum(w for _, w in self.pieces)


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


def memory_units(conv: Conversation, memories: pl.DataFrame) -> list[EvalUnit]:
    """Memories of the conversation's users; evidence turn ids mapped to dia_ids via each user's turns."""
    out = []
    rows = memories.filter(pl.col("user_id").is_in(conv.user_ids))
    for uid, content, ev in zip(rows["user_id"].to_list(), rows["content"].to_list(), rows["evidence_turn_ids"].to_list()):
        m = conv.dia_by_user_turn.get(uid, {})
        dias = frozenset(m[t] for t in (ev or []) if t in m)
        text = content or ""
        out.append(EvalUnit(text, [(dias, word_count(text))]))
    return out


# ---------------------------------------------------------------------------------------- loading


def load_conversations(path: str, limit: int | None = None) -> tuple[list[Conversation], dict]:
    from qumem_pipeline.ingest.importers.locomo import import_locomo
    from qumem_pipeline.ingest.validate import validate

    res = validate(import_locomo(path))
    turns = res.turns
    info = {"valid_turns": turns.height, "quarantined_rows": res.quarantine.height}
    order = turns["conversation_id"].unique(maintain_order=True).to_list()
    if limit is not None:
        order = order[:limit]
    convs = []
    for sid in order:
        t = turns.filter(pl.col("conversation_id") == sid).sort(["user_id", "turn_index"])
        users = t["user_id"].unique(maintain_order=True).to_list()
        by_user = {u: t.filter(pl.col("user_id") == u).sort("turn_index") for u in users}
        dia_maps = {u: dict(zip(g["turn_index"].to_list(), g["source_ref"].to_list())) for u, g in by_user.items()}
        convs.append(Conversation(sid, users[0], users, by_user[users[0]], dia_maps, turns_by_user=by_user))
    return convs, info


def _speaker_a_first(convs: list[Conversation], qa: list[dict]) -> None:
    """Use the QA items' user order (speaker_a first) for each conversation's primary user."""
    order = {q["sample_id"]: q["user_ids"] for q in qa}
    for c in convs:
        want = order.get(c.sample_id)
        if want and want[0] in c.dia_by_user_turn and want[0] != c.user_id:
            c.user_id = want[0]
            if c.turns_by_user:
                c.turns = c.turns_by_user[want[0]]
            c.user_ids = [u for u in want if u in c.dia_by_user_turn] + [u for u in c.user_ids if u not in want]


def read_memories(path: str | os.PathLike) -> pl.DataFrame:
    """A memories table: one Parquet file, a table directory (user_id=*/part-0.parquet) or a data root."""
    p = Path(path)
    if p.is_dir() and (p / "memories").is_dir():
        p = p / "memories"
    files = [p] if p.is_file() else sorted(x for x in p.rglob("*.parquet") if not x.name.startswith(".tmp-"))
    if not files:
        raise FileNotFoundError(f"no Parquet files under {path}")
    df = pl.read_parquet(files, hive_partitioning=False)
    missing = {"user_id", "content", "evidence_turn_ids"} - set(df.columns)
    if missing:
        raise ValueError(f"{path}: not a memories table (missing {sorted(missing)})")
    return df


def build_episodes(convs: list[Conversation], artifact_dir: str | None = None, device=None,
                   all_users: bool = False) -> tuple[dict[str, pl.DataFrame], str]:
    """The product's episodes (continuity classifier over user utterances, session breaks, default
    token budget).

    Retrieval units need only each conversation's primary user; decomposition (``all_users``)
    needs every speaker's, as the pipeline decomposes every user's own history.
    """
    from qumem_pipeline.episodes.continuity import ContinuityClassifier
    from qumem_pipeline.episodes.continuity.decoding import rule_of
    from qumem_pipeline.episodes.segmentation import build_episodes_for_users

    clf = ContinuityClassifier.load(artifact_dir, device=device)
    turns_by_user = {}
    for c in convs:
        turns_by_user[c.user_id] = c.turns
        if all_users:
            turns_by_user.update({u: t for u, t in (c.turns_by_user or {}).items() if u != c.user_id})
    eps, _ = build_episodes_for_users(
        turns_by_user, clf.predict_same_proba, rule=rule_of(clf), classifier_version=clf.version
    )
    return eps, clf.version


def slice_locomo(path: str, out_dir: str | os.PathLike, conversations: Sequence[str] | None = None,
                 max_sessions: int | None = None) -> tuple[Path, dict]:
    """A LoCoMo file cut to some conversations and/or their first ``max_sessions`` sessions.

    QA items are kept only when every evidence id lies in a kept session, so a sliced run never
    asks for evidence its units cannot contain. Written as a new file so the real importer and QA
    loader read it unchanged.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of LoCoMo samples")
    if conversations:
        known = {str(x.get("sample_id")) for x in data if isinstance(x, dict)}
        missing = [c for c in conversations if c not in known]
        if missing:
            raise ValueError(f"{path}: no conversation(s) {missing}; the file has {sorted(known)}")
        data = [x for x in data if isinstance(x, dict) and str(x.get("sample_id")) in set(conversations)]
    info = {"conversations": [str(x.get("sample_id")) for x in data], "max_sessions": max_sessions,
            "qa_items_dropped_evidence_outside_slice": 0}
    if max_sessions is not None:
        if max_sessions < 1:
            raise ValueError("--max-sessions must be >= 1")
        for sample in data:
            conv = sample.get("conversation") or {}
            for key in list(conv):
                m = re.match(r"^session_(\d+)(_date_time)?$", key)
                if m and int(m.group(1)) > max_sessions:
                    del conv[key]
            kept = []
            for q in sample.get("qa") or []:
                ev = [str(e) for e in (q.get("evidence") or [])]
                sess = [int(m.group(1)) for e in ev for m in [re.match(r"^D(\d+):\d+$", e)] if m]
                if sess and len(sess) == len(ev) and max(sess) <= max_sessions:
                    kept.append(q)
                else:
                    info["qa_items_dropped_evidence_outside_slice"] += 1
            sample["qa"] = kept
    out = Path(out_dir) / (Path(path).stem + ".slice.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(".tmp-" + out.name)
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, out)
    return out, info


def decompose_memories(convs: list[Conversation], episodes_by_user: dict[str, pl.DataFrame], backend,
                       out_root: str | os.PathLike | None = None, max_tokens: int = 384, log=None) -> pl.DataFrame:
    """Typed memories of every speaker of these conversations, by the pipeline's decomposition step.

    Users are decomposed one at a time and each user's table is written (atomically, in the
    pipeline's layout) as soon as it is done, so a long run on a slow backend leaves usable
    partial output and ``--memories OUT_ROOT`` can score it again without the LLM.
    """
    from datetime import datetime, timezone

    from qumem_pipeline.memories.decompose import decompose_episodes
    from qumem_pipeline.storage.layout import DataLayout

    log = log or (lambda msg: None)
    layout = DataLayout(out_root) if out_root is not None else None
    frames = []
    for c in convs:
        for u in c.user_ids:
            eps = episodes_by_user.get(u)
            turns = (c.turns_by_user or {}).get(u)
            if eps is None or turns is None or eps.height == 0:
                continue
            by_index = {r["turn_index"]: r for r in turns.iter_rows(named=True)}
            inputs = [{"user_id": u, "episode_id": e["episode_id"], "turns": [by_index[t] for t in e["turn_ids"]]}
                      for e in eps.iter_rows(named=True)]
            t0 = time.perf_counter()
            out = decompose_episodes(inputs, backend, created_at=datetime.now(timezone.utc), max_tokens=max_tokens)
            log(f"[locomo] decomposed {u}: {len(inputs)} episodes, {out.summary['llm_calls']} calls, "
                f"{out.memories.height} memories, {out.quarantine.height} quarantined ({time.perf_counter() - t0:.0f}s)")
            if layout is not None:
                layout.write_user_table("memories", u, out.memories)
                layout.write_user_table("llm_ledger", u, out.ledger)
            frames.append(out.memories)
    return pl.concat(frames) if frames else pl.DataFrame()


# ---------------------------------------------------------------------------------------- evaluation


@dataclass
class QAItem:
    sample_id: str
    category: int | None
    question: str
    gold: frozenset


def _rank_and_score(units: list[EvalUnit], scores: np.ndarray, items: list[QAItem],
                    budgets: Sequence[int], min_fraction: float = MIN_COVER_FRACTION) -> list[dict[int, float]]:
    """Recall per item from a (items x units) score matrix: units taken best score first."""
    if not units:
        return [{b: 0.0 for b in budgets} for _ in items]
    out = []
    for qi, item in enumerate(items):
        order = np.argsort(-scores[qi], kind="stable")
        out.append(budgeted_recall((units[j] for j in order), item.gold, budgets, min_fraction))
    return out


TOP_UNITS = (1, 3, 5)


def recall_at_units(units: list[EvalUnit], scores: np.ndarray, items: list[QAItem],
                    ks: Sequence[int] = TOP_UNITS) -> list[dict[int, float]]:
    """Recall of the top-k units taken whole, whatever they cost: ranking quality apart from unit size."""
    out = []
    for qi, item in enumerate(items):
        order = np.argsort(-scores[qi], kind="stable") if units else []
        covered: set = set()
        rec = {}
        for k in sorted(ks):
            covered = set().union(*(ids for j in order[:k] for ids, _ in units[j].pieces)) if units else set()
            rec[k] = len(covered & item.gold) / len(item.gold)
        out.append(rec)
    return out


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


def _aggregate(values: list[tuple[int | None, dict[int, float]]], cats: Iterable[int], budgets) -> dict | None:
    cats = set(cats)
    sel = [r for c, r in values if c in cats]
    if not sel:
        return None
    return {str(b): round(float(np.mean([r[b] for r in sel])), 4) for b in budgets}


def _make_backend(llm_kind: str | None):
    from qumem_pipeline.llm.factory import make_backend

    kind = llm_kind or os.environ.get("QUMEM_LLM_KIND", "local")
    cfg: dict = {}
    if kind == "openai":
        cfg = {"base_url": os.environ["QUMEM_LLM_BASE_URL"], "model": os.environ.get("QUMEM_LLM_MODEL") or None}
    elif kind in ("vllm-managed", "vllm"):
        cfg = {"model": os.environ["QUMEM_LLM_MODEL"]}
    return make_backend(kind, **cfg)


def run_eval(
    path: str,
    *,
    memories: str | os.PathLike | pl.DataFrame | None = None,
    limit_conversations: int | None = None,
    conversations: Sequence[str] | None = None,
    max_sessions: int | None = None,
    units: Sequence[str] = UNIT_KINDS,
    window_sizes: Sequence[int] = WINDOW_SIZES,
    budgets: Sequence[int] = BUDGETS,
    unit_scoring: str = DEFAULT_SCORING,
    continuity_artifact: str | None = None,
    device=None,
    embedder=None,
    decompose: bool = False,
    llm_backend=None,
    llm_kind: str | None = None,
    memories_out: str | os.PathLike | None = None,
    llm_max_tokens: int = 384,
    batch_size: int = 64,
    min_cover_fraction: float = MIN_COVER_FRACTION,
    speaker_prefix: bool = True,
    strategies: Sequence[str] = (),
    log=None,
) -> dict:
    """The full report (a JSON-serialisable dict). See the module docstring."""
    import tempfile

    from qumem_pipeline.index.embeddings import Embedder
    from qumem_pipeline.ingest.importers.locomo import CATEGORY_NAMES, load_locomo_qa_with_stats

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    budgets = tuple(sorted(budgets))
    unknown = set(units) - set(UNIT_KINDS)
    if unknown:
        raise ValueError(f"unknown unit kinds {sorted(unknown)}; expected {UNIT_KINDS}")
    from qumem_pipeline.eval.locomo.adamem_units import EVAL_STRATEGIES, NEEDS_LLM, NEEDS_MEMORIES, strategy_rankings
    from qumem_pipeline.query.retrieval import DEFAULT_K as QUMEM_K

    strategies = list(dict.fromkeys(strategies))
    if set(strategies) - set(EVAL_STRATEGIES):
        raise ValueError(f"unknown strategies {sorted(set(strategies) - set(EVAL_STRATEGIES))}; expected {EVAL_STRATEGIES}")
    if unit_scoring not in SCORINGS:
        raise ValueError(f"unknown unit scoring {unit_scoring!r}; expected one of {SCORINGS}")
    if decompose and memories is not None:
        raise ValueError("give either a memories table or --decompose, not both")
    slice_info = None
    with tempfile.TemporaryDirectory(prefix="locomo-slice-") as tmp:
        data_path = str(path)
        if conversations or max_sessions is not None:
            sliced, slice_info = slice_locomo(path, tmp, conversations, max_sessions)
            data_path = str(sliced)
        convs, load_info = load_conversations(data_path, limit_conversations)
        qa_all, qa_stats = load_locomo_qa_with_stats(data_path)
    _speaker_a_first(convs, qa_all)
    for c in convs:
        c.speaker_prefix = speaker_prefix
    conv_by_id = {c.sample_id: c for c in convs}

    skipped: dict = {"items_without_valid_evidence": 0, "evidence_ids_not_in_valid_turns": 0,
                     "items_outside_limited_conversations": 0,
                     "qa_loader": {k: v for k, v in qa_stats.as_dict().items() if k != "skipped"}}
    items_by_conv: dict[str, list[QAItem]] = defaultdict(list)
    for q in qa_all:
        conv = conv_by_id.get(q["sample_id"])
        if conv is None:
            skipped["items_outside_limited_conversations"] += 1
            continue
        known = set(conv.turns["source_ref"].to_list())
        gold = [d for d in q["evidence"] if d in known]
        skipped["evidence_ids_not_in_valid_turns"] += len(q["evidence"]) - len(gold)
        if not gold:
            skipped["items_without_valid_evidence"] += 1
            continue
        items_by_conv[conv.sample_id].append(QAItem(conv.sample_id, q["category"], q["question"], frozenset(gold)))
    n_items = sum(len(v) for v in items_by_conv.values())
    log(f"[locomo] {len(convs)} conversations, {n_items} QA items with evidence")

    # ---- optional unit sources
    episodes_by_user: dict[str, pl.DataFrame] | None = None
    classifier_version = None
    # the memories feed the memories row and the strategies (qumem ranks memories only)
    decompose = decompose and ("memories" in units or bool(strategies))
    backends: list = []  # one LLM backend for the run, built on first use (decomposition and qumem's A1/A2)

    def backend_once():
        if not backends:
            backends.append(llm_backend or _make_backend(llm_kind))
        return backends[0]

    if "episodes" in units or decompose:
        try:
            te = time.perf_counter()
            episodes_by_user, classifier_version = build_episodes(
                convs, continuity_artifact, device, all_users=decompose)
            log(f"[locomo] episodes built in {time.perf_counter() - te:.1f}s ({classifier_version})")
        except (FileNotFoundError, OSError, ValueError, KeyError) as e:
            skipped["episodes"] = f"continuity classifier unavailable: {e}"
            log(f"[locomo] episodes skipped: {e}")
    mem_df: pl.DataFrame | None = None
    decompose_info = None
    if "memories" in units or decompose:
        if decompose and episodes_by_user is not None:
            backend = backend_once()
            te = time.perf_counter()
            mem_df = decompose_memories(convs, episodes_by_user, backend, memories_out, llm_max_tokens, log)
            decompose_info = {"model": backend.model_name, "backend": backend.backend_name,
                              "seconds": round(time.perf_counter() - te, 1), "memories_out": str(memories_out)
                              if memories_out else None}
            if mem_df.height == 0:
                mem_df = None
                skipped["memories"] = "the decomposition produced no memories"
        elif decompose:
            skipped["memories"] = "decomposition needs the episodes, which were skipped"
        elif memories is None:
            skipped["memories"] = ("no memories table given (--memories PARQUET_DIR) and no --decompose; typed "
                                   "memories need the decomposition step's LLM")
        else:
            try:
                mem_df = memories if isinstance(memories, pl.DataFrame) else read_memories(memories)
            except (FileNotFoundError, ValueError, OSError) as e:
                skipped["memories"] = f"memories table unreadable: {e}"
    elif strategies and memories is not None:
        mem_df = memories if isinstance(memories, pl.DataFrame) else read_memories(memories)
    # an LLM is "available" when the run was given one: a backend, --llm-kind, or --decompose
    have_llm = llm_backend is not None or llm_kind is not None or decompose
    for name in strategies:
        if name in NEEDS_LLM and not have_llm:
            skipped[f"strategy_{name}"] = NEEDS_LLM[name]
        elif name in NEEDS_MEMORIES and mem_df is None:
            skipped[f"strategy_{name}"] = NEEDS_MEMORIES[name]
    run_strategies = [s for s in strategies if f"strategy_{s}" not in skipped]
    strategy_llm = backend_once() if any(s in NEEDS_LLM for s in run_strategies) else None
    qumem_stats: dict[str, dict] = {}

    emb = embedder or Embedder.load(device=device)
    questions = [it.question for c in convs for it in items_by_conv[c.sample_id]]
    te = time.perf_counter()
    q_all = emb.encode(questions, batch_size=batch_size)
    log(f"[locomo] {len(questions)} questions embedded in {time.perf_counter() - te:.1f}s")

    kinds: list[tuple[str, object]] = []  # (result key, builder)
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
    if mem_df is not None:
        kinds.append(("memories", lambda c: memory_units(c, mem_df)))
    need_turn_vecs = any(k not in ("turns", "memories") for k, _ in kinds)

    # per (unit key, scoring): (category, recall per budget) per item
    per_kind: dict[tuple[str, str], list[tuple[int | None, dict[int, float]]]] = defaultdict(list)
    per_rank: dict[tuple[str, str], list[tuple[int | None, dict[int, float]]]] = defaultdict(list)
    unit_stats: dict[str, dict] = defaultdict(lambda: {"n_units": 0, "words": 0, "turns": 0, "over_max_seq": 0, "cross_session": 0,
                                                       "seconds_embedding": 0.0})
    mem_conversations: list[str] = []
    mem_stats: dict[str, dict] = {}
    max_seq = getattr(emb, "max_seq_length", None)
    offset = 0
    for conv in convs:
        items = items_by_conv[conv.sample_id]
        qv = q_all[offset : offset + len(items)]
        offset += len(items)
        if not items:
            continue
        turn_vecs = emb.encode([l[2] for l in conv.lines()], batch_size=batch_size) if need_turn_vecs else None
        for key, builder in kinds:
            us = builder(conv)
            if key == "memories":
                if not us:
                    continue  # no memories for this conversation's users: excluded, reported below
                mem_conversations.append(conv.sample_id)
                mem_stats[conv.sample_id] = memory_stats(us, conv.lines(), budgets)
            st = unit_stats[key]
            te = time.perf_counter()
            if key == "turns" and turn_vecs is not None:
                uv = turn_vecs
            else:
                uv = emb.encode([u.text for u in us], batch_size=batch_size)
            st["seconds_embedding"] += time.perf_counter() - te
            st["n_units"] += len(us)
            st["words"] += sum(u.words for u in us)
            st["turns"] += sum(len(u.turn_rows) for u in us)
            sess = [l[1] for l in conv.lines()]
            st["cross_session"] += sum(1 for u in us if len({sess[r] for r in u.turn_rows}) > 1)
            if max_seq and hasattr(emb, "tokenizer") and us:
                lens = [len(x) for x in emb.tokenizer([u.text for u in us], truncation=False)["input_ids"]]
                st["over_max_seq"] += sum(1 for n in lens if n > max_seq)
            scorings = ("text",) if key in ("turns", "memories") else SCORINGS
            for sc in scorings:
                scores = unit_scores(us, qv, sc, unit_vecs=uv, turn_vecs=turn_vecs)
                for it, rec in zip(items, _rank_and_score(us, scores, items, budgets, min_cover_fraction)):
                    per_kind[(key, sc)].append((it.category, rec))
                for it, rec in zip(items, recall_at_units(us, scores, items)):
                    per_rank[(key, sc)].append((it.category, rec))
        if run_strategies:
            te = time.perf_counter()
            ranked = strategy_rankings(
                conv, [it.question for it in items], qv, run_strategies, emb, mem_df,
                episodes_by_user.get(conv.user_id) if episodes_by_user else None,
                lambda dias, text: EvalUnit(text, [(frozenset(dias), word_count(text))]),
                llm=strategy_llm, qumem_stats=qumem_stats)
            for name, lists in ranked.items():
                for it, units_ranked in zip(items, lists):
                    per_kind[(f"strategy_{name}", "text")].append(
                        (it.category, budgeted_recall(units_ranked, it.gold, budgets, min_cover_fraction)))
            unit_stats["strategies"]["seconds_embedding"] += time.perf_counter() - te
        log(f"[locomo] {conv.sample_id}: {len(items)} items, {len(kinds)} unit kinds done "
            f"({time.perf_counter() - t0:.0f}s)")

    def summary(key: str, cats, scoring: str) -> dict | None:
        # single-piece rows (turns, memories, anything ranked another way) exist under "text" only
        sc = scoring if (key, scoring) in per_kind else "text"
        return _aggregate(per_kind[(key, sc)], cats, budgets) if (key, sc) in per_kind else None

    def mean_recall(d: dict | None) -> float:
        return float(np.mean(list(d.values()))) if d else -1.0

    window_keys = [f"window_{s}" for s in window_sizes if (f"window_{s}", "text") in per_kind]

    def block(cats, scoring: str = unit_scoring) -> dict:
        best_window = max(window_keys, key=lambda k: mean_recall(summary(k, HEADLINE_CATEGORIES, scoring)), default=None)
        fixed = summary(best_window, cats, scoring) if best_window else None
        r = {
            "turns": summary("turns", cats, scoring),
            "fixed_chunks": ({**fixed, "window_turns": int(best_window.split("_")[1])} if fixed else None),
            "fixed_chunks_by_size": {k.split("_")[1]: summary(k, cats, scoring) for k in window_keys} or None,
            "sessions": summary("sessions", cats, scoring),
            "episodes": summary("episodes", cats, scoring),
            "episodes_matched_windows": summary("matched_windows", cats, scoring),
            "memories": summary("memories", cats, scoring),
        }
        if strategies:
            r["strategies"] = {s: summary(f"strategy_{s}", cats, scoring) for s in strategies}
        return r

    if "memories" in units and mem_df is not None and not mem_conversations:
        skipped["memories"] = "the memories table holds no memories of these conversations' users"
    elif mem_conversations and len(mem_conversations) < sum(1 for c in convs if items_by_conv[c.sample_id]):
        skipped["memories_partial"] = (
            f"memories only for conversations {mem_conversations}; memories figures cover those conversations' "
            f"items only (see memories_subset_turns for single turns on the same items)"
        )
    if "qumem" in run_strategies:
        missing = [c.sample_id for c in convs if items_by_conv[c.sample_id] and c.sample_id not in qumem_stats]
        if missing:
            skipped["strategy_qumem_partial"] = (f"no memories for conversations {missing}: qumem's figures cover "
                                                 f"the other conversations' items only")
    if "fixed_chunks" in units and not window_keys:
        skipped["fixed_chunks"] = "no window sizes given"

    per_category = {}
    cat_counts = defaultdict(int)
    for its in items_by_conv.values():
        for it in its:
            cat_counts[it.category] += 1
    for c in ALL_CATEGORIES:
        if cat_counts.get(c):
            per_category[str(c)] = {"name": CATEGORY_NAMES.get(c), "n": cat_counts[c], **block((c,))}
    if cat_counts.get(None):
        skipped["items_without_category"] = cat_counts[None]

    report = {
        "dataset": str(path),
        "slice": slice_info,
        "n_conversations": len(convs),
        "n_questions": sum(1 for c in convs for it in items_by_conv[c.sample_id] if it.category in HEADLINE_CATEGORIES),
        "n_questions_with_adversarial": n_items,
        "budgets": list(budgets),
        "units_requested": [u for u in UNIT_KINDS if u in units],
        "unit_scoring": unit_scoring,
        "retrieval_scope": "categories 1-4 (adversarial excluded); retrieval_with_adversarial adds category 5",
        "retrieval": block(HEADLINE_CATEGORIES),
        "retrieval_with_adversarial": block(ALL_CATEGORIES),
        "retrieval_by_scoring": {sc: block(HEADLINE_CATEGORIES, sc) for sc in SCORINGS},
        "per_category": per_category,
        "recall_at_top_units": {f"{k}|{sc}": _aggregate(v, HEADLINE_CATEGORIES, TOP_UNITS) for (k, sc), v in per_rank.items()},
        "units": {k: {"n_units": v["n_units"], "mean_words": round(v["words"] / max(v["n_units"], 1), 1),
                      "mean_turns": round(v["turns"] / max(v["n_units"], 1), 2),
                      "share_over_embedder_max_seq": round(v["over_max_seq"] / max(v["n_units"], 1), 3),
                      "share_crossing_sessions": round(v["cross_session"] / max(v["n_units"], 1), 3),
                      "seconds_embedding": round(v["seconds_embedding"], 1)} for k, v in unit_stats.items()},
        "budget_rule": BUDGET_RULE if min_cover_fraction == MIN_COVER_FRACTION
        else f"{BUDGET_RULE} [min_cover_fraction={min_cover_fraction}]",
        "speaker_prefix": speaker_prefix,
        "embedding_model": emb.version,
        "embedder_max_seq_length": max_seq,
        "continuity_classifier": classifier_version,
        "decomposition": decompose_info,
        "qumem_planning": ({"model": strategy_llm.model_name, "k_per_sub_query": QUMEM_K,
                            "backfill": "remaining memories in topk (raw-question dense) order",
                            "prompt_tokens": sum(v["a1_a2_prompt_tokens"] for v in qumem_stats.values()),
                            "completion_tokens": sum(v["a1_a2_completion_tokens"] for v in qumem_stats.values()),
                            "plans_repaired": sum(v["plans_repaired"] for v in qumem_stats.values()),
                            "by_conversation": qumem_stats} if qumem_stats else None),
        "as_of": "end of conversation",
        "primary_user": {c.sample_id: c.user_id for c in convs},
        "load": load_info,
        "skipped": skipped,
    }
    if mem_conversations:
        memset = set(mem_conversations)
        sub = [(cat, r) for (cat, r), conv_id in zip(per_kind[("turns", "text")], _item_conv_ids(convs, items_by_conv))
               if conv_id in memset] if ("turns", "text") in per_kind else []
        report["memories_subset_turns"] = _aggregate(sub, HEADLINE_CATEGORIES, budgets) if sub else None
        report["memories_stats"] = mem_stats
        report["memories_n_memories"] = int(mem_df.filter(pl.col("user_id").is_in(
            [u for c in convs if c.sample_id in memset for u in c.user_ids])).height)
        if "model" in mem_df.columns:
            report["memories_model"] = sorted(str(m) for m in mem_df["model"].unique().to_list())
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def _item_conv_ids(convs, items_by_conv) -> list[str]:
    return [c.sample_id for c in convs for _ in items_by_conv[c.sample_id]]


# ---------------------------------------------------------------------------------------- output


def format_table(report: dict) -> str:
    budgets = [str(b) for b in report["budgets"]]
    lines = [f"LoCoMo retrieval: evidence recall at word budgets ({report['dataset']}, "
             f"{report['n_conversations']} conversations, {report['n_questions']} questions cat 1-4, "
             f"{report['n_questions_with_adversarial']} with cat 5; {report['embedding_model']})"]

    def rows(block: dict) -> list[tuple[str, dict | None]]:
        out = [("turns", block["turns"])]
        for s, v in (block.get("fixed_chunks_by_size") or {}).items():
            out.append((f"window {s}", v))
        if block.get("fixed_chunks"):
            out.append((f"fixed (best={block['fixed_chunks']['window_turns']})", block["fixed_chunks"]))
        out += [("sessions", block["sessions"]), ("episodes", block["episodes"])]
        if "episodes_matched_windows" in block:
            out.append(("windows like eps", block["episodes_matched_windows"]))
        out.append(("memories", block["memories"]))
        out += [(f"strategy {s}", v) for s, v in (block.get("strategies") or {}).items()]
        return out

    def table(title: str, block: dict) -> None:
        lines.append("")
        lines.append(title)
        lines.append(f"  {'unit':<18}" + "".join(f"{b:>8}" for b in budgets))
        for name, vals in rows(block):
            if vals is None:
                lines.append(f"  {name:<18}" + f"{'n/a':>8}" * len(budgets))
            else:
                lines.append(f"  {name:<18}" + "".join(f"{vals[b]:>8.3f}" for b in budgets))

    table(f"overall (categories 1-4) - multi-turn units scored by {report['unit_scoring']}", report["retrieval"])
    for sc, blk in (report.get("retrieval_by_scoring") or {}).items():
        if sc != report["unit_scoring"]:
            table(f"overall (categories 1-4), multi-turn units scored by {sc}", blk)
    if report.get("units"):
        lines.append("")
        lines.append("units: " + "; ".join(
            f"{k} n={v['n_units']} words={v['mean_words']} turns={v['mean_turns']} "
            f"over_max_seq={v['share_over_embedder_max_seq']}" for k, v in report["units"].items()))
    table("overall with adversarial (categories 1-5)", report["retrieval_with_adversarial"])
    for c, blk in report["per_category"].items():
        table(f"category {c} ({blk['name']}, n={blk['n']})", blk)
    for conv_id, ms in (report.get("memories_stats") or {}).items():
        lines.append(f"memories {conv_id}: {json.dumps(ms)}")
        if ms["budgets_holding_every_memory"]:
            lines.append(f"  NOTE: every memory fits in {ms['budgets_holding_every_memory']} words: recall there is the "
                         f"union of cited turns, independent of ranking and of what the memories say")
    qp = report.get("qumem_planning")
    if qp:
        lines.append(f"qumem planning ({qp['model']}): A1+A2 prompt tokens {qp['prompt_tokens']}, completion tokens "
                     f"{qp['completion_tokens']}, plans repaired {qp['plans_repaired']}; backfill: {qp['backfill']}")
    sk = {k: v for k, v in report["skipped"].items() if k != "qa_loader"}
    lines.append("")
    lines.append(f"skipped: {json.dumps(sk)}")
    lines.append(f"budget rule: {report['budget_rule']}")
    lines.append(f"wall time: {report['wall_s']}s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--qa" in argv:  # answer quality (F1 / BLEU-1) instead of evidence recall
        from qumem_pipeline.eval.locomo.qa import main as qa_main

        return qa_main([a for a in argv if a != "--qa"])
    ap = argparse.ArgumentParser(prog="python -m qumem_pipeline.eval.locomo.harness", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a LoCoMo-format JSON file")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object on the last line")
    ap.add_argument("--out", help="also write the JSON report to this file")
    ap.add_argument("--memories", help="memories Parquet table (file, table dir or data root)")
    ap.add_argument("--limit-conversations", type=int, default=None)
    ap.add_argument("--conversations", default=None, help="comma list of sample_ids to keep (e.g. conv-26)")
    ap.add_argument("--max-sessions", type=int, default=None,
                    help="keep each conversation's first N sessions and the QA items whose evidence lies in them")
    ap.add_argument("--decompose", action="store_true",
                    help="build the memories row here: the product's episodes of every speaker through the "
                         "decomposition step with the configured LLM (QUMEM_LLM_KIND, default the embedded local model)")
    ap.add_argument("--llm-kind", default=None, help="local | openai | vllm-managed (default: $QUMEM_LLM_KIND or local)")
    ap.add_argument("--llm-max-tokens", type=int, default=384, help="max completion tokens per decomposition call")
    ap.add_argument("--memories-out", default=None, help="with --decompose: data root to write memories (per user, as done)")
    ap.add_argument("--unit-scoring", default=DEFAULT_SCORING, choices=SCORINGS,
                    help="how multi-turn units are scored for the headline table (all are in retrieval_by_scoring)")
    ap.add_argument("--units", default=",".join(UNIT_KINDS), help=f"comma list of {UNIT_KINDS}")
    ap.add_argument("--window-sizes", default=",".join(map(str, WINDOW_SIZES)))
    ap.add_argument("--continuity-artifact", default=None, help="continuity classifier artifact dir")
    ap.add_argument("--device", default=None, help="cpu / cuda (default: CUDA when available)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--min-cover-fraction", type=float, default=MIN_COVER_FRACTION,
                    help="share of a budget-crossing turn/memory that must fit for it to count (>1: never)")
    ap.add_argument("--no-speaker-prefix", action="store_true", help="embed/count turns without '<speaker>: '")
    ap.add_argument("--strategies", default="", help="comma list of query strategies to compare side by side "
                    "(qumem,adamem,topk); qumem needs an LLM (--llm-kind or --decompose) and memories "
                    "(--memories or --decompose), else it is skipped with the reason")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    report = run_eval(
        args.path,
        memories=args.memories,
        limit_conversations=args.limit_conversations,
        conversations=[c.strip() for c in args.conversations.split(",") if c.strip()] if args.conversations else None,
        max_sessions=args.max_sessions,
        decompose=args.decompose,
        llm_kind=args.llm_kind,
        llm_max_tokens=args.llm_max_tokens,
        memories_out=args.memories_out,
        unit_scoring=args.unit_scoring,
        units=[u.strip() for u in args.units.split(",") if u.strip()],
        window_sizes=[int(s) for s in args.window_sizes.split(",") if s.strip()],
        continuity_artifact=args.continuity_artifact,
        device=args.device,
        batch_size=args.batch_size,
        min_cover_fraction=args.min_cover_fraction,
        speaker_prefix=not args.no_speaker_prefix,
        strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
    )
    print(format_table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
