"""Real Dagster runs on an ephemeral instance with the real embedded models.

One module-scoped run of the whole main job (3 users, every stage, the local LLM) feeds the
end-to-end assertions; the forget test runs last because it deletes a user from that run.
"""

import importlib

import dagster as dg
import duckdb
import polars as pl
import pytest

from qumem_pipeline.query.strategies.registry import default_strategy
from qumem_pipeline.storage.layout import DataLayout
from tests.conftest import conversation, write_jsonl

RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
CANARY = "CANARY-d41d8cd9-unique-to-bob"
ALL_ASSETS = ["turns", "episodes", "memories", "memory_embeddings", "memory_indexes", "persona_profiles", "memory_graph", "query_states", "warehouse"]


def load_defs():
    import assets.definitions as d

    importlib.reload(d)
    return d.build_definitions()


def run_job(defs, instance, users, job="main_job"):
    instance.add_dynamic_partitions("users", [u for u in users if not instance.has_dynamic_partition("users", u)])
    return defs.resolve_job_def(job).execute_in_process(
        instance=instance, tags={RANGE_START: users[0], RANGE_END: users[-1]}
    )


def event_log_hits(instance, needle: str) -> list:
    """Serialized Dagster event records (materialization metadata, logs, checks) that contain `needle`."""
    hits = []
    for run in instance.get_runs():
        for entry in instance.all_logs(run.run_id):
            if needle in dg.serialize_value(entry):
                hits.append((run.job_name, entry.dagster_event_type, entry.step_key))
    return hits


def files_containing(root, needle: str) -> list:
    """Files holding `needle` as raw bytes, or in decoded content (Parquet and DuckDB compress text)."""
    hits = []
    for p in root.rglob("*"):
        if not p.is_file():
            continue
        found = needle.encode() in p.read_bytes()
        if not found and p.suffix == ".parquet":
            df = pl.read_parquet(p)
            found = any(needle in str(v) for col in df.columns for v in df[col].to_list() if v is not None)
        if not found and p.suffix == ".duckdb":
            with duckdb.connect(str(p), read_only=True) as con:
                for schema, t in con.execute("SELECT table_schema, table_name FROM information_schema.tables").fetchall():
                    if con.execute(f'SELECT count(*) FROM "{schema}"."{t}" AS r WHERE CAST(r AS VARCHAR) LIKE ?', [f"%{needle}%"]).fetchone()[0]:
                        found = True
        if found:
            hits.append(p)
    return hits


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    archive = tmp / "archive"
    write_jsonl(
        archive / "a.jsonl",
        conversation("alice", "c1", ["I am vegetarian and I love cooking Italian food.", "Noted!",
                                     "Now let's plan my trip to Lisbon in May.", "Sounds great."])
        + conversation("bob", "c2", [f"My locker code is {CANARY}, please remember it.", "Saved.",
                                     "I switched from running to swimming after my knee injury.", "Good call."],
                       start="2024-03-02T10:00:00Z")
        + [{"user_id": "bob", "conversation_id": "c2", "role": "robot", "text": f"bad row {CANARY}"},
           # a broken line of bob's: it must be attributed to him, or forget cannot find it
           f'{{"user_id": "bob", "conversation_id": "c2", "role": "user", "text": "cut off {CANARY}'.encode()],
    )
    write_jsonl(archive / "b.jsonl", conversation("chen", "c3", ["I started learning piano.", "Nice!"], start="2024-04-01T09:00:00Z"))
    queries = write_jsonl(tmp / "queries.jsonl", [
        {"query_id": "q-bob", "user_id": "bob", "query": f"What exercise should I do this week? ({CANARY})",
         "as_of": "2024-12-01T00:00:00Z"},
    ])
    env = {"QUMEM_DATA_ROOT": str(tmp / "data"), "QUMEM_ARCHIVE": str(archive), "QUMEM_QUERIES": str(queries)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.delenv("QUMEM_WAREHOUSE", raising=False)
        defs = load_defs()
        instance = dg.DagsterInstance.ephemeral()
        result = run_job(defs, instance, ["alice", "bob", "chen"])
        yield {"data_root": tmp / "data", "defs": defs, "instance": instance, "result": result}


def test_definitions_load_and_snapshot(dagster_env, small_archive):
    _, set_archive = dagster_env
    set_archive(small_archive)
    defs = load_defs()
    graph = defs.resolve_asset_graph()
    assert sorted(k.to_user_string() for k in graph.get_all_asset_keys()) == sorted(ALL_ASSETS)
    policies = set()
    for k in ALL_ASSETS:
        node = graph.get(dg.AssetKey(k))
        assert isinstance(node.partitions_def, dg.DynamicPartitionsDefinition) and node.partitions_def.name == "users"
        policies.add(node.backfill_policy.max_partitions_per_run)
    assert len(policies) == 1, "every partitioned asset must share one backfill policy"
    pools = {k: graph.get(dg.AssetKey(k)).pools for k in ALL_ASSETS}
    assert pools["warehouse"] == {"warehouse"}
    assert all(pools[k] == {"gpu"} for k in ("episodes", "memories", "memory_embeddings", "memory_indexes", "query_states",
                                              "persona_profiles"))
    checks = sorted(f"{c.asset_key.to_user_string()}:{c.name}" for c in graph.asset_check_keys)
    assert checks == [
        "episodes:every_turn_in_one_nonempty_episode", "episodes:schema_conforms",
        "memories:evidence_inside_episode", "memories:evidence_turns_exist", "memory_graph:edge_endpoints_exist",
        "persona_profiles:profiles_cite_existing_memories", "query_states:evidence_turns_exist",
        "query_states:no_citation_after_as_of",
        "turns:quarantine_under_ceiling", "turns:schema_conforms",
        "warehouse:personalization_evidence_turns_exist",
    ]
    repo = defs.get_repository_def()
    assert {"main_job", "ingest_job", "forget_user_job", "archive_sync"} <= {j.name for j in repo.get_all_jobs()}
    assert [s.name for s in repo.sensor_defs] == ["user_discovery_sensor"]
    assert {s.name for s in repo.schedule_defs} == {"nightly_incremental_rebuild", "archive_sync_schedule"}


def test_main_job_materializes_every_asset_per_user(pipeline_run):
    result, data_root = pipeline_run["result"], pipeline_run["data_root"]
    assert result.success
    mats = {(m.asset_key.to_user_string(), m.partition) for m in result.get_asset_materialization_events()}
    assert mats == {(a, u) for a in ALL_ASSETS for u in ("alice", "bob", "chen")}
    layout = DataLayout(data_root)
    for table in ("turns", "episodes", "memories", "memory_embeddings", "llm_ledger", "indexes"):
        assert layout.users_in(table) == ["alice", "bob", "chen"], table
        # one Delta table, one commit per run: no per-user files
        assert (data_root / table / "_delta_log").is_dir() and not list((data_root / table).glob("user_id=*"))
        # the first write of a table creates it empty (a forget's epoch can fence it), then its rows
        ops = [h["operation"] for h in layout.store._open(table).history()]
        assert ops == ["WRITE", "CREATE TABLE"], (table, ops)
    for u in ("alice", "bob", "chen"):
        assert set(layout.read_user_table("indexes", u)["type"]) == {"fact", "preference", "insight"}
    checks = {e.asset_check_key.name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks and all(checks.values()), checks


def test_every_row_carries_versions_and_episodes_cover_turns(pipeline_run):
    data_root = pipeline_run["data_root"]
    layout = DataLayout(data_root)
    eps = layout.read_user_table("episodes", "alice")
    assert eps["classifier_version"].str.starts_with("continuity-").all()
    assert sorted(t for ids in eps["turn_ids"].to_list() for t in ids) == [0, 1, 2, 3]
    mems = layout.read_user_table("memories", "bob")
    ledger = layout.read_user_table("llm_ledger", "bob")
    assert ledger.height >= 3 and set(ledger["type"]) == {"fact", "preference", "insight"}
    assert (ledger["prompt_tokens"] > 0).all() and ledger["model"].is_not_null().all()
    assert mems.height >= 1, "SmolLM2 (temperature 0) finds memories in bob's episode; none means the stage broke"
    assert mems["prompt_version"].str.starts_with("decompose-").all() and mems["model"].is_not_null().all()
    bob_eps = layout.read_user_table("episodes", "bob")
    allowed = {t for ids in bob_eps["turn_ids"].to_list() for t in ids}
    assert all(set(ev) <= allowed for ev in mems["evidence_turn_ids"].to_list())


# Table -> the stage (asset) whose code writes it. The *_checkpoints tables are the LLM call caches, keyed by content.
TABLE_STAGE = {"turns": "turns", "quarantine": "turns", "fingerprints": "turns", "episodes": "episodes",
               "memories": "memories", "memory_quarantine": "memories", "llm_ledger": "memories",
               "persona_llm_ledger": "persona_profiles", "query_llm_ledger": "query_states",
               "memory_embeddings": "memory_embeddings", "index_ids": "memory_indexes",
               "persona_profiles": "persona_profiles", "memory_graph_nodes": "memory_graph",
               "memory_graph_edges": "memory_graph", "query_states": "query_states", "query_quarantine": "query_states",
               "indexes": "memory_indexes"}
# the query stage's LLM ledger stages of each strategy (this module runs the embedded model's default)
QUERY_STAGES = {"qumem": {"a1", "a2", "a3"}, "qumem_hybrid": {"a1", "a2", "a3"}, "adamem": {"research", "qa"}}

# Operational tables of the store, not stage output: the forgotten-user registry and ingest's bookkeeping.
NOT_STAGE_TABLES = {"forgotten_users", "warehouse_locations", "ingest_manifest", "ingest_file_users", "turn_duplicates"}


def test_every_table_carries_its_stage_code_version(pipeline_run):
    """Each row names the code that made it: the stage's code version, the same string as the asset's."""
    data_root, result = pipeline_run["data_root"], pipeline_run["result"]
    asset_versions = {k.to_user_string(): v for a in pipeline_run["defs"].resolve_asset_graph().assets_defs
                      for k, v in a.code_versions_by_key.items()}
    layout = DataLayout(data_root)
    written = set(layout.tables()) - {"memory_checkpoints", "persona_checkpoints", "query_checkpoints", *NOT_STAGE_TABLES}
    # sparse tables: no quarantined row, no persona merge (no near-duplicate memories) writes nothing
    assert set(TABLE_STAGE) - {"memory_quarantine", "query_quarantine", "persona_llm_ledger"} <= written, written
    assert written <= set(TABLE_STAGE), written - set(TABLE_STAGE)
    for table in sorted(written):
        df = layout.read_table(table).select("code_version")
        assert df.height > 0 and set(df["code_version"]) == {asset_versions[TABLE_STAGE[table]]}, table
    for m in result.get_asset_materialization_events():
        md = m.step_materialization_data.materialization.metadata
        assert md["code_version"].value == asset_versions[m.asset_key.to_user_string()]
        assert md["git_commit"].value  # the checkout's commit, or "unknown" outside one
    with duckdb.connect(str(data_root / "warehouse.duckdb"), read_only=True) as con:
        for table in ("turns", "episodes", "memories", "llm_ledger", "persona_profiles", "query_states"):
            # the warehouse's llm_ledger holds every LLM stage's ledger: decomposition's rows are the memories'
            where = " WHERE stage = 'decompose'" if table == "llm_ledger" else ""
            got = {r[0] for r in con.execute(f'SELECT DISTINCT code_version FROM "{table}"{where}').fetchall()}
            assert got == {asset_versions[TABLE_STAGE[table]]}, table
        # each stage's rows carry the code version of the asset that paid for them
        writer = {"decompose": "memories", "persona_merge": "persona_profiles"}
        by_stage = con.execute("SELECT stage, list(DISTINCT code_version) FROM llm_ledger GROUP BY stage").fetchall()
        assert {"decompose", *QUERY_STAGES[default_strategy("local")]} <= {s for s, _ in by_stage}, by_stage
        for stage, versions in by_stage:
            assert versions == [asset_versions[writer.get(stage, "query_states")]], stage


def test_warehouse_holds_every_stage(pipeline_run):
    with duckdb.connect(str(pipeline_run["data_root"] / "warehouse.duckdb"), read_only=True) as con:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        assert {"turns", "quarantine", "episodes", "memories", "llm_ledger"} <= tables
        assert con.execute("SELECT user_id, count(*) FROM turns GROUP BY 1 ORDER BY 1").fetchall() == [
            ("alice", 4), ("bob", 4), ("chen", 2)]
        assert con.execute("SELECT field FROM quarantine WHERE user_id = 'bob' ORDER BY 1").fetchall() == [("(line)",), ("role",)]
        assert con.execute("SELECT count(*) FROM quarantine WHERE user_id IS NULL").fetchone()[0] == 0
        # citations of query states resolve to the same user's memories, turns (`turn:N`: AdaMem's session
        # turns) or persona profiles (`profile:ID`)
        assert "query_states" in tables
        assert con.execute("SELECT user_id, query_id FROM query_states").fetchall() == [("bob", "q-bob")]
        cited = con.execute("SELECT count(*) FROM (SELECT unnest(cited_memory_ids) FROM query_states)").fetchone()[0]
        bad = con.execute("""
            WITH c AS (SELECT user_id, unnest(cited_memory_ids) AS mid FROM query_states)
            SELECT count(*) FROM c WHERE NOT (
                EXISTS (SELECT 1 FROM memories m WHERE m.memory_id = c.mid AND m.user_id = c.user_id)
                OR (c.mid LIKE 'turn:%' AND EXISTS (SELECT 1 FROM turns t WHERE t.user_id = c.user_id
                                                    AND t.turn_index = TRY_CAST(substr(c.mid, 6) AS BIGINT)))
                OR (c.mid LIKE 'profile:%' AND EXISTS (SELECT 1 FROM persona_profiles p WHERE p.user_id = c.user_id
                                                       AND p.profile_id = substr(c.mid, 9))))
        """).fetchone()[0]
        assert cited > 0 and bad == 0, (cited, bad)


def test_no_output_of_one_user_references_another(pipeline_run):
    """Isolation on the real embedded path (SmolLM2 memories, MiniLM embeddings, FAISS, query states)."""
    root = pipeline_run["data_root"]
    users = ("alice", "bob", "chen")
    from qumem_pipeline.index.embeddings import model_version
    from qumem_pipeline.index.memory_keys import SOURCE_WEIGHT, keyed_version

    read = DataLayout(root).read_user_table
    mem_ids = {}
    for u in users:
        turn_ids = set(read("turns", u)["turn_index"])
        mems = read("memories", u)
        assert mems is not None, u  # every user of the run gets a memories file (empty when nothing was found)
        mem_ids[u] = set(mems["memory_id"])
        assert set(mems["user_id"]) <= {u}
        assert all(set(ev) <= turn_ids for ev in mems["evidence_turn_ids"].to_list())
        emb = read("memory_embeddings", u)
        assert emb is not None and set(emb["memory_id"]) == mem_ids[u], u  # every memory embedded, nothing else
        # keyed by text and source turns (index.memory_keys), and saying so
        assert emb.height == 0 or set(emb["embedding_model"]) == {keyed_version(model_version(), SOURCE_WEIGHT)}, u
        ids = read("index_ids", u)
        assert ids is not None and set(ids["memory_id"]) == mem_ids[u], u
        qs = read("query_states", u)
        if u != "bob":  # only bob has a query
            assert qs is None, u
            continue
        assert qs is not None and qs["query_id"].to_list() == ["q-bob"]
        row = qs.row(0, named=True)
        assert row["candidates"], "bob has memories, so retrieval must return candidates"
        profiles = read("persona_profiles", u)
        own = mem_ids[u] | {f"turn:{i}" for i in turn_ids} | (
            set() if profiles is None else {f"profile:{p}" for p in profiles["profile_id"]})
        assert {c["memory_id"] for c in row["candidates"]} <= own
        assert set(row["cited_memory_ids"]) <= own and set(row["cited_turn_ids"]) <= turn_ids
    assert sum(map(len, mem_ids.values())) > 0, "the real model produced no memories: isolation proven on nothing"
    assert not (mem_ids["alice"] & mem_ids["bob"] or mem_ids["alice"] & mem_ids["chen"] or mem_ids["bob"] & mem_ids["chen"])


def test_rerun_converges(pipeline_run):
    """A second run over the same users rewrites the same rows (ids stable, no duplicates)."""
    data_root, defs, instance = pipeline_run["data_root"], pipeline_run["defs"], pipeline_run["instance"]
    layout = DataLayout(data_root)
    ids = lambda table, col: layout.read_user_table(table, "alice")[col].to_list()  # noqa: E731
    eps_before, mems_before = ids("episodes", "episode_id"), ids("memories", "memory_id")
    assert eps_before and mems_before, "alice needs episodes and memories, or stable ids are proven on nothing"
    # the main job again (episodes, memories and the rest rebuilt; the LLM calls come from its checkpoints)
    result = run_job(defs, instance, ["alice"])
    assert result.success
    assert {m.asset_key.to_user_string() for m in result.get_asset_materialization_events()} == set(ALL_ASSETS)
    eps_after, mems_after = ids("episodes", "episode_id"), ids("memories", "memory_id")
    assert sorted(eps_after) == sorted(eps_before) and len(set(eps_after)) == len(eps_after)
    assert sorted(mems_after) == sorted(mems_before) and len(set(mems_after)) == len(mems_after)
    assert sorted(ids("memory_embeddings", "memory_id")) == sorted(mems_before)
    assert layout.read_user_table("turns", "alice").height == 4
    assert layout.read_table("turns")["user_id"].value_counts().sort("user_id").rows() == [("alice", 4), ("bob", 4), ("chen", 2)]
    with duckdb.connect(str(data_root / "warehouse.duckdb"), read_only=True) as con:
        count = lambda t: con.execute(f"SELECT count(*) FROM {t} WHERE user_id='alice'").fetchone()[0]  # noqa: E731
        assert (count("turns"), count("episodes"), count("memories")) == (4, len(eps_before), len(mems_before))


def test_forget_rejects_malicious_id(dagster_env, small_archive):
    _, set_archive = dagster_env
    set_archive(small_archive)
    defs = load_defs()
    with pytest.raises(Exception, match="invalid user id"):
        defs.resolve_job_def("forget_user_job").execute_in_process(
            instance=dg.DagsterInstance.ephemeral(),
            run_config={"ops": {"forget_user_op": {"config": {"user_id": "../x"}}}},
        )


def test_forget_removes_canary_everywhere_and_keeps_others(pipeline_run):
    """Runs last: erases bob from the shared run and proves no byte of his canary survives."""
    data_root, defs, instance = pipeline_run["data_root"], pipeline_run["defs"], pipeline_run["instance"]
    hits = files_containing(data_root, CANARY)
    assert hits, "the canary must be somewhere before forgetting, or the test proves nothing"
    hit_dirs = {p.relative_to(data_root).parts[0] for p in hits}
    assert {"warehouse.duckdb", "turns", "quarantine"} <= hit_dirs, hit_dirs
    layout = DataLayout(data_root)
    # every per-user artifact of bob exists before forgetting, so their absence afterwards means something
    for table in ("turns", "quarantine", "fingerprints", "episodes", "memories", "llm_ledger", "memory_embeddings", "index_ids"):
        assert layout.read_user_table(table, "bob") is not None, table
    assert sorted(layout.read_user_table("indexes", "bob")["type"]) == ["fact", "insight", "preference"]
    unattributed = layout.read_user_table("quarantine", "__unattributed__")
    assert unattributed is None or not any(CANARY in str(v) for v in unattributed.rows()), \
        "bob's broken line must be attributed to bob"
    # user text never enters Dagster's event log (materialization metadata, check results, log lines)
    assert event_log_hits(instance, CANARY) == []
    assert event_log_hits(instance, "locker code") == []
    alice_before = {t: layout.read_user_table(t, "alice") for t in ("turns", "episodes", "memories")}

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUMEM_DATA_ROOT", str(data_root))
        r = defs.resolve_job_def("forget_user_job").execute_in_process(
            instance=instance, run_config={"ops": {"forget_user_op": {"config": {"user_id": "bob"}}}}
        )
    assert r.success
    assert files_containing(data_root, CANARY) == []
    # the user id itself is gone from every object too (data files and the transaction logs)
    assert [p for p in files_containing(data_root, "bob") if p.suffix != ".duckdb"] == []
    layout = DataLayout(data_root)
    assert all("bob" not in layout.users_in(t) for t in layout.tables())
    assert not instance.has_dynamic_partition("users", "bob")
    for t, df in alice_before.items():
        assert layout.read_user_table(t, "alice").equals(df), t
    with duckdb.connect(str(data_root / "warehouse.duckdb"), read_only=True) as con:
        assert con.execute("SELECT DISTINCT user_id FROM turns ORDER BY 1").fetchall() == [("alice",), ("chen",)]
    # Rediscovery from the (unchanged) archive does not bring bob back: the archive sync run (the ticks
    # only plan), then the sensor's tick over what it wrote.
    from tests.ticks import run_archive_sync

    run_archive_sync(instance, defs.resources["pipeline"])
    sensor_res = defs.resolve_sensor_def("user_discovery_sensor")(
        dg.build_sensor_context(instance=instance, resources={"pipeline": defs.resources["pipeline"]})
    )
    assert "bob" not in [r.partition_key for r in sensor_res.run_requests]
    assert run_job(defs, instance, ["alice"], job="ingest_job").success
    assert files_containing(data_root, CANARY) == []
    assert event_log_hits(instance, CANARY) == []
