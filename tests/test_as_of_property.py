"""No query state sees or cites a turn after the query's as_of, in every registered strategy, over
shuffled, partly unstamped archives without turn_index (hypothesis).

The oracle is written from the raw archive alone, not from the pipeline's order: a stamped turn is
at or before t when its timestamp is <= t; an unstamped one when the next stamped turn of its
conversation in file order is <= t (it was said no later; with none after it, never). With an
as_of_turn, a turn is before it when its turn_index is <= as_of_turn. The path is the real one:
canonical JSONL -> import -> validate (turn order) -> read_queries/to_queries (as_of_position) ->
real embeddings and retrievers -> each strategy via the registry. The LLM (a system edge) is
scripted and cites every candidate it is shown, so any future candidate would surface as a citation.
"""

import json
import re
from datetime import datetime, timedelta, timezone

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qumem_pipeline.index.embeddings import embed_memories
from qumem_pipeline.index.vector_store import VectorStore, build_user_indexes
from qumem_pipeline.ingest.importers.canonical import import_canonical
from qumem_pipeline.ingest.validate import validate
from qumem_pipeline.query.queries import as_of_position, read_queries, to_queries
from qumem_pipeline.query.retrieval import TypedMemoryRetriever
from qumem_pipeline.query.strategies.adamem.retriever import AdaMemRetriever, UserBundle
from qumem_pipeline.query.strategies.hybrid import HybridRetriever
from qumem_pipeline.query.strategies.registry import STRATEGY_NAMES, infer_user_states
from test_query_state import ScriptedLLM
from tests.conftest import write_jsonl

USER = "alice"
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
DAY0 = datetime(2024, 1, 1, tzinfo=timezone.utc)
TOPICS = ["hiking", "vegan food", "chess", "the dentist", "Lisbon", "jazz", "running shoes", "tax forms"]
TYPES = ["fact", "preference", "insight"]


def stamp(day: int | None) -> str | None:
    return None if day is None else (DAY0 + timedelta(days=day)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cite_all(r) -> list[str]:
    aliases = list(dict.fromkeys(re.findall(r"\bM\d+\b", r.messages[1]["content"])))
    return [aliases[i:i + 3] for i in range(0, min(len(aliases), 9), 3)]


def _state(r, research=False):
    groups = _cite_all(r)
    out = {"facts": [{"statement": "s", "memory_ids": g} for g in groups], "preference_trajectory": [], "insights": []}
    if research:
        out.update(sufficient=False, follow_up="what else happened later")
    return json.dumps(out)


SCRIPT = {
    "a1": lambda r: json.dumps({"needs": [{"need": "history", "why": "answer"}]}),
    "a2": lambda r: json.dumps({"queries": [{"query": "what happened", "stores": TYPES}]}),
    "a3": _state, "psi": lambda r: json.dumps({"answer": "a"}),
    "research1": lambda r: _state(r, research=True), "research2": _state,
    "working": lambda r: json.dumps({"answer": "a"}),
}


@st.composite
def archives(draw):
    """Rows of one user's canonical archive (no turn_index) in a shuffled file order, partly unstamped."""
    n = draw(st.integers(3, 10))
    convs = draw(st.lists(st.sampled_from(["c1", "c2", "c3"]), min_size=n, max_size=n))
    days = draw(st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=n, max_size=n))
    rows = [{"user_id": USER, "conversation_id": c, "session_id": c, "role": "user" if i % 2 == 0 else "assistant",
             "speaker": "Alice" if i % 2 == 0 else "assistant", "text": f"turn {i} about {TOPICS[i % len(TOPICS)]}",
             "timestamp": stamp(d), "source_ref": f"r{i}"} for i, (c, d) in enumerate(zip(convs, days))]
    return draw(st.permutations(rows))


def known_by(rows: list[dict]) -> dict[str, datetime | None]:
    """source_ref -> the earliest time the turn is certainly said by (the oracle, from file order)."""
    out = {}
    for i, r in enumerate(rows):
        later = [x["timestamp"] for x in rows[i:] if x["conversation_id"] == r["conversation_id"] and x["timestamp"]]
        out[r["source_ref"]] = datetime.strptime(later[0], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc) if later else None
    return out


def memories_for(turns: pl.DataFrame, picks: list[list[int]]) -> pl.DataFrame:
    n = turns.height
    rows = []
    for j, pick in enumerate(picks):
        ev = sorted({p % n for p in pick})
        rows.append({"memory_id": f"m{j}", "user_id": USER, "type": TYPES[j % 3], "episode_id": f"e-{ev[-1]}",
                     "content": " / ".join(turns["text"][t] for t in ev), "evidence_turn_ids": ev, "position": ev[-1],
                     "valid_from": turns["timestamp"][ev[-1]]})
    return pl.DataFrame(rows, schema_overrides={"evidence_turn_ids": pl.List(pl.Int64), "valid_from": pl.Datetime("us", "UTC")})


def episodes_for(turns: pl.DataFrame) -> pl.DataFrame:
    """One episode per turn: the graph then links every memory to its own turns only."""
    n = turns.height
    return pl.DataFrame({"episode_id": [f"e-{i}" for i in range(n)], "user_id": [USER] * n, "episode_index": list(range(n)),
                         "first_turn_index": list(range(n)), "last_turn_index": list(range(n)),
                         "turn_ids": [[i] for i in range(n)]}, schema_overrides={"turn_ids": pl.List(pl.Int64)})


@pytest.fixture(scope="module")
def embedder():
    from qumem_pipeline.index.embeddings import Embedder

    return Embedder.load(device="cpu")


def run_strategy(name, queries, turns, mems, embedder):
    bundles = lambda: AdaMemRetriever({USER: UserBundle.build(USER, turns, mems, embedder, episodes=episodes_for(turns))},  # noqa: E731
                                      embedder)
    if name == "adamem":
        return infer_user_states(queries, ScriptedLLM(SCRIPT), bundles(), strategy=name, k=50)
    store = VectorStore.in_memory([build_user_indexes(embed_memories(mems, embedder), USER)])
    typed = TypedMemoryRetriever(store, embedder, mems)
    retriever = HybridRetriever(typed, bundles()) if name == "qumem_hybrid" else typed
    return infer_user_states(queries, ScriptedLLM(SCRIPT), retriever, strategy=name, k=50, respond=True)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(rows=archives(), picks=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=3), min_size=1, max_size=6),
       ts=st.lists(st.integers(-1, 6), min_size=1, max_size=3), turn_as_of=st.integers(-1, 10))
def test_no_citation_after_as_of_in_every_strategy(tmp_path_factory, embedder, rows, picks, ts, turn_as_of):
    tmp = tmp_path_factory.mktemp("asof")
    turns = validate(import_canonical(write_jsonl(tmp / "archive.jsonl", rows)), now=NOW).turns
    assert turns.height == len(rows)
    mems = memories_for(turns, picks)
    qrows = [{"query_id": f"t{i}", "user_id": USER, "query": "what happened", "as_of": stamp(d) if d >= 0 else "2023-06-01T00:00:00Z"}
             for i, d in enumerate(ts)] + [{"query_id": "turn", "user_id": USER, "query": "what happened", "as_of_turn": max(turn_as_of, 0)}]
    valid, bad = read_queries(write_jsonl(tmp / "queries.jsonl", qrows))
    assert bad.height == 0
    queries = to_queries(valid, {USER: turns})
    oracle = known_by(rows)
    ref_of = dict(zip(turns["turn_index"].to_list(), turns["source_ref"].to_list()))
    as_of = {r["query_id"]: r["as_of"] for r in valid.iter_rows(named=True)}
    as_of_turn = {r["query_id"]: r["as_of_turn"] for r in valid.iter_rows(named=True)}
    evidence = dict(zip(mems["memory_id"].to_list(), mems["evidence_turn_ids"].to_list()))

    def before(qid: str, turn: int) -> bool:
        if as_of_turn[qid] is not None:
            return turn <= as_of_turn[qid]
        when = oracle[ref_of[turn]]
        return when is not None and when <= as_of[qid]

    for name in STRATEGY_NAMES:
        out = run_strategy(name, queries, turns, mems, embedder)
        assert out.states.height == len(queries), name
        for r in out.states.iter_rows(named=True):
            shown = [t for c in r["candidates"] for t in
                     (evidence[c["memory_id"]] if c["memory_id"] in evidence else [c["position"]])]
            late = [t for t in r["cited_turn_ids"] + shown if not before(r["query_id"], t)]
            assert not late, (name, r["query_id"], late, rows)


def test_a_later_stamped_turn_placed_earlier_is_ordered_and_hidden_by_time(tmp_path):
    """The issue's case: file order says r-late comes first, its timestamp says last; and an
    unstamped turn in the middle takes its next stamped neighbour's time."""
    rows = [
        {"source_ref": "r-late", "timestamp": stamp(5)},
        {"source_ref": "r-early", "timestamp": stamp(1)},
        {"source_ref": "r-unstamped", "timestamp": None},
        {"source_ref": "r-mid", "timestamp": stamp(3)},
        {"source_ref": "r-trailing", "timestamp": None},
    ]
    rows = [{"user_id": USER, "conversation_id": "c1", "role": "user", "text": r["source_ref"], **r} for r in rows]
    turns = validate(import_canonical(write_jsonl(tmp_path / "a.jsonl", rows)), now=NOW).turns
    assert turns["source_ref"].to_list() == ["r-early", "r-unstamped", "r-mid", "r-late", "r-trailing"]
    at = lambda d: DAY0 + timedelta(days=d)  # noqa: E731
    assert as_of_position(turns, at(2), None) == 0  # r-unstamped is said by day 3 at the latest: not yet
    assert as_of_position(turns, at(3), None) == 2
    assert as_of_position(turns, at(4), None) == 2  # r-late (day 5) stays hidden
    assert as_of_position(turns, at(9), None) == 3  # r-trailing: no stamped turn after it, never known by time
    assert as_of_position(turns, None, None) == 4 and as_of_position(turns, at(0), 4) == 4


def test_an_explicit_order_that_contradicts_timestamps_ends_the_prefix():
    turns = pl.DataFrame({"turn_index": [0, 1, 2, 3], "timestamp": [stamp(1), stamp(5), None, stamp(2)]})
    turns = turns.with_columns(pl.col("timestamp").str.to_datetime(time_zone="UTC"))
    # turn 3 is stamped day 2, but turn 1 (day 5) comes before it: at day 3 only turn 0 is safe
    assert as_of_position(turns, DAY0 + timedelta(days=3), None) == 0
    assert as_of_position(turns, DAY0 + timedelta(days=5), None) == 3
