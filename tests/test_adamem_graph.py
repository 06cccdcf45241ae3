"""Memory graph: typed edges over existing tables, every endpoint exists, expansion is bounded."""

import dagster as dg
import polars as pl
import pytest

from qumem_pipeline.query.strategies.adamem.graph import EDGE_TYPES, MemoryGraph, build_memory_graph, dangling_edges
from tests import adamem_data as data


@pytest.fixture(scope="module")
def graph():
    return build_memory_graph(data.USER, data.turns(), data.episodes(), data.memories())


def test_every_edge_endpoint_exists_and_types_are_known(graph):
    nodes, edges = graph
    assert dangling_edges(nodes, edges).height == 0
    assert set(edges["edge_type"].unique()) <= set(EDGE_TYPES)
    kinds = set(edges["edge_type"].unique())
    assert {"supports", "in-episode", "same-topic", "mentions-entity", "next-episode"} <= kinds
    # a deliberately broken edge list is caught
    broken = pl.concat([edges, pl.DataFrame([{"user_id": data.USER, "src": "memory:nope", "dst": "turn:0",
                                              "edge_type": "supports"}], schema=edges.schema)])
    assert dangling_edges(nodes, broken)["src"].to_list() == ["memory:nope"]


def test_edges_follow_the_tables(graph):
    nodes, edges = graph
    sup = edges.filter(pl.col("edge_type") == "supports")
    assert sorted(zip(sup["src"], sup["dst"])) == sorted((f"memory:{m[0]}", f"turn:{t}") for m in data.MEMORIES for t in m[4])
    nxt = edges.filter(pl.col("edge_type") == "next-episode")
    assert sorted(zip(nxt["src"], nxt["dst"])) == [("episode:e0", "episode:e1"), ("episode:e1", "episode:e2")]
    # "adoption" is shared by episodes e0 and e2 only, so it is a topic linking them
    topic = edges.filter((pl.col("dst") == "topic:adoption") & pl.col("src").str.starts_with("episode:"))
    assert sorted(topic["src"]) == ["episode:e0", "episode:e2"]
    assert "entity:snorlaxia" in set(nodes["node_id"])
    owners = dict(zip(nodes["node_id"], nodes["owner"]))
    assert owners["memory:m-paint"] == "other" and owners["memory:m-pottery"] == "user" and owners["turn:1"] == "other"
    # hubs exist from their first linked item on
    pos = dict(zip(nodes["node_id"], nodes["position"]))
    assert pos["topic:adoption"] == 0 and pos["entity:snorlaxia"] == 7


def test_bad_reference_names_the_row():
    mems = data.memories().with_columns(pl.when(pl.col("memory_id") == "m-camp").then(pl.lit([99]))
                                        .otherwise(pl.col("evidence_turn_ids")).alias("evidence_turn_ids"))
    with pytest.raises(ValueError, match="m-camp.*evidence turn 99"):
        build_memory_graph(data.USER, data.turns(), data.episodes(), mems)


def test_expansion_bounded_by_hops_seeds_and_as_of(graph):
    g = MemoryGraph(*graph)
    priors = {t: 1.0 for t in EDGE_TYPES}
    seeds = {"memory:m-adopt": 1.0}
    one = g.expand(seeds, hops=1, priors=priors, decay=0.5, as_of=None)
    assert {n for n, (_, h) in one.items() if h == 1} == {v for v, _ in g.adj["memory:m-adopt"]}
    assert max(h for _, h in one.values()) == 1
    two = g.expand(seeds, hops=2, priors=priors, decay=0.5, as_of=None)
    assert set(one) < set(two) and max(h for _, h in two.values()) == 2
    # scores decay by prior x decay per hop
    assert all(abs(s - 0.5 ** h) < 1e-9 for s, h in two.values())
    # never a node after as_of, however many hops
    far = g.expand(seeds, hops=6, priors=priors, decay=0.9, as_of=3)
    assert far and all(g.nodes[n]["position"] is None or g.nodes[n]["position"] <= 3 for n in far)
    assert "memory:m-app" not in far and "turn:8" not in far
    # only edge types with a prior are followed; max_nodes caps the result
    only_support = g.expand(seeds, hops=3, priors={"supports": 1.0}, decay=1.0, as_of=None)
    assert set(only_support) == {"memory:m-adopt", "turn:0"}
    assert len(g.expand(seeds, hops=6, priors=priors, decay=0.9, as_of=None, max_nodes=5)) == 5
    # a future seed is dropped, not expanded
    assert g.expand({"memory:m-app": 1.0}, hops=2, priors=priors, decay=0.5, as_of=5) == {}


def test_memory_graph_asset_materializes_with_passing_check(tmp_path):
    from assets.adamem import GRAPH_EDGES, GRAPH_NODES, memory_graph
    from qumem_pipeline.storage.layout import DataLayout
    from resources import PipelineConfig

    layout = DataLayout(tmp_path / "data")
    layout.write_user_table("turns", data.USER, data.turns())
    layout.write_user_table("episodes", data.USER, data.episodes())
    layout.write_user_table("memories", data.USER, data.memories())
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("users", [data.USER])
    res = dg.materialize([memory_graph], instance=instance, partition_key=data.USER,
                         resources={"pipeline": PipelineConfig(data_root=str(tmp_path / "data"), archive_path=str(tmp_path))})
    assert res.success
    checks = {e.asset_check_key.name: e.passed for e in res.get_asset_check_evaluations()}
    assert checks == {"edge_endpoints_exist": True}
    nodes, edges = layout.read_user_table(GRAPH_NODES, data.USER), layout.read_user_table(GRAPH_EDGES, data.USER)
    assert edges.height > 0 and dangling_edges(nodes, edges).height == 0
