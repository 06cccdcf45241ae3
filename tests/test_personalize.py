"""Bulk personalization as a job of its own (issue 30, item 5): `qumem personalize --queries PATH_OR_URI
[--batch-id ID]` and `personalize_job` with run config. A batch (JSONL, Parquet or a Delta table, local
or s3://) is validated like the archive (bad rows quarantined with row, field and reason), answered for
its users from the current memories, written keyed by (batch_id, query_id) and exported to the
warehouse; a rerun pays for no finished call; the batch is streamed in chunks.

Real parts: `qumem run` then `qumem personalize` as child processes, Dagster runs, Delta tables, the
fake OpenAI-compatible server (a real local HTTP server that logs every request) and moto's S3 server.
The other tests build a user's tables directly (turns + memories through the layout, embeddings and
FAISS indexes through the product's index code) so they run in seconds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import duckdb
import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.query.strategies.registry import DEFAULT_STRATEGY
from qumem_pipeline.storage.layout import DataLayout
from tests import adamem_data as data
from tests.conftest import REPO_ROOT, conversation, write_jsonl

U = data.USER
A3_STATE = {"facts": [{"statement": "Caroline met the adoption agency.", "memory_ids": ["M1"]}],
            "preference_trajectory": [], "insights": []}
RULES = [
    {"match": "information-need agent", "responses": [{"json": {"needs": [{"need": "adoption", "why": "asked"}]}}]},
    {"match": "retrieval-planning agent", "responses": [{"json": {"queries": [{"query": "adoption", "stores": ["fact"]}]}}]},
    {"match": "user-state inference agent", "responses": [{"json": A3_STATE}]},
    {"match": "persona profile", "responses": [{"json": {"aspect": "sport", "summary": "Swims."}}]},
    # AdaMem's (the product default's) research round and working answer
    {"match": "research agent", "responses": [{"json": {"facts": [{"statement": "Swims now.", "memory_ids": ["M1"]}],
                                                        "preference_trajectory": [], "insights": [], "sufficient": True,
                                                        "follow_up": ""}}]},
    {"match": "working agent", "responses": [{"json": {"answer": "Swim three mornings a week."}}]},
]
SCRIPT = {"model": "fake-model", "rules": RULES, "default": [{"echo_memory": True}]}


def script(a3_then_down: int | None = None) -> dict:
    """`a3_then_down`: the A3 rule answers that many requests, then 401 (the endpoint gone)."""
    rules = [dict(r) for r in RULES]
    if a3_then_down is not None:
        rules[2]["responses"] = rules[2]["responses"] * a3_then_down + [{"status": 401}]
    return {**SCRIPT, "rules": rules}


def build_user_tables(root, users=(U,)) -> DataLayout:
    """The tables the main job builds for `users` (the AdaMem fixture's history, renamed per user)."""
    from qumem_pipeline.index import vector_store
    from qumem_pipeline.index.embeddings import embed_memories
    from resources.models import _embedder

    layout = DataLayout(root)
    turns = pl.concat([data.turns().with_columns(user_id=pl.lit(u)) for u in users])
    mems = pl.concat([data.memories().with_columns(user_id=pl.lit(u), memory_id=pl.lit(f"{u}:") + pl.col("memory_id"))
                      for u in users])
    layout.replace_users("turns", users, turns)
    layout.replace_users("memories", users, mems)
    emb = embed_memories(mems, _embedder("cpu"))
    layout.replace_users("memory_embeddings", users, emb)
    vector_store.write_users_indexes(layout, [vector_store.build_user_indexes(emb.filter(pl.col("user_id") == u), u)
                                              for u in users])
    return layout


def queries(n=4, user=U, **extra):
    return [{"query_id": f"q{i}", "user_id": user, "query": f"What about adoption, part {i}?", "as_of_turn": 11, **extra}
            for i in range(n)]


def personalize(layout, source, srv, **kw):
    from qumem_pipeline.query.personalize import personalize_batch
    from resources.models import LLMResource, _embedder

    backend = LLMResource(kind="openai", base_url=srv.base_url, model="fake-model")._build()
    try:
        # qumem: the tables here are built without the memory graph AdaMem needs, and RULES script QUMem's agents
        return personalize_batch(layout, str(source), backend, _embedder("cpu"), **{"strategy": "qumem", **kw})
    finally:
        getattr(backend, "close", lambda: None)()


def rows(layout, table, sort="query_id") -> pl.DataFrame:
    df = layout.store.read(table)
    return df.filter(~pl.col("user_placeholder")).drop("user_key", "user_bucket", "user_placeholder").sort(sort)


# -- the CLI on an archive the main job built -------------------------------------------------------------------
def _qumem(work: Path, srv, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUMEM_")}
    env.update({"PYTHONPATH": str(REPO_ROOT), "DAGSTER_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "QUMEM_LLM_KIND": "openai", "QUMEM_LLM_BASE_URL": srv.base_url,
                "QUMEM_LLM_MODEL": "fake-model", "QUMEM_DEVICE": "cpu"})
    return subprocess.run([sys.executable, "-m", "qumem_pipeline.cli", *args, "--data-root", str(work / "data")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)


def test_cli_personalize_after_the_main_job(tmp_path):
    from tests.crash_harness import run_pipeline

    work = tmp_path
    rows_ = []
    for i, u in enumerate(("ana", "ben")):
        rows_ += conversation(u, f"{u}-c1", [f"I ran marathons for years ({u}).", "Impressive.",
                                            f"My knee forced me to switch to swimming ({u}).", "Good call."],
                              start=f"2024-03-0{i + 1}T10:00:00Z")
    write_jsonl(work / "archive" / "archive.jsonl", rows_)
    write_jsonl(work / "archive" / "queries.jsonl", [])  # the main job's own queries: none
    batch = write_jsonl(work / "batch.jsonl", [
        {"query_id": "b1", "user_id": "ana", "query": "Plan my workouts.", "as_of": "2024-12-01T00:00:00Z"},
        {"query_id": "b2", "user_id": "ben", "query": "Plan my workouts."},
        {"query_id": "b3", "user_id": "ben", "query": "Plan my week.", "as_of": "not a time"},  # bad row: as_of
        {"query_id": "b4", "user_id": "zoe", "query": "Who am I?"},  # a user with no history
    ])
    with RunningFakeServer(SCRIPT, work / "srv") as srv:
        r = run_pipeline(work, srv.base_url, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        before = len(srv.requests())
        r = _qumem(work, srv, "personalize", "--queries", str(batch), "--json")
        assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
        report = json.loads(r.stdout.strip().splitlines()[-1])
        sent = len(srv.requests()) - before
        # rerun of the same batch: nothing is sent, nothing is written twice
        r2 = _qumem(work, srv, "personalize", "--queries", str(batch), "--json")
        assert r2.returncode == 0, r2.stderr[-3000:]
        again = json.loads(r2.stdout.strip().splitlines()[-1])
        assert len(srv.requests()) - before == sent
    from qumem_pipeline.query.batch_input import batch_digest

    assert report["batch_id"] == again["batch_id"] == batch_digest(str(batch))  # default id: the content digest
    assert report["answered"] == 2 and report["quarantined_input"] == 1 and report["quarantined_user"] == 1
    # the product default (AdaMem's strategy): one research round (sufficient) and the working answer per query
    assert report["strategy"] == DEFAULT_STRATEGY == "adamem"
    assert sent == report["llm_calls_sent"] == 4 and report["llm_calls_replayed"] == 0
    assert again["answered"] == 0 and again["already_done"] == 3 and again["llm_calls"] == 0
    layout = DataLayout(work / "data")
    states = rows(layout, "personalization")
    assert states.select("batch_id", "query_id", "user_id").rows() == [(report["batch_id"], "b1", "ana"),
                                                                       (report["batch_id"], "b2", "ben")]
    assert states.select(pl.struct("batch_id", "query_id").is_unique().all()).item()
    # the job stage's own version (the child's LLM settings are part of it), the model that answered
    assert states["code_version"].n_unique() == 1 and states["code_version"][0].startswith("personalization@")
    assert set(states["model"]) == {"fake-model"} and report["code_version"] == states["code_version"][0]
    assert states["source_row"].to_list() == [1, 2] and set(states["strategy"]) == {"adamem"}
    q = rows(layout, "personalization_quarantine", "source_row")
    assert q.select("source_row", "query_id", "stage", "field").rows() == [(3, "b3", "input", "as_of"),
                                                                            (4, "b4", "user", "user_id")]
    assert "unparseable as_of" in q["reason"][0] and "no history" in q["reason"][1]
    assert rows(layout, "personalization_llm_ledger", "request_id").height == 4
    # the warehouse holds the batch, and `qumem export` writes it with the other tables
    con = duckdb.connect(str(work / "data" / "warehouse.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM personalization").fetchone()[0] == 2
        assert con.execute("SELECT count(*) FROM personalization_quarantine").fetchone()[0] == 2
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        # a batch is not the deployment's queries: nothing of it lands in query_states
        assert "query_states" not in tables or con.execute("SELECT count(*) FROM query_states").fetchone()[0] == 0
    finally:
        con.close()
    with RunningFakeServer(SCRIPT, work / "srv2") as srv:
        r = _qumem(work, srv, "export", "--out", str(work / "export"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert pl.read_parquet(work / "export" / "personalization.parquet").height == 2


# -- the domain core: formats, streaming, resumption -------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One user's tables, built once; each test copies them."""
    root = tmp_path_factory.mktemp("built") / "data"
    build_user_tables(root)
    return root


@pytest.fixture
def root(built, tmp_path):
    import shutil

    shutil.copytree(built, tmp_path / "data")
    return tmp_path / "data"


def test_parquet_input_streamed_in_chunks_gives_the_jsonl_answers(root, tmp_path):
    layout = DataLayout(root)
    qs = queries(5)
    jl = write_jsonl(tmp_path / "q.jsonl", qs)
    pq = tmp_path / "q.parquet"
    pl.DataFrame(qs).write_parquet(pq)
    with RunningFakeServer(script(), tmp_path / "srv") as srv:
        whole = personalize(layout, jl, srv, batch_id="whole")
        versions = {t: layout.store.version(t) for t in ("personalization", "personalization_llm_ledger")}
        streamed = personalize(layout, pq, srv, batch_id="streamed", chunk_rows=2)
        n_requests = len(srv.requests())
    assert whole.chunks == 1 and streamed.chunks == 3 and streamed.rows == 5 and streamed.format == "parquet"
    # one commit per chunk and table (plus the batch lease's fence commit): the batch is never held whole
    assert layout.store.version("personalization") - versions["personalization"] == 3 + 1
    assert whole.llm_calls_sent == 15 and streamed.llm_calls_sent == 0 and streamed.llm_calls_replayed == 15
    assert n_requests == 15  # the streamed batch's prompts are the same: every call came from the checkpoints
    states = rows(layout, "personalization")
    keep = ["query_id", "user_id", "as_of_position", "plan", "state", "cited_memory_ids", "cited_turn_ids"]
    a = states.filter(pl.col("batch_id") == "whole").select(keep)
    b = states.filter(pl.col("batch_id") == "streamed").select(keep)
    assert a.height == 5 and a.equals(b)
    # evidence never after the query's as_of
    assert (states["cited_turn_ids"].list.max() <= states["as_of_position"]).all()


def test_a_killed_batch_resumes_paying_no_finished_call(root, tmp_path):
    from qumem_pipeline.llm.base import LLMError

    layout = DataLayout(root)
    src = write_jsonl(tmp_path / "q.jsonl", [*queries(8), {"query_id": "q0", "user_id": U, "query": "dup"},
                                             b'{"broken'])
    with RunningFakeServer(script(a3_then_down=6), tmp_path / "s1") as srv:
        with pytest.raises(LLMError):  # the endpoint goes away after six A3 answers: inside the second chunk
            personalize(layout, src, srv, batch_id="b", chunk_rows=4)
        first = srv.requests()
    # the first chunk (rows 1-4) committed; the second's A1/A2 calls and two A3 answers are checkpointed
    assert sorted(rows(layout, "personalization")["query_id"]) == ["q0", "q1", "q2", "q3"]
    assert sum(1 for r in first if "json" in r["response"]) == 8 * 2 + 6
    with RunningFakeServer(script(), tmp_path / "s2") as srv:
        report = personalize(layout, src, srv, batch_id="b", chunk_rows=4)
        resent = srv.requests()
    # only the two A3 calls that never finished are sent again
    assert len(resent) == 2 and all("user-state inference agent" in json.dumps(r["body"]) for r in resent)
    assert report.answered == 4 and report.already_done == 4 and report.llm_calls_replayed == 10
    assert sorted(rows(layout, "personalization")["query_id"]) == [f"q{i}" for i in range(8)]
    q = rows(layout, "personalization_quarantine", "source_row")
    assert q.select("source_row", "field").rows() == [(9, "query_id"), (10, "(line)")]
    assert q["reason"][0] == "duplicate query_id" and q["reason"][1].startswith("unreadable line")
    ledger = rows(layout, "personalization_llm_ledger", "request_id")
    assert ledger.height == 24 and ledger.select(pl.struct("request_id", "attempt").is_unique().all()).item()
    # a third run: everything done, nothing sent, nothing written twice
    with RunningFakeServer(script(), tmp_path / "s3") as srv:
        again = personalize(layout, src, srv, batch_id="b", chunk_rows=4)
        assert srv.requests() == []
    assert again.answered == 0 and again.already_done == 8 and again.chunks_with_work == 0
    assert rows(layout, "personalization").height == 8 and rows(layout, "personalization_quarantine").height == 2


def test_s3_input_jsonl_and_delta_onto_an_s3_root(s3_root, built, tmp_path, moto_server):
    """The batch on S3 (a JSONL object and a Delta table), the tables on S3 too."""
    import boto3
    import shutil

    from qumem_pipeline.storage.table_store import TableStore

    # the built user's tables, copied onto the S3 root through the store
    local = DataLayout(built)
    layout = DataLayout(s3_root)
    for t in local.tables():
        df = local.store.read(t).filter(~pl.col("user_placeholder")).drop("user_key", "user_bucket", "user_placeholder")
        layout.replace_parts(t, {U: df})
    bucket, _, prefix = s3_root[len("s3://"):].partition("/")
    body = "\n".join(json.dumps(q) for q in [*queries(2), {"query_id": "x", "user_id": U}]).encode()
    boto3.client("s3", endpoint_url=moto_server, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").put_object(Bucket=bucket, Key=f"{prefix}/in/q.jsonl", Body=body)
    from deltalake import write_deltalake

    write_deltalake(f"{s3_root}/in/qdelta", pl.DataFrame(queries(3)).to_arrow())
    with RunningFakeServer(script(), tmp_path / "srv") as srv:
        a = personalize(layout, f"{s3_root}/in/q.jsonl", srv)
        b = personalize(layout, f"{s3_root}/in/qdelta", srv, batch_id="delta-1")
    assert (a.format, a.answered, a.quarantined_input) == ("jsonl", 2, 1)
    assert (b.format, b.answered, b.llm_calls_sent) == ("delta", 3, 3)  # q0, q1 replayed; q2 is new
    got = rows(layout, "personalization")
    assert sorted(got.filter(pl.col("batch_id") == "delta-1")["query_id"]) == ["q0", "q1", "q2"]
    assert rows(layout, "personalization_quarantine")["field"].to_list() == ["query"]
    assert TableStore(s3_root).exists("personalization_checkpoints")
    shutil.rmtree(tmp_path / "srv", ignore_errors=True)


def test_the_dagster_job_with_run_config(root, tmp_path):
    from assets.personalize import personalize_job, run_config
    from resources import PipelineConfig
    from resources.models import EmbedderResource, LLMResource

    src = write_jsonl(tmp_path / "q.jsonl", [*queries(3), {"query_id": "zz", "user_id": "no one", "query": "?"}])
    wh = tmp_path / "wh.duckdb"
    with RunningFakeServer(script(), tmp_path / "srv") as srv:
        result = personalize_job.execute_in_process(
            run_config=run_config(str(src), "nightly-1"), instance=dg.DagsterInstance.ephemeral(),
            resources={"pipeline": PipelineConfig(data_root=str(root), archive_path=str(root), warehouse_path=str(wh),
                                                  query_strategy="qumem"),
                       "llm": LLMResource(kind="openai", base_url=srv.base_url, model="fake-model"),
                       "embedder": EmbedderResource(device="cpu")})
    assert result.success
    report = result.output_for_node("export_personalization_op")
    assert report["batch_id"] == "nightly-1" and report["answered"] == 3 and report["quarantined_input"] == 1
    assert report["warehouse_rows"] == {"personalization": 3, "personalization_quarantine": 1,
                                        "personalization_llm_ledger": 9}
    con = duckdb.connect(str(wh), read_only=True)
    try:
        assert con.execute("SELECT batch_id, query_id FROM personalization ORDER BY 2").fetchall() == [
            ("nightly-1", "q0"), ("nightly-1", "q1"), ("nightly-1", "q2")]
    finally:
        con.close()
    # a forget reaches the batch's rows (user-bucketed tables like every other)
    from qumem_pipeline.storage.forget import forget_user

    forget_user(root, wh, U)
    layout = DataLayout(root)
    assert layout.read_user_table("personalization", U) is None
    assert layout.read_user_table("personalization_checkpoints", U) is None
    con = duckdb.connect(str(wh), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM personalization").fetchone()[0] == 0
    finally:
        con.close()


def test_bad_batch_ids_and_formats_are_refused(root, tmp_path):
    from qumem_pipeline.query.batch_input import detect_format, iter_records
    from qumem_pipeline.query.personalize import valid_batch_id

    with pytest.raises(ValueError):
        valid_batch_id("../etc")
    assert valid_batch_id("2026-01-01:nightly_1") == "2026-01-01:nightly_1"
    with pytest.raises(FileNotFoundError):
        detect_format(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError):
        list(iter_records(str(write_jsonl(tmp_path / "q.jsonl", queries(1))), "csv"))
