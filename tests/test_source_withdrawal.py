"""A withdrawn source file reaches every table (issue 27, item 5).

Two users in two archive files go through the whole main job (real continuity classifier and
embedder on CPU, FAISS, Delta tables, DuckDB; the LLM is the fake OpenAI-shaped server, a real
local HTTP process). Then bob's file is removed: the discovery sensor and the nightly schedule
(real evaluations on a SQLite instance) request a run for bob alone, and that run leaves bob
present and empty in every table and without rows in the warehouse, alice untouched. The blocking
`evidence_turns_exist` check is unit-tested on its function.
"""

import importlib
from datetime import datetime, timezone

import dagster as dg
import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.contracts.checks import evidence_turns_exist
from qumem_pipeline.ingest.archive import EMPTY_FINGERPRINT
from qumem_pipeline.ingest.incremental import plan_rebuild, recorded_form
from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.warehouse import Warehouse
from tests.conftest import conversation, local_instance, write_jsonl

RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
TICK = datetime(2026, 12, 1, 2, 0, tzinfo=timezone.utc)
# every per-user table a main_job run writes, after `turns`
DOWNSTREAM = ["episodes", "memories", "llm_ledger", "memory_embeddings", "index_ids", "indexes", "persona_profiles",
              "memory_graph_nodes", "memory_graph_edges", "query_states"]
SPARSE = ["memory_quarantine", "query_quarantine", "quarantine", "memory_checkpoints"]
SCRIPT = {
    "model": "fake-withdrawal",
    "rules": [
        {"match": "information-need agent", "responses": [{"json": {"needs": [{"need": "hobbies", "why": "plan"}]}}]},
        {"match": "retrieval-planning agent",
         "responses": [{"json": {"queries": [{"query": "what the user likes", "stores": ["fact", "preference", "insight"]}]}}]},
        {"match": "user-state inference agent", "responses": [{"json": {
            "facts": [{"statement": "has a hobby", "memory_ids": ["M1"]}], "preference_trajectory": [], "insights": []}}]},
        {"match": "Answer the user's query", "responses": [{"json": {"answer": "Enjoy it."}}]},
    ],
    "default": [{"echo_memory": True}],  # decomposition: one memory citing the episode's first user turn
}


# --- the check, on its own -----------------------------------------------------------------------

def test_evidence_turns_exist_fails_when_a_cited_turn_is_gone():
    mems = pl.DataFrame({"memory_id": ["m1", "m2", "m3"], "user_id": ["a", "a", "b"],
                         "evidence_turn_ids": [[0, 1], [2], [0]]}, schema_overrides={"evidence_turn_ids": pl.List(pl.Int64)})
    turns = pl.DataFrame({"user_id": ["a", "a", "a", "b"], "turn_index": [0, 1, 2, 0]})
    assert evidence_turns_exist(mems, turns).passed
    assert evidence_turns_exist(mems.clear(), turns.clear()).passed
    # a's turn 2 is gone (a withdrawn file), and all of b's turns: m2 and m3 cite turns that no longer exist
    out = evidence_turns_exist(mems, turns.filter((pl.col("turn_index") < 2) & (pl.col("user_id") == "a")))
    assert not out.passed
    assert out.metadata["violations"] == 2 and out.metadata["missing_turns"] == 2
    # the same turn index of another user does not count
    out = evidence_turns_exist(mems, pl.DataFrame({"user_id": ["b", "b", "b"], "turn_index": [0, 1, 2]}))
    assert not out.passed and out.metadata["violations"] == 2


def test_plan_rebuild_empties_users_that_left_the_archive_once():
    fp = "f" * 64
    recorded = {"a": recorded_form(fp), "gone": recorded_form("9" * 64), "emptied": recorded_form(EMPTY_FINGERPRINT),
                "emptied_unfinished": recorded_form(EMPTY_FINGERPRINT)}
    plan = plan_rebuild({"a": fp}, ["a", "gone", "emptied", "emptied_unfinished", "never"], recorded,
                        incomplete={"emptied_unfinished"})
    assert plan.removed == ["emptied_unfinished", "gone", "never"]
    assert plan.unchanged == ["a", "emptied"]
    assert plan.to_rebuild == {"emptied_unfinished", "gone", "never"}


def test_forgotten_users_are_not_taken_for_users_that_left():
    from assets.planning import live_users

    class Forgotten:
        def __init__(self, users):
            self.users = set(users)

        def __len__(self):
            return len(self.users)

        def contains(self, u):
            return u in self.users

    assert live_users(["a", "b", "c"], Forgotten({"b"})) == ["a", "c"]
    assert live_users(["a", "b"], Forgotten(set())) == ["a", "b"]
    assert plan_rebuild({"a": "f" * 64}, live_users(["a", "b"], Forgotten({"b"})), {}).removed == []


# --- the whole pipeline --------------------------------------------------------------------------

def _rows(layout: DataLayout, table: str, user: str) -> pl.DataFrame | None:
    return layout.read_user_table(table, user)


def _warehouse_rows(path, user: str) -> dict[str, int]:
    import duckdb

    out = {}
    with duckdb.connect(str(path), read_only=True) as con:
        for (t,) in con.execute("SELECT table_name FROM information_schema.tables WHERE table_schema='main'").fetchall():
            cols = {r[0] for r in con.execute(f'DESCRIBE "{t}"').fetchall()}
            if "user_id" in cols:
                out[t] = con.execute(f'SELECT count(*) FROM "{t}" WHERE user_id = ?', [user]).fetchone()[0]
    return out


def _snapshot(layout: DataLayout, user: str) -> dict:
    """Every row of the user in every table, as plain values (equal only if nothing was rewritten)."""
    return {t: (df.rows() if (df := _rows(layout, t, user)) is not None else None) for t in ["turns"] + DOWNSTREAM + SPARSE}


@pytest.mark.timeout(600)  # two archive_sync runs besides the pipeline's: the ticks only plan
def test_withdrawn_file_empties_the_user_everywhere_on_the_next_nightly(tmp_path):
    archive = tmp_path / "archive"
    write_jsonl(archive / "alice.jsonl", conversation("alice", "c1", [
        "I started learning the piano last month.", "Nice!", "Scales are hard but I practise daily.", "Keep going."]))
    write_jsonl(archive / "bob.jsonl", conversation("bob", "c2", [
        "I swim every morning before work.", "Lovely.", "I prefer cold lakes to pools.", "Brave!"],
        start="2024-03-02T10:00:00Z"))
    queries = write_jsonl(tmp_path / "queries.jsonl", [
        {"query_id": f"q-{u}", "user_id": u, "query": "What should I do this weekend?", "as_of": "2024-12-01T00:00:00Z"}
        for u in ("alice", "bob")])
    root = tmp_path / "data"
    with RunningFakeServer(SCRIPT, tmp_path / "llm") as srv, pytest.MonkeyPatch.context() as mp, \
            local_instance(tmp_path / "home") as instance:
        for k, v in {"QUMEM_DATA_ROOT": root, "QUMEM_ARCHIVE": archive, "QUMEM_QUERIES": queries, "QUMEM_DEVICE": "cpu",
                     "QUMEM_LLM_KIND": "openai", "QUMEM_LLM_BASE_URL": srv.base_url,
                     "QUMEM_QUERY_STRATEGY": "qumem"}.items():  # SCRIPT answers QUMem's three agents
            mp.setenv(k, str(v))
        mp.delenv("QUMEM_WAREHOUSE", raising=False)
        import assets.definitions as d

        importlib.reload(d)
        defs = d.build_definitions()
        repo = defs.get_repository_def()
        schedule = defs.get_schedule_def("nightly_incremental_rebuild")
        pipeline = defs.resources["pipeline"]
        job = defs.resolve_job_def("main_job")

        def nightly():
            with dg.build_schedule_context(instance=instance, scheduled_execution_time=TICK,
                                           resources={"pipeline": pipeline}, repository_def=repo) as ctx:
                return schedule.evaluate_tick(ctx)

        def run(request):
            result = job.execute_in_process(instance=instance, tags=dict(request.tags))
            assert result.success
            return result

        from tests.ticks import rebuild_requests, run_archive_sync, sync_requests

        run_archive_sync(instance, pipeline)  # the ticks only plan: the archive sync is its own run
        first = nightly()
        assert [(r.tags[RANGE_START], r.tags[RANGE_END]) for r in first.run_requests] == [("alice", "bob")]
        run(first.run_requests[0])
        layout, wh = DataLayout(root), Warehouse(root / "warehouse.duckdb")
        for u in ("alice", "bob"):
            for t in ("turns", "episodes", "memories", "memory_embeddings", "index_ids", "memory_graph_nodes", "query_states"):
                assert (df := _rows(layout, t, u)) is not None and df.height, (t, u)
            assert _warehouse_rows(wh.path, u)["memories"] > 0
        alice_before, alice_wh_before = _snapshot(layout, "alice"), _warehouse_rows(wh.path, "alice")

        # The operator withdraws bob's source file. The discovery sensor would request bob alone too.
        (archive / "bob.jsonl").unlink()
        # The discovery sensor's tick reads no archive file: it requests the sync run first, and once
        # that run removed bob's rows, it requests bob alone too.
        sensor = defs.get_sensor_def("user_discovery_sensor")
        sensed = sensor(dg.build_sensor_context(instance=instance, resources={"pipeline": pipeline}))
        [sync] = sync_requests(sensed)
        assert rebuild_requests(sensed) == []
        run_archive_sync(instance, pipeline, sync)
        sensed = sensor(dg.build_sensor_context(instance=instance, resources={"pipeline": pipeline}))
        assert [r.partition_key for r in sensed.run_requests] == ["bob"]

        second = nightly()
        assert [r.partition_key for r in second.run_requests] == ["bob"]
        result = run(second.run_requests[0])
        assert {m.asset_key.to_user_string() for m in result.get_asset_materialization_events()} >= {
            "turns", "warehouse", *("episodes", "memories", "memory_embeddings", "memory_indexes", "persona_profiles",
                                    "memory_graph", "query_states")}
        assert {m.partition for m in result.get_asset_materialization_events()} == {"bob"}
        checks = {(e.asset_key.to_user_string(), e.asset_check_key.name): e.passed for e in result.get_asset_check_evaluations()}
        assert checks[("memories", "evidence_turns_exist")] and checks[("query_states", "evidence_turns_exist")]

        layout = DataLayout(root)
        for t in ["turns"] + DOWNSTREAM:  # written, empty: "nothing here", not "never materialized"
            df = _rows(layout, t, "bob")
            if t == "indexes":  # one empty FAISS index per type at most
                assert df is None or set(df["ntotal"].to_list()) <= {0}, t
                continue
            assert df is None or df.height == 0, (t, df)
        for t in ("turns", "episodes", "memories", "memory_embeddings", "persona_profiles", "memory_graph_nodes"):
            assert "bob" in layout.users_present(t, ["bob"]), t
        for t in SPARSE:
            df = _rows(layout, t, "bob")
            assert df is None or df.height == 0, (t, df)
        # the warehouse: no rows of bob's but his fingerprint record, which says he has no turns left
        left = _warehouse_rows(wh.path, "bob")
        assert left.pop("fingerprints") == 1 and left and all(n == 0 for n in left.values()), left
        with wh.connect(read_only=True) as con:
            assert con.execute("SELECT fingerprint, n_turns, n_quarantined FROM fingerprints WHERE user_id = 'bob'"
                               ).fetchall() == [(EMPTY_FINGERPRINT, 0, 0)]

        # alice: not rebuilt, not changed
        assert _snapshot(layout, "alice") == alice_before
        assert _warehouse_rows(wh.path, "alice") == alice_wh_before

        # bob is now recorded as emptied: the next night has nothing to do
        third = nightly()
        assert third.run_requests == [] and "2 users unchanged" in third.skip_message

        # A memory set whose evidence is gone is not used: alice's stored memories made to cite a turn
        # she no longer has block her query states (the check fails, the previous states stay).
        mems = layout.read_user_table("memories", "alice")
        layout.replace_users("memories", ["alice"], mems.with_columns(evidence_turn_ids=pl.lit([0, 99], pl.List(pl.Int64))))
        blocked = job.execute_in_process(instance=instance, partition_key="alice", raise_on_error=False,
                                         asset_selection=[dg.AssetKey("query_states")])
        assert not blocked.success
        [ev] = [e for e in blocked.get_asset_check_evaluations() if e.asset_check_key.name == "evidence_turns_exist"]
        assert not ev.passed and ev.metadata["violations"].value == mems.height
        assert _rows(layout, "query_states", "alice").rows() == alice_before["query_states"]
