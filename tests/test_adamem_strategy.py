"""The adamem strategy: route plans, bounded expansion, lexical backoff, participants, research loop,
no future evidence. Real all-MiniLM embeddings; the LLM (a system edge) is scripted."""

import json

import pytest

from qumem_pipeline.query.strategies.adamem.graph import EDGE_TYPES
from qumem_pipeline.query.strategies.adamem.route import (
    ATTRIBUTE, MAX_HOPS, MAX_SEEDS, RELATIONAL, SINGLE_HOP, TEMPORAL, RoutePlan, detect_cues, plan_route,
)
from qumem_pipeline.query.strategies.adamem.retriever import UserBundle
from qumem_pipeline.query.strategies.adamem.strategy import MAX_ITERATIONS, AdaMemRetriever
from qumem_pipeline.query.strategies.base import Query
from qumem_pipeline.query.strategies.registry import infer_user_states
from test_query_state import ScriptedLLM
from tests import adamem_data as data

QUESTIONS = [
    "When did Caroline go to the adoption meeting?", "Why does Caroline want to adopt?",
    "What does Caroline like doing?", "What did Melanie paint?", "How is Snorlaxia?",
    "What do Caroline and Melanie both enjoy?", "Is the adoption application moving?",
]


@pytest.fixture(scope="module")
def embedder():
    from qumem_pipeline.index.embeddings import Embedder

    return Embedder.load(device="cpu")


@pytest.fixture(scope="module")
def bundle(embedder):
    return UserBundle.build(data.USER, data.turns(), data.memories(), embedder, episodes=data.episodes())


@pytest.mark.parametrize("q,cues", [
    ("When did Caroline go to the adoption meeting?", (TEMPORAL,)),
    ("Why does Caroline want to adopt?", (RELATIONAL,)),
    ("What does Caroline like doing?", (ATTRIBUTE,)),
    ("What did Melanie paint?", (SINGLE_HOP,)),
    ("Why did she start painting last year, and what are her hobbies?", (TEMPORAL, RELATIONAL, ATTRIBUTE)),
])
def test_cue_detection_and_bounded_plans(q, cues):
    assert detect_cues(q) == cues
    plan = plan_route(q)
    if cues == (SINGLE_HOP,):
        assert not plan.expand and plan.hops == 0 and plan.seeds == 0
    else:
        assert plan.expand and 1 <= plan.hops <= MAX_HOPS and 1 <= plan.seeds <= MAX_SEEDS
        assert plan.edge_priors and set(plan.edge_priors) <= set(EDGE_TYPES)
        assert all(0 < p <= 1 for p in plan.edge_priors.values())


@pytest.mark.parametrize("hops,seeds", [(1, 1), (1, 3), (2, 2)])
def test_expansion_bounded_by_hops_and_seeds(bundle, embedder, hops, seeds):
    q = "Why does Caroline want to adopt?"
    plan = RoutePlan(("relational",), True, hops, seeds, {t: 0.9 for t in EDGE_TYPES})
    trace: dict = {}
    hits = bundle.retrieve(q, embedder.encode([q])[0], 11, plan, k=30, trace=trace)
    assert 1 <= len(trace["seeds"]) <= seeds
    reached = trace["reached"]
    assert max(h for _, h in reached.values()) <= hops
    # every graph-channel hit is reachable from a seed within the hop bound
    within = set(trace["seeds"])
    for _ in range(hops):
        within |= {v for u in within for v, _ in bundle.graph.adj[u]}
    graph_hits = [h.unit.node_id for h in hits if "graph" in h.channels]
    assert graph_hits and set(graph_hits) <= within


def test_no_plan_means_no_graph(bundle, embedder):
    q = "What did Melanie paint?"
    trace: dict = {}
    hits = bundle.retrieve(q, embedder.encode([q])[0], 11, plan_route(q), trace=trace)
    assert hits and trace == {} and not any("graph" in h.channels for h in hits)
    assert hits[0].unit.content.startswith("Melanie: I painted a sunrise") or hits[0].unit.unit_id == "m-paint"


@pytest.mark.parametrize("as_of", [0, 3, 5, 8])
def test_no_future_evidence_by_any_route(bundle, embedder, as_of):
    vecs = embedder.encode(QUESTIONS)
    wide = RoutePlan(("relational",), True, MAX_HOPS, MAX_SEEDS, {t: 1.0 for t in EDGE_TYPES}, hop_decay=1.0)
    for q, v in zip(QUESTIONS, vecs):
        for plan in (plan_route(q), wide):
            hits = bundle.retrieve(q, v, as_of, plan, k=50)
            assert hits, q
            assert all(h.unit.position <= as_of for h in hits), (q, as_of)
            assert all(t <= as_of for h in hits for t in h.unit.evidence), (q, as_of)


def test_lexical_backoff_and_reactivation_channels(bundle, embedder):
    q = "Did the adoption agency mention Snorlaxia?"
    hits = bundle.retrieve(q, embedder.encode([q])[0], 11, plan_route(q))
    by_id = {h.unit.unit_id: h for h in hits}
    assert "lexical" in by_id["turn:7"].channels
    q = "Did Caroline attend an adoption agency meeting?"
    hits = bundle.retrieve(q, embedder.encode([q])[0], 11, plan_route(q))
    assert "reactivated" in {h.unit.unit_id: h for h in hits}["turn:0"].channels


def test_participant_bundles(bundle, embedder):
    q = "What did Melanie do at the lake?"  # resolves to the other participant
    hits = bundle.retrieve(q, embedder.encode([q])[0], 11, plan_route(q), k=20)
    mem_hits = [h.unit for h in hits if "memory" in h.channels]
    assert mem_hits and all(u.owner == "other" for u in mem_hits)
    q = "What happened at the lake?"  # ambiguous: both bundles
    hits = bundle.retrieve(q, embedder.encode([q])[0], 11, plan_route(q), k=20)
    assert {h.unit.owner for h in hits if "memory" in h.channels} == {"user", "other"}


def research(cite, sufficient=True, follow_up=""):
    return lambda r: json.dumps({"facts": [{"statement": "x", "memory_ids": cite}], "preference_trajectory": [],
                                 "insights": [], "sufficient": sufficient, "follow_up": follow_up})


def test_strategy_batches_stages_bounds_the_loop_and_keeps_as_of(bundle, embedder):
    llm = ScriptedLLM({
        "research1": research(["M1", "M2"], sufficient=False, follow_up="Snorlaxia stitches"),
        "research2": research(["M1", "M99"], sufficient=False, follow_up="more"),  # never a third round
        "working": lambda r: json.dumps({"answer": "short"}),
    })
    qs = [Query("q1", data.USER, "When did Caroline go to the adoption meeting?", 3),
          Query("q2", data.USER, "How is Snorlaxia?", 11)]
    out = infer_user_states(qs, llm, AdaMemRetriever({data.USER: bundle}, embedder), strategy="adamem", k=10)
    assert llm.batches == [["research1", "research1"], ["research2", "research2"], ["working", "working"]]
    assert MAX_ITERATIONS == 2 and out.stats["research_iterations_2"] == 2
    rows = {r["query_id"]: r for r in out.states.iter_rows(named=True)}
    assert set(rows) == {"q1", "q2"} and all(r["strategy"] == "adamem" and r["response"] == "short" for r in rows.values())
    # q1's as_of is turn 3: the follow-up search for Snorlaxia (turn 7) must not bring it in
    assert all(c["position"] <= 3 for c in rows["q1"]["candidates"])
    assert rows["q1"]["cited_turn_ids"] and max(rows["q1"]["cited_turn_ids"]) <= 3
    assert "turn:7" in [c["memory_id"] for c in rows["q2"]["candidates"]]
    assert rows["q2"]["dropped_citations"] == 1  # M99 was never retrieved
    plan = json.loads(rows["q1"]["plan"])
    assert [p["query"] for p in plan] == ["When did Caroline go to the adoption meeting?", "Snorlaxia stitches"]
    assert json.loads(rows["q1"]["needs"]) == {"target": "user", "cues": ["temporal"]}


def test_sufficient_evidence_stops_after_one_round(bundle, embedder):
    llm = ScriptedLLM({"research1": research(["M1"]), "working": lambda r: json.dumps({"answer": "a"})})
    out = infer_user_states([Query("q1", data.USER, "What did Melanie paint?", 11)], llm,
                            AdaMemRetriever({data.USER: bundle}, embedder), strategy="adamem")
    assert llm.batches == [["research1"], ["working"]] and out.states.height == 1


def test_adamem_needs_its_retriever():
    with pytest.raises(TypeError, match="AdaMemRetriever"):
        infer_user_states([Query("q1", "u", "x", 1)], ScriptedLLM({}), object(), strategy="adamem")


def test_turn_units_carry_their_session_date(bundle):
    turns = data.turns()
    ts = dict(zip(turns["turn_index"].to_list(), turns["timestamp"].to_list()))
    units = [u for u in bundle.units if u.kind == "turn"]
    assert units and all(u.valid_from == ts[u.position] for u in units)
    assert any(u.valid_from is not None for u in units)
