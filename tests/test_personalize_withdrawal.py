"""Withdrawal reaches the bulk personalization outputs, and one batch is answered once however many
runs of it start together (issue 51, item 3). Real Delta tables, a real DuckDB warehouse, the real
embedder and FAISS indexes, the fake OpenAI-shaped server (a real local HTTP process)."""

import threading

import duckdb
import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.query.personalize import (CHECKPOINTS, LEDGER, QUARANTINE, STATES, evidence_outcome,
                                              export_batch, purge_withdrawn)
from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.warehouse import Warehouse
from tests.conftest import write_jsonl
from tests.test_personalize import U, build_user_tables, personalize, queries, rows, script

BOB = "bob"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("built") / "data"
    build_user_tables(root, users=(U, BOB))
    return root


@pytest.fixture
def root(built, tmp_path):
    import shutil

    shutil.copytree(built, tmp_path / "data")
    return tmp_path / "data"


def _wh_rows(wh: Warehouse, table: str, user: str) -> int:
    with duckdb.connect(str(wh.path), read_only=True) as con:
        return con.execute(f'SELECT count(*) FROM "{table}" WHERE user_id = ?', [user]).fetchone()[0]


def test_a_withdrawn_turn_takes_the_rows_citing_it_out_of_every_personalization_output(root, tmp_path):
    layout, wh = DataLayout(root), Warehouse(tmp_path / "wh.duckdb")
    src = write_jsonl(tmp_path / "q.jsonl", queries(3) + [{**q, "query_id": f"b{i}"} for i, q in enumerate(queries(2, user=BOB))])
    with RunningFakeServer(script(), tmp_path / "srv") as srv:
        personalize(layout, src, srv, batch_id="nightly", warehouse=wh)
    states = rows(layout, STATES)
    assert sorted(states["query_id"]) == ["b0", "b1", "q0", "q1", "q2"]
    cited = sorted({t for ts in states.filter(pl.col("user_id") == U)["cited_turn_ids"].to_list() for t in ts})
    assert cited, "the fake A3 state cites a memory: the rows cite turns"
    assert evidence_outcome(layout, [U, BOB]).passed
    assert purge_withdrawn(layout, [U, BOB], wh) == {}  # nothing withdrawn: nothing purged

    # U's source loses the cited turns (a rewritten file); BOB's every file is withdrawn (present, empty)
    turns = layout.read_table("turns", [U])
    layout.replace_users("turns", [U, BOB], turns.filter(~pl.col("turn_index").is_in(cited)))
    out = evidence_outcome(layout, [U, BOB])
    assert not out.passed and out.metadata["violations"] == 5 and out.metadata["rows_of_users_without_turns"] == 2
    purged = purge_withdrawn(layout, [U, BOB], wh)
    assert purged[STATES] == 5 and purged[LEDGER] > 0 and purged[CHECKPOINTS] > 0
    assert evidence_outcome(layout, [U, BOB]).passed
    assert layout.store.exists(STATES) and rows(layout, STATES).height == 0
    for table in (STATES, QUARANTINE, LEDGER, CHECKPOINTS):
        if layout.store.exists(table):
            left = rows(layout, table, sort="user_id" if table != QUARANTINE else "owner_id")
            assert BOB not in set(left["user_id" if table != QUARANTINE else "owner_id"]), table
    assert _wh_rows(wh, STATES, U) == 0 and _wh_rows(wh, STATES, BOB) == 0
    assert _wh_rows(wh, LEDGER, BOB) == 0
    # a re-export of the batch brings nothing back; a rerun of the batch answers U's queries from what is left
    export_batch(layout, wh, "nightly")
    assert _wh_rows(wh, STATES, U) == 0


def test_the_warehouse_step_purges_and_checks_the_bulk_outputs(root, tmp_path, monkeypatch):
    """The main job's `warehouse` asset runs the purge and its check for the run's users."""
    import dagster as dg

    from resources import PipelineConfig

    layout, wh_path = DataLayout(root), tmp_path / "wh.duckdb"
    src = write_jsonl(tmp_path / "q.jsonl", queries(2))
    with RunningFakeServer(script(), tmp_path / "srv") as srv:
        personalize(layout, src, srv, batch_id="b1", warehouse=Warehouse(wh_path))
    layout.replace_users("turns", [U], pl.DataFrame(schema=layout.read_table("turns", [U]).schema))  # withdrawn
    from assets.warehouse import warehouse

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("users", [U])
        result = dg.materialize([warehouse], partition_key=U, instance=instance,
                                resources={"pipeline": PipelineConfig(data_root=str(root), warehouse_path=str(wh_path),
                                                                        archive_path=str(tmp_path / "archive"))})
    assert result.success
    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "personalization_evidence_turns_exist" and check.passed
    mat = result.get_asset_materialization_events()[0].materialization.metadata
    assert mat["personalization_rows_purged"].value[STATES] == 2
    assert rows(layout, STATES).height == 0 and _wh_rows(Warehouse(wh_path), STATES, U) == 0


def test_two_runs_of_one_batch_at_once_write_each_query_once(root, tmp_path):
    src = write_jsonl(tmp_path / "q.jsonl", queries(6))
    reports, errors = [], []
    with RunningFakeServer(script(), tmp_path / "srv") as srv:
        start = threading.Barrier(2)

        def run():
            try:
                start.wait()
                reports.append(personalize(DataLayout(root), src, srv, batch_id="same", chunk_rows=2))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        sent = len(srv.requests())
    assert not errors, errors
    states = rows(DataLayout(root), STATES)
    assert states.height == 6 and states.select(pl.struct("batch_id", "query_id").is_unique().all()).item()
    # one run answered everything; the other waited for the batch's lease and found it done
    assert sorted((r.answered, r.already_done) for r in reports) == [(0, 6), (6, 0)]
    assert sent == sum(r.llm_calls_sent for r in reports) == 6 * 3
    ledger = rows(DataLayout(root), LEDGER, "request_id")
    assert ledger.select(pl.struct("request_id", "attempt").is_unique().all()).item()
