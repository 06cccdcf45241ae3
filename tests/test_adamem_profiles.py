"""Persona profiles: near-duplicate grouping, one merge call per group, citations of existing memories,
the asset (fake OpenAI server as LLM) feeding the graph's summarises edges and the warehouse."""

import json

import dagster as dg
import numpy as np
import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.query.strategies.adamem.profiles import build_profiles, near_duplicate_groups, uncited_profiles, vectors_for
from test_query_state import ScriptedLLM
from tests import adamem_data as data

EXTRA = [  # near-duplicate preferences about painting, stated at turns 5, 6, 9
    ("m-paint-1", "preference", "Caroline loves painting landscapes.", "e1", [6]),
    ("m-paint-2", "preference", "Caroline really loves painting landscapes.", "e2", [8]),
]


def memories() -> pl.DataFrame:
    base = data.memories()
    extra = pl.DataFrame({
        "memory_id": [m[0] for m in EXTRA], "user_id": [data.USER] * len(EXTRA), "type": [m[1] for m in EXTRA],
        "content": [m[2] for m in EXTRA], "episode_id": [m[3] for m in EXTRA], "evidence_turn_ids": [m[4] for m in EXTRA],
        "position": [max(m[4]) for m in EXTRA], "valid_from": [None] * len(EXTRA),
    }, schema=base.schema)
    return pl.concat([base, extra])


@pytest.fixture(scope="module")
def embedder():
    from qumem_pipeline.index.embeddings import Embedder

    return Embedder.load(device="cpu")


def test_groups_are_threshold_components():
    v = np.array([[1, 0, 0], [0.9, 0.436, 0], [0, 0.436, 0.9], [0, 0, 1]], dtype=np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    assert near_duplicate_groups(v, 0.85) == [[0, 1], [2, 3]]
    assert near_duplicate_groups(v, 0.1) == [[0, 1, 2, 3]]  # chained neighbours form one component
    assert near_duplicate_groups(v, 0.999) == [[0], [1], [2], [3]]
    assert near_duplicate_groups(np.zeros((0, 3), np.float32)) == []


def test_one_merge_call_per_group_and_citations(embedder):
    mems = memories()
    llm = ScriptedLLM({"merge": lambda r: json.dumps({"aspect": "painting", "summary": "Caroline loves painting landscapes."})})
    prof = build_profiles(mems, vectors_for(mems, None, embedder), llm)
    assert llm.batches == [["merge"]], "exactly one group of near-duplicates here, merged in one batch"
    merged = prof.filter(pl.col("merged_by") == "llm").row(0, named=True)
    assert sorted(merged["memory_ids"]) == ["m-paint-1", "m-paint-2"] and merged["aspect"] == "painting"
    assert merged["position"] == 8  # the latest cited memory
    cited = sorted(m for ids in prof["memory_ids"].to_list() for m in ids)
    assert cited == sorted(mems.filter(pl.col("type").is_in(["preference", "insight"]))["memory_id"].to_list())
    assert uncited_profiles(prof, mems) == []
    assert uncited_profiles(prof, mems.filter(pl.col("memory_id") != "m-paint-1")) == [merged["profile_id"]]


def test_finished_merges_are_reused_and_changed_groups_are_merged_again(embedder):
    """A rerun (crash later in the run, or an unchanged user rebuilt) must not pay for a merge twice."""
    mems = memories()
    vecs = vectors_for(mems, None, embedder)
    first = build_profiles(mems, vecs, ScriptedLLM({"merge": lambda r: json.dumps({"aspect": "painting", "summary": "S1"})}))
    again = ScriptedLLM({"merge": lambda r: json.dumps({"aspect": "other", "summary": "S2"})})
    second = build_profiles(mems, vecs, again, previous=first)
    assert again.batches == [] and second.drop("created_at").equals(first.drop("created_at"))
    # a new near-duplicate joins the group: a different merge input, so it is merged again
    extra = mems.filter(pl.col("memory_id") == "m-paint-2").with_columns(
        memory_id=pl.lit("m-paint-3"), content=pl.lit("Caroline loves painting landscapes a lot."), position=pl.lit(9, dtype=mems.schema["position"]))
    grown = pl.concat([mems, extra])
    third = build_profiles(grown, vectors_for(grown, None, embedder), again, previous=first)
    assert again.batches == [["merge"]]
    assert third.filter(pl.col("merged_by") == "llm")["summary"].to_list() == ["S2"]


def test_failed_merge_falls_back_to_latest_memory(embedder):
    mems = memories()
    prof = build_profiles(mems, vectors_for(mems, None, embedder), ScriptedLLM({"merge": lambda r: "not json"}))
    row = prof.filter(pl.col("merged_by").str.starts_with("fallback")).row(0, named=True)
    assert row["summary"] == "Caroline really loves painting landscapes." and "invalid_json" in row["merged_by"]
    # answered (unusably) twice is finished: a rerun with the same model and prompt does not ask again
    rerun = ScriptedLLM({"merge": lambda r: json.dumps({"aspect": "a", "summary": "s"})})
    again = build_profiles(mems, vectors_for(mems, None, embedder), rerun, previous=prof)
    assert rerun.batches == [] and again.drop("created_at").equals(prof.drop("created_at"))


def test_missing_embedding_is_named():
    with pytest.raises(ValueError, match="m-dream"):
        build_profiles(data.memories(), {}, ScriptedLLM({}))


def test_profile_asset_feeds_graph_and_warehouse(tmp_path):
    from assets.adamem import GRAPH_EDGES, GRAPH_NODES, memory_graph, persona_profiles
    from qumem_pipeline.query.strategies.adamem.graph import dangling_edges
    from qumem_pipeline.storage.layout import DataLayout
    from qumem_pipeline.storage.warehouse import WAREHOUSE_TABLES, Warehouse
    from resources import PipelineConfig
    from resources.models import EmbedderResource, LLMResource

    root = tmp_path / "data"
    layout = DataLayout(root)
    layout.write_user_table("turns", data.USER, data.turns())
    layout.write_user_table("episodes", data.USER, data.episodes())
    layout.write_user_table("memories", data.USER, memories())
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("users", [data.USER])
    script = {"rules": [{"match": "persona profile", "responses": [{"json": {"aspect": "painting", "summary": "Loves painting."}}]}]}
    with RunningFakeServer(script, tmp_path / "srv") as srv:
        res = dg.materialize(
            [persona_profiles, memory_graph], instance=instance, partition_key=data.USER,
            resources={"pipeline": PipelineConfig(data_root=str(root), archive_path=str(tmp_path)),
                       "llm": LLMResource(kind="openai", base_url=srv.base_url, model="fake-model"),
                       "embedder": EmbedderResource(device="cpu")})
    assert res.success
    checks = {e.asset_check_key.name: e.passed for e in res.get_asset_check_evaluations()}
    assert checks == {"profiles_cite_existing_memories": True, "edge_endpoints_exist": True}
    prof = layout.read_user_table("persona_profiles", data.USER)
    assert prof.filter(pl.col("merged_by") == "llm")["summary"].to_list() == ["Loves painting."]
    edges = layout.read_user_table(GRAPH_EDGES, data.USER)
    summ = edges.filter(pl.col("edge_type") == "summarises")
    assert summ.height == sum(len(x) for x in prof["memory_ids"].to_list())
    assert dangling_edges(layout.read_user_table(GRAPH_NODES, data.USER), edges).height == 0
    assert "persona_profiles" in WAREHOUSE_TABLES
    wh = Warehouse(root / "wh.duckdb")
    assert wh.load_users(layout, [data.USER], ["persona_profiles"]) == {"persona_profiles": prof.height}


def test_profile_entries_are_retrieved_only_after_their_evidence(embedder):
    from qumem_pipeline.query.strategies.adamem.retriever import UserBundle
    from qumem_pipeline.query.strategies.adamem.route import plan_route

    mems = memories()
    llm = ScriptedLLM({"merge": lambda r: json.dumps({"aspect": "painting", "summary": "Caroline loves painting landscapes."})})
    prof = build_profiles(mems, vectors_for(mems, None, embedder), llm)
    bundle = UserBundle.build(data.USER, data.turns(), mems, embedder, episodes=data.episodes(), profiles=prof)
    q = "What does Caroline like to paint?"
    qv = embedder.encode([q])[0]
    late = {h.unit.unit_id: h for h in bundle.retrieve(q, qv, 11, plan_route(q))}
    pid = "profile:" + prof.filter(pl.col("merged_by") == "llm")["profile_id"][0]
    assert "profile" in late[pid].channels and late[pid].unit.evidence == [6, 8]
    early = bundle.retrieve(q, qv, 7, plan_route(q), k=50)
    assert pid not in {h.unit.unit_id for h in early}  # built from a memory at turn 8
