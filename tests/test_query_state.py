"""Query-state agents: plan validation/repair, stage batching, citations, quarantine.

The LLM is the system edge here, so a scripted backend stands in for it (the real local model
runs the same code in the end-to-end pipeline test)."""

import json

import pytest

from qumem_pipeline.llm.base import ChatResult, parse_structured
from qumem_pipeline.query.strategies.base import Query, RetrievedMemory
from qumem_pipeline.query.strategies.qumem import validate_plan
from qumem_pipeline.query.strategies.registry import infer_user_states


class ScriptedLLM:
    model_name, backend_name = "scripted", "test"

    def __init__(self, script):
        self.script = script  # stage suffix -> callable(request) -> raw text
        self.batches = []

    def generate(self, requests):
        self.batches.append([r.request_id.rsplit("/", 1)[1] for r in requests])
        out = []
        for r in requests:
            raw = self.script[r.request_id.rsplit("/", 1)[1]](r)
            parsed, err = parse_structured(raw, r.json_schema)
            out.append(ChatResult(r.request_id, parsed, raw, err, prompt_tokens=10, completion_tokens=5))
        return out

    def close(self):
        pass


class ListRetriever:
    def __init__(self, memories):
        self.memories, self.calls, self.ks = memories, [], []

    def retrieve(self, requests, k):
        self.calls.append(requests)
        self.ks.append(k)
        return [[m for m in self.memories[u] if m.position <= as_of][:k] for u, plan, as_of in requests]


MEMS = {
    "alice": [
        RetrievedMemory("m-veg", "preference", "Alice is vegetarian.", 3, 0.9, [2, 3]),
        RetrievedMemory("m-vegan", "preference", "Alice became vegan for health reasons.", 40, 0.8, [40]),
    ]
}
GOOD = {
    "a1": lambda r: json.dumps({"needs": [{"need": "diet now", "why": "restaurant choice"}]}),
    "a2": lambda r: json.dumps({"queries": [{"query": "Alice diet", "stores": ["preference"]}]}),
    "a3": lambda r: json.dumps({"facts": [], "insights": [],
                                "preference_trajectory": [{"aspect": "diet", "earlier": "vegetarian", "current": "vegan",
                                                           "applies_now_because": "latest", "memory_ids": ["M1", "M2", "M9"]}]}),
}


@pytest.mark.parametrize(
    "raw,plan,repaired",
    [
        ({"queries": [{"query": "diet", "stores": ["fact", "fact"]}]}, [("diet", ["fact"])], None),
        ({"queries": [{"query": "diet", "stores": []}]}, [("diet", ["fact", "preference", "insight"])], "empty store set"),
        ({"queries": [{"query": "diet", "stores": ["facts", "insight"]}]}, [("diet", ["insight"])], "unknown store"),
        ({"queries": [{"query": " ", "stores": ["fact"]}]}, [("Q", ["fact"])], "empty rewritten query"),
        ({"nope": 1}, [("Q", ["fact", "preference", "insight"])], "malformed plan"),
        (None, [("Q", ["fact", "preference", "insight"])], "malformed plan"),
        ({"queries": ["x", 3]}, [("Q", ["fact", "preference", "insight"])], "malformed plan entry"),
    ],
)
def test_validate_plan_repairs(raw, plan, repaired):
    got, why = validate_plan(raw, "Q")
    assert got == plan
    assert (why is None) if repaired is None else (repaired in why)


def test_stages_batched_across_queries_and_citations_resolved():
    llm = ScriptedLLM(GOOD)
    qs = [Query("q1", "alice", "Where should I eat?", 100), Query("q2", "alice", "Dinner idea?", 10)]
    ret = ListRetriever(MEMS)
    out = infer_user_states(qs, llm, ret, k=5)
    assert llm.batches == [["a1", "a1"], ["a2", "a2"], ["a3", "a3"]], "one LLM batch per stage over all queries"
    # one retrieval call for all queries' plans, one for the queries themselves, twice as deep (ANCHOR_DEPTH)
    assert [len(c) for c in ret.calls] == [2, 2] and ret.ks == [5, 10]
    assert [plan for _, plan, _ in ret.calls[1]] == [[("Where should I eat?", ["fact", "preference", "insight"])],
                                                    [("Dinner idea?", ["fact", "preference", "insight"])]]
    # the first call carries A2's rewrites only: the anchor is searched once, in the deeper call
    assert [plan for _, plan, _ in ret.calls[0]] == [[("Alice diet", ["preference"])], [("Alice diet", ["preference"])]]
    rows = {r["query_id"]: r for r in out.states.iter_rows(named=True)}
    assert rows["q1"]["cited_memory_ids"] == ["m-veg", "m-vegan"] and rows["q1"]["dropped_citations"] == 1
    assert rows["q1"]["cited_turn_ids"] == [2, 3, 40]
    # q2's as_of is before the vegan memory: it was never a candidate, so M2 does not resolve.
    assert [c["memory_id"] for c in rows["q2"]["candidates"]] == ["m-veg"]
    assert rows["q2"]["cited_memory_ids"] == ["m-veg"] and rows["q2"]["dropped_citations"] == 2
    # A2's plan, then the query itself over every store (the anchor), recorded in the row
    assert json.loads(rows["q1"]["plan"]) == [{"query": "Alice diet", "stores": ["preference"]},
                                              {"query": "Where should I eat?", "stores": ["fact", "preference", "insight"]}]


def test_a_plan_that_is_only_the_anchor_is_searched_once_at_anchor_depth():
    from qumem_pipeline.query.strategies.user_state import retrieve_planned

    every = ["fact", "preference", "insight"]
    qs = [Query("q1", "alice", "Dinner?", 100), Query("q2", "alice", "Diet?", 100)]
    ret = ListRetriever(MEMS)
    got = retrieve_planned(qs, [[("dinner?", every)], [("Alice diet", ["preference"]), ("Diet?", every)]], ret,
                           k=1, anchor_k=2)
    # q1's plan is the anchor alone: nothing of it goes into the k-deep call
    assert ret.ks == [1, 2] and [plan for _, plan, _ in ret.calls[0]] == [[("Alice diet", ["preference"])]]
    assert [c.memory_id for c in got[0]] == ["m-veg", "m-vegan"]
    assert [c.memory_id for c in got[1]] == ["m-veg", "m-vegan"]
    # no deeper anchor: the plan goes out whole, in one call
    ret = ListRetriever(MEMS)
    retrieve_planned(qs[:1], [[("dinner?", every)]], ret, k=1)
    assert ret.ks == [1] and ret.calls[0][0][1] == [("dinner?", every)]


def test_query_anchor_is_added_once():
    from qumem_pipeline.query.strategies.qumem import with_query_anchor

    every = ["fact", "preference", "insight"]
    assert with_query_anchor([("Alice diet", ["preference"])], " Dinner? ") == [("Alice diet", ["preference"]),
                                                                               ("Dinner?", every)]
    repaired = [("dinner?", every)]  # a plan repaired to the query itself already holds it
    assert with_query_anchor(repaired, "Dinner?") == repaired
    assert with_query_anchor([("Dinner?", ["fact"])], "Dinner?") == [("Dinner?", ["fact"]), ("Dinner?", every)]


def test_merged_candidates_keep_one_row_per_memory_with_its_best_score():
    from qumem_pipeline.query.strategies.user_state import merge_candidates

    a = [RetrievedMemory("m1", "fact", "x", 1, 0.4), RetrievedMemory("m2", "fact", "y", 2, 0.9)]
    b = [RetrievedMemory("m1", "fact", "x", 1, 0.7), RetrievedMemory("m3", "insight", "z", 3, 0.2)]
    got = merge_candidates(a, b)
    assert [(c.memory_id, c.score) for c in got] == [("m1", 0.7), ("m2", 0.9), ("m3", 0.2)]


def test_topk_strategy_skips_planning():
    llm = ScriptedLLM(GOOD)
    out = infer_user_states([Query("q1", "alice", "Where should I eat?", 100)], llm, ListRetriever(MEMS), strategy="topk")
    assert llm.batches == [["a3"]]
    assert json.loads(out.states["plan"][0]) == [{"query": "Where should I eat?", "stores": ["fact", "preference", "insight"]}]


def test_bad_outputs_repaired_or_quarantined_never_crash():
    script = dict(GOOD)
    script["a2"] = lambda r: '{"queries": [{"query": "x", "stores": ["nonsense"]}'  # truncated JSON
    script["a3"] = lambda r: "not json at all"
    llm = ScriptedLLM(script)
    out = infer_user_states([Query("q1", "alice", "Where should I eat?", 100)], llm, ListRetriever(MEMS))
    assert out.states.height == 0 and out.quarantine.height == 1
    q = out.quarantine.row(0, named=True)
    assert q["stage"] == "A3" and "invalid_json" in q["reason"]
    assert out.stats["plans_repaired"] == 1
    assert llm.batches[1:] == [["a2"], ["a2"], ["a3"], ["a3"]], "one retry for unparseable output"


def test_future_candidates_from_a_broken_retriever_are_refused():
    class Leaky(ListRetriever):
        def retrieve(self, requests, k):
            return [self.memories[u] for u, _, _ in requests]

    with pytest.raises(AssertionError, match="after as_of"):
        infer_user_states([Query("q1", "alice", "x", 10)], ScriptedLLM(GOOD), Leaky(MEMS))
