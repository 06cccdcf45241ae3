"""AdaMem through Dagster: memory_graph + query_states with QUMEM strategy "adamem", real embedder,
the fake OpenAI-compatible server as the LLM (a real local HTTP server)."""

import json

import dagster as dg

from fake_openai_server import RunningFakeServer
from tests import adamem_data as data
from tests.conftest import write_jsonl

RESEARCH = {"facts": [{"statement": "adoption meeting", "memory_ids": ["M1", "M2", "M3"]}],
            "preference_trajectory": [], "insights": [], "sufficient": True, "follow_up": ""}
SCRIPT = {"model": "fake-model", "rules": [
    {"match": "research agent", "responses": [{"json": RESEARCH}]},
    {"match": "working agent", "responses": [{"json": {"answer": "On Monday."}}]},
]}


def _materialize(tmp_path, queries: list[dict], script: dict, strategy: str, typed_indexes: bool = False):
    """query_states (and what it reads) for the shared two-participant history, through Dagster, with the
    fake OpenAI-compatible server answering `script`: (result, layout, requests the server got)."""
    from assets.adamem import memory_graph
    from assets.query_states import query_states
    from assets.retrieval import memory_embeddings, memory_indexes
    from qumem_pipeline.storage.layout import DataLayout
    from resources import PipelineConfig
    from resources.models import EmbedderResource, LLMResource

    root = tmp_path / "data"
    layout = DataLayout(root)
    layout.write_user_table("turns", data.USER, data.turns())
    layout.write_user_table("episodes", data.USER, data.episodes())
    layout.write_user_table("memories", data.USER, data.memories())
    path = write_jsonl(tmp_path / "q.jsonl", queries)
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("users", [data.USER])
    assets = [memory_embeddings, memory_indexes] if typed_indexes else []
    with RunningFakeServer(script, tmp_path / "srv") as srv:
        res = dg.materialize(
            [*assets, memory_graph, query_states], instance=instance, partition_key=data.USER,
            resources={
                "pipeline": PipelineConfig(data_root=str(root), archive_path=str(tmp_path), queries_path=str(path),
                                           query_strategy=strategy),
                "llm": LLMResource(kind="openai", base_url=srv.base_url, model="fake-model"),
                "embedder": EmbedderResource(device="cpu"),
            },
        )
        return res, layout, srv.requests()


def test_query_states_asset_runs_adamem_strategy(tmp_path):
    res, layout, sent = _materialize(tmp_path, [
        {"query_id": "q-early", "user_id": data.USER, "query": "When did Caroline go to the adoption meeting?", "as_of_turn": 2},
        {"query_id": "q-late", "user_id": data.USER, "query": "What did Melanie paint?", "as_of_turn": 11},
    ], SCRIPT, "adamem")
    assert res.success
    checks = {e.asset_check_key.name: e.passed for e in res.get_asset_check_evaluations()}
    assert checks == {"edge_endpoints_exist": True, "no_citation_after_as_of": True, "evidence_turns_exist": True}
    states = layout.read_user_table("query_states", data.USER)
    rows = {r["query_id"]: r for r in states.iter_rows(named=True)}
    assert set(rows) == {"q-early", "q-late"} and set(states["strategy"]) == {"adamem"}
    assert all(r["response"] == "On Monday." for r in rows.values())
    # as_of turn 2: no candidate and no cited turn after it
    assert rows["q-early"]["candidates"] and all(c["position"] <= 2 for c in rows["q-early"]["candidates"])
    assert rows["q-early"]["cited_turn_ids"] and max(rows["q-early"]["cited_turn_ids"]) <= 2
    assert len(rows["q-late"]["candidates"]) == 10  # top-k 10 by default
    # one research round and one working round, each one batch of both queries
    prompts = [json.dumps(r["body"]["messages"]) for r in sent if r["path"].endswith("/chat/completions")]
    assert sum("research agent" in p for p in prompts) == 2 and sum("working agent" in p for p in prompts) == 2


HYBRID_SCRIPT = {"model": "fake-model", "rules": [
    {"match": "information-need agent", "responses": [{"json": {"needs": [{"need": "the dog", "why": "asked"}]}}]},
    {"match": "retrieval-planning agent", "responses": [{"json": {"queries": [{"query": "pottery class", "stores": ["fact"]}]}}]},
    {"match": "user-state inference agent", "responses": [{"json": {
        "facts": [{"statement": "the dog is back", "memory_ids": ["M1", "M2", "M3"]}], "preference_trajectory": [],
        "insights": []}}]},
]}


def test_query_states_asset_runs_qumem_hybrid_strategy(tmp_path):
    """qumem_hybrid needs both retrievers: the typed FAISS indexes and AdaMem's bundles (graph included)."""
    res, layout, _ = _materialize(tmp_path, [
        {"query_id": "q-dog", "user_id": data.USER, "query": "How is Snorlaxia?", "as_of_turn": 11},
        {"query_id": "q-early", "user_id": data.USER, "query": "How is Snorlaxia?", "as_of_turn": 5},
    ], HYBRID_SCRIPT, "qumem_hybrid", typed_indexes=True)
    assert res.success
    checks = {e.asset_check_key.name: e.passed for e in res.get_asset_check_evaluations()}
    assert checks["no_citation_after_as_of"] and checks["evidence_turns_exist"]
    states = layout.read_user_table("query_states", data.USER)
    rows = {r["query_id"]: r for r in states.iter_rows(named=True)}
    assert set(rows) == {"q-dog", "q-early"} and set(states["strategy"]) == {"qumem_hybrid"}
    dog = {c["memory_id"] for c in rows["q-dog"]["candidates"]}
    assert "turn:7" in dog and "m-pottery" in dog  # the hybrid search's raw turn, the plan's fact
    assert all(c["position"] <= 5 for c in rows["q-early"]["candidates"])
    assert json.loads(rows["q-dog"]["plan"])[-1] == {"query": "How is Snorlaxia?", "stores": ["hybrid"]}
