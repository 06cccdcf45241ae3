"""Bulk personalization: a batch of queries answered from the current memories, as a job of its own.

Enters: a batch of queries (JSONL, Parquet or a Delta table, local or object store: `batch_input`), and
the tables the main job built (`turns`, `memories`, the indexes; for `adamem` the graph and profiles).
Leaves, keyed by `(batch_id, query_id)` and bucketed by user like every table:
- `personalization`: one user state Z_q per answered query (the `query_states` columns, the deployment's
  strategy, `batch_id`, `source_row`, the model, prompt and code versions);
- `personalization_quarantine`: bad input rows (`stage` "input": `source_row`, `field`, `reason`, `raw`,
  validated as `query_states` validates its queries file), queries of users the tables cannot answer for
  (`stage` "user": no history, memories not built, or memories citing withdrawn turns), and queries whose
  LLM output was unusable (the strategy's stage);
- `personalization_llm_ledger` / `personalization_checkpoints`: every LLM call (`memories.call_ledger`).

The batch is read as a stream in chunks of at most `chunk_rows` rows; each chunk is validated, answered
stage-batched (each LLM stage one batch over the chunk's queries: with the default chunk of 10,000 rows
a batch that size is one batch per stage) and committed (ledger, quarantine, then states: the states
commit marks the chunk's queries done), so memory is bounded by the chunk, never the batch. Every call
is checkpointed as it finishes; a rerun of the same batch skips the queries already answered or
quarantined (read back from the tables by batch id) and replays any finished call of a chunk cut
short, so it pays for no finished call. A finished row is final: to answer the same queries again
from newer memories, give the batch another id. `batch_id` defaults to the batch's content digest.
Evidence is never after a query's as_of (the strategies' rule, checked again on the output).
"""

import hashlib
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.dataset as pads

from qumem_pipeline.contracts import checks
from qumem_pipeline.contracts.ids import USER_ID_PATTERN
from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.query.version import stage_version
from qumem_pipeline.memories.call_ledger import CheckpointedLLM
from qumem_pipeline.memories.checkpoints import CheckpointStore
from qumem_pipeline.memories.parsing import LEDGER_SCHEMA
from qumem_pipeline.query.batch_input import DEFAULT_CHUNK_ROWS, batch_digest, detect_format, iter_records
from qumem_pipeline.query.queries import to_queries, validate_query_records
from qumem_pipeline.query.retrievers import retriever_for
from qumem_pipeline.query.strategies.base import STATE_SCHEMA
from qumem_pipeline.query.strategies.registry import DEFAULT_STRATEGY, get_strategy
from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.storage.lease import fenced, held
from qumem_pipeline.contracts.buckets import user_bucket
from qumem_pipeline.storage.table_store import BUCKET, KEY, PLACEHOLDER, STORE_COLUMNS

STAGE = "personalization"
STATES, QUARANTINE = "personalization", "personalization_quarantine"
CHECKPOINTS, LEDGER = "personalization_checkpoints", "personalization_llm_ledger"
TABLES = (STATES, QUARANTINE, LEDGER, CHECKPOINTS)
EXPORTED = (STATES, QUARANTINE, LEDGER)  # warehouse tables, by batch
BATCH_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")

PERSONALIZATION_SCHEMA = pl.Schema({"batch_id": pl.String, **STATE_SCHEMA, "source_row": pl.Int64})
QUARANTINE_SCHEMA = pl.Schema({
    "batch_id": pl.String, "owner_id": pl.String,  # owner: the user, or __unattributed__ (no valid user id)
    "source": pl.String, "source_row": pl.Int64, "query_id": pl.String, "user_id": pl.String,
    "stage": pl.String,  # input | user | the LLM stage whose output was unusable (A3, research...)
    "field": pl.String, "reason": pl.String, "raw": pl.String,
    "prompt_version": pl.String, "code_version": pl.String, "created_at": pl.Datetime("us", "UTC"),
})
BATCH_LEDGER_SCHEMA = pl.Schema({"batch_id": pl.String, **LEDGER_SCHEMA})


@dataclass
class BatchReport:
    """What a batch run did (the CLI prints it; the Dagster op records it as metadata)."""

    batch_id: str
    source: str
    format: str
    strategy: str
    rows: int = 0
    chunks: int = 0
    chunks_with_work: int = 0
    answered: int = 0  # states written by this run
    already_done: int = 0  # queries an earlier run of the batch answered or quarantined
    quarantined_input: int = 0
    quarantined_user: int = 0
    quarantined_llm: int = 0
    llm_calls: int = 0
    llm_calls_sent: int = 0
    llm_calls_replayed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    seconds_answering: float = 0.0  # inside the strategy (LLM stages + retrieval)
    warehouse_rows: dict[str, int] = field(default_factory=dict)
    code_version: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def batch_lease_name(batch_id: str) -> str:
    """The batch's lease under `<root>/_leases/` (a digest: any batch id makes a plain path)."""
    return "personalize-" + hashlib.sha256(batch_id.encode("utf-8")).hexdigest()[:16]


def valid_batch_id(batch_id: str) -> str:
    if not isinstance(batch_id, str) or not BATCH_ID.fullmatch(batch_id):
        raise ValueError(f"invalid batch id {batch_id!r}: 1-128 characters of letters, digits, '.', '_', ':', '-'")
    return batch_id


# -- what an earlier run of the batch finished ------------------------------------------------------
def _batch_rows(layout: DataLayout, table: str, batch_id: str, columns: list[str]) -> pl.DataFrame | None:
    store = layout.store
    if not store.exists(table):
        return None
    df = store.read_buckets(table, range(store.buckets_of(table)), columns=["batch_id", *columns],
                            where=pads.field("batch_id") == batch_id)
    if df is None:
        return None
    return df.filter(~pl.col(PLACEHOLDER).fill_null(False)).select(columns)


@dataclass
class _Done:
    queries: set[str]  # answered, or quarantined after validation (user or LLM stage)
    input_rows: set[int]  # input rows quarantined
    ledger: set[tuple[str, int]]  # (request_id, attempt)

    @classmethod
    def read(cls, layout: DataLayout, batch_id: str) -> "_Done":
        states = _batch_rows(layout, STATES, batch_id, ["query_id"])
        quar = _batch_rows(layout, QUARANTINE, batch_id, ["query_id", "source_row", "stage"])
        ledger = _batch_rows(layout, LEDGER, batch_id, ["request_id", "attempt"])
        done = set() if states is None else set(states["query_id"].to_list())
        rows: set[int] = set()
        if quar is not None:
            done |= set(quar.filter(pl.col("stage") != "input")["query_id"].drop_nulls().to_list())
            rows = set(quar.filter(pl.col("stage") == "input")["source_row"].to_list())
        return cls(done, rows, set() if ledger is None else set(ledger.iter_rows()))


# -- one chunk ----------------------------------------------------------------------------------------
def _owner(user_id: str | None) -> str:
    return user_id if isinstance(user_id, str) and USER_ID_PATTERN.fullmatch(user_id) and ".." not in user_id \
        else UNATTRIBUTED


def _quarantine_frame(rows: list[dict], batch_id: str, source: str, version: str, created_at: datetime) -> pl.DataFrame:
    full = [{"batch_id": batch_id, "owner_id": _owner(r.get("user_id")), "source": source, "prompt_version": None,
             "code_version": version, "created_at": created_at, **r} for r in rows]
    return pl.DataFrame(full, schema=QUARANTINE_SCHEMA) if full else QUARANTINE_SCHEMA.to_frame()


def _user_gate(layout: DataLayout, users: list[str]) -> tuple[dict, pl.DataFrame, dict[str, str]]:
    """The chunk's users' turns and memories, and why a user cannot be answered for (user -> reason)."""
    turns_by_user = layout.read_users("turns", users)
    built = set(layout.users_present("memories", users))
    mems = layout.read_table("memories", users)
    why: dict[str, str] = {}
    for u in users:
        t = turns_by_user.get(u)
        if t is None or t.height == 0:
            why[u] = "no history for this user (no turns): run the main job over an archive that holds them"
        elif u not in built:
            why[u] = "memories not built for this user: run the main job first"
    ok = [u for u in users if u not in why]
    mems = (mems.filter(pl.col("user_id").is_in(ok)) if mems is not None and mems.height else None)
    if mems is None or mems.height == 0:
        mems = pl.DataFrame(schema={"memory_id": pl.String, "user_id": pl.String, "type": pl.String,
                                    "content": pl.String, "evidence_turn_ids": pl.List(pl.Int64), "position": pl.Int64})
    have = [turns_by_user[u].select("user_id", "turn_index") for u in ok]
    turns = pl.concat(have) if have else pl.DataFrame(schema={"user_id": pl.String, "turn_index": pl.Int64})
    if not checks.evidence_turns_exist(mems, turns).passed:  # a stale memory set: none of it is used
        for u in ok:
            user_mems = mems.filter(pl.col("user_id") == u)
            if not checks.evidence_turns_exist(user_mems, turns.filter(pl.col("user_id") == u)).passed:
                why[u] = "the user's memories cite turns that no longer exist: rebuild the user with the main job"
        mems = mems.filter(~pl.col("user_id").is_in(list(why)))
    return turns_by_user, mems, why


def _answer_chunk(layout, chunk, seen, done: _Done, report: BatchReport, *, batch_id, source, strategy, llm,
                  embedder, k, respond, version, store, log, call_progress) -> None:
    created_at = datetime.now(timezone.utc)
    valid, bad = validate_query_records(chunk, seen)
    new_bad = bad.filter(~pl.col("source_row").is_in(sorted(done.input_rows)))
    quarantine = [{**r, "stage": "input"} for r in new_bad.iter_rows(named=True)]
    report.quarantined_input += len(quarantine)
    todo = valid.filter(~pl.col("query_id").is_in(sorted(done.queries))) if done.queries else valid
    report.already_done += valid.height - todo.height
    states = PERSONALIZATION_SCHEMA.to_frame()
    ledger = BATCH_LEDGER_SCHEMA.to_frame()
    if todo.height:
        users = sorted(set(todo["user_id"].to_list()))
        turns_by_user, mems, why = _user_gate(layout, users)
        for r in todo.filter(pl.col("user_id").is_in(list(why))).iter_rows(named=True):
            quarantine.append({"source_row": r["_row"], "query_id": r["query_id"], "user_id": r["user_id"],
                               "stage": "user", "field": "user_id", "reason": why[r["user_id"]], "raw": None})
            report.quarantined_user += 1
        ok_users = [u for u in users if u not in why]
        answerable = todo.filter(pl.col("user_id").is_in(ok_users))
        queries = to_queries(answerable, {u: turns_by_user[u] for u in ok_users})
        if queries:
            retriever = retriever_for(strategy, layout, ok_users, turns_by_user, mems, embedder)
            calls = CheckpointedLLM(llm, store, code_version=version, prompt_version=strategy.version,
                                    created_at=created_at, progress=call_progress)
            t0 = time.perf_counter()
            out = strategy.infer(queries, calls, retriever, k=k, respond=respond, created_at=created_at,
                                 progress=lambda stage, d, n: log(f"{stage} done ({d}/{n} queries)"))
            report.seconds_answering += time.perf_counter() - t0
            future = checks.no_future_citations(out.states, mems)
            if not future.passed:  # the strategies never cite past as_of; a bug must not publish
                raise AssertionError(f"batch {batch_id}: {future.description}")
            rows_of = answerable.select("query_id", pl.col("_row").alias("source_row"))
            states = (out.states.with_columns(batch_id=pl.lit(batch_id), code_version=pl.lit(version))
                      .join(rows_of, on="query_id", how="left").select(PERSONALIZATION_SCHEMA.names())
                      .cast(dict(PERSONALIZATION_SCHEMA)))
            for r in out.quarantine.join(rows_of, on="query_id", how="left").iter_rows(named=True):
                quarantine.append({"source_row": r["source_row"], "query_id": r["query_id"], "user_id": r["user_id"],
                                   "stage": r["stage"], "field": None, "reason": r["reason"], "raw": r["raw"],
                                   "prompt_version": r["prompt_version"]})
                report.quarantined_llm += 1
            ledger = calls.ledger().with_columns(batch_id=pl.lit(batch_id)).select(BATCH_LEDGER_SCHEMA.names())
            s = calls.summary()
            report.llm_calls += s["llm_calls"]
            report.llm_calls_sent += s["llm_calls_sent"]
            report.llm_calls_replayed += s["llm_calls_replayed"]
            report.prompt_tokens += int(out.stats.get("prompt_tokens", 0))
            report.completion_tokens += int(out.stats.get("completion_tokens", 0))
    if done.ledger and ledger.height:  # a chunk cut short before its states commit: its ledger rows landed
        seen_calls = [(r, a) in done.ledger for r, a in ledger.select("request_id", "attempt").iter_rows()]
        ledger = ledger.filter(~pl.Series(seen_calls, dtype=pl.Boolean))
    qdf = _quarantine_frame(quarantine, batch_id, source, version, created_at)
    if ledger.height or qdf.height or states.height:
        report.chunks_with_work += 1
    # ledger, quarantine, then states: the states commit marks the chunk's queries done
    layout.store.append(LEDGER, ledger)
    layout.store.append(QUARANTINE, qdf, key_column="owner_id")
    layout.store.append(STATES, states)
    report.answered += states.height
    done.queries.update(states["query_id"].to_list())
    done.queries.update(qdf.filter(pl.col("stage") != "input")["query_id"].drop_nulls().to_list())
    done.input_rows.update(qdf.filter(pl.col("stage") == "input")["source_row"].to_list())
    done.ledger.update(ledger.select("request_id", "attempt").iter_rows())


def personalize_batch(
    layout: DataLayout,
    source: str,
    llm,
    embedder,
    *,
    batch_id: str | None = None,
    fmt: str | None = None,
    strategy: str = DEFAULT_STRATEGY,
    k: int | None = None,
    respond: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    log: Callable[[str], None] | None = None,
    call_progress: Callable[[str, int, int], None] | None = None,
    warehouse=None,
) -> BatchReport:
    """Answer the batch at `source` for its users from the current tables (module doc); with `warehouse`
    (a `storage.warehouse.Warehouse`), load the batch's rows into it at the end (`export_batch`)."""
    t0 = time.perf_counter()
    log = log or (lambda msg: None)
    fmt = fmt or detect_format(source)
    batch_id = valid_batch_id(batch_id) if batch_id else batch_digest(source, fmt)
    strat = get_strategy(strategy)
    k = strat.default_k if strat.default_k is not None else (5 if k is None else k)
    version = stage_version(STAGE)
    report = BatchReport(batch_id=batch_id, source=str(source), format=fmt, strategy=strat.name, code_version=version)
    # One run of a batch at a time, wherever it runs: a fenced lease per batch (storage/lease.py). A
    # second run waits, then reads what the first finished and skips it, so (batch_id, query_id) is
    # written once; a holder that lost its lease (paused past its ttl) has its commits refused.
    with held(layout.store.root, batch_lease_name(batch_id), storage_options=layout.store.storage_options) as lease, \
            fenced(lease, layout.store, tables=TABLES):
        done = _Done.read(layout, batch_id)
        if done.queries or done.input_rows:
            log(f"batch {batch_id}: {len(done.queries)} queries and {len(done.input_rows)} bad rows done by an earlier run")
        store = CheckpointStore(layout, table=CHECKPOINTS)
        seen: set[str] = set()
        for chunk in iter_records(source, fmt, chunk_rows):
            lease.check()
            report.chunks += 1
            report.rows += len(chunk)
            _answer_chunk(layout, chunk, seen, done, report, batch_id=batch_id, source=str(source), strategy=strat,
                          llm=llm, embedder=embedder, k=k, respond=respond, version=version, store=store, log=log,
                          call_progress=call_progress)
            log(f"batch {batch_id}: chunk {report.chunks} committed ({report.rows} rows read, {report.answered} answered, "
                f"{report.already_done} already done, "
                f"{report.quarantined_input + report.quarantined_user + report.quarantined_llm} quarantined)")
    if warehouse is not None:
        report.warehouse_rows = export_batch(layout, warehouse, batch_id)
    report.seconds = time.perf_counter() - t0
    return report


# -- withdrawal: no output cites a turn that no longer exists ------------------------------------------
def _stale(layout: DataLayout, users: list[str]) -> tuple[pl.DataFrame, list[str]]:
    """(user_id, batch_id, query_id) of the `personalization` rows of `users` that cite a turn their
    user no longer has, and the users with no turns left (every source file withdrawn: nothing of
    theirs may stand). Users never ingested (no `turns` rows at all) are left alone."""
    keys = pl.DataFrame(schema={"user_id": pl.String, "batch_id": pl.String, "query_id": pl.String})
    if not users or not layout.store.exists(STATES):
        return keys, []
    held = layout.read_users("turns", users)
    emptied = sorted(u for u, t in held.items() if t is not None and t.height == 0)
    known = [u for u in users if u in held]
    states = layout.read_table(STATES, known) if known else None
    if states is None or states.height == 0:
        return keys, emptied
    have = [t.select("user_id", pl.col("turn_index").cast(pl.Int64)) for t in held.values() if t is not None and t.height]
    turns = pl.concat(have) if have else pl.DataFrame(schema={"user_id": pl.String, "turn_index": pl.Int64})
    cited = (states.select("user_id", "batch_id", "query_id", pl.col("cited_turn_ids").alias("turn_index"))
             .explode("turn_index").drop_nulls("turn_index").with_columns(pl.col("turn_index").cast(pl.Int64)))
    missing = cited.join(turns.unique(), on=["user_id", "turn_index"], how="anti")
    return missing.select(keys.columns).unique().sort(keys.columns), emptied


def evidence_outcome(layout: DataLayout, users: list[str]) -> checks.CheckOutcome:
    """`checks.evidence_turns_exist` over the `personalization` rows of `users` (each row's cited
    turns as its evidence), plus rows kept for users whose every turn was withdrawn."""
    stale, emptied = _stale(layout, users)
    stale = stale.filter(~pl.col("user_id").is_in(emptied))
    left = layout.read_table(STATES, emptied) if emptied and layout.store.exists(STATES) else None
    n_emptied = 0 if left is None else left.height
    n = stale.height + n_emptied
    return checks.CheckOutcome(n == 0, f"{n} personalization rows cite turns that no longer exist"
                               if n else "every personalization row cites existing turns",
                               {"violations": n, "rows_of_users_without_turns": n_emptied})


def purge_withdrawn(layout: DataLayout, users: list[str], warehouse=None) -> dict[str, int]:
    """Remove what a withdrawal left standing in the bulk outputs, as `query_states` loses the states
    of a rebuilt user: each `personalization` row of `users` that cites a turn no longer held, and
    every row of every personalization table of a user with no turns left; from the Delta tables
    and the warehouse. Deletes by key (never rewrites rows), so a batch answering these users at the
    same time keeps what it commits. A purged query is no longer done for its batch: a rerun of the
    batch answers it from the current memories. Returns rows deleted by table."""
    from qumem_pipeline.storage.table_store import sql_literal

    stale, emptied = _stale(layout, users)
    stale = stale.filter(~pl.col("user_id").is_in(emptied))
    out: dict[str, int] = {}
    store = layout.store
    if stale.height:
        n = store.buckets_of(STATES)
        clauses = []
        for (user, batch), grp in stale.group_by(["user_id", "batch_id"], maintain_order=True):
            ids = ", ".join(sql_literal(q) for q in grp["query_id"].to_list())
            clauses.append(f"({BUCKET} = {user_bucket(user, n)} AND {KEY} = {sql_literal(user)} AND "
                           f"batch_id = {sql_literal(batch)} AND query_id IN ({ids}))")
        out[STATES] = store.delete_where(STATES, " OR ".join(clauses), operation="personalization_withdrawn")
    if emptied:
        for table in TABLES:
            if store.exists(table):
                out[table] = out.get(table, 0) + store.delete(table, emptied)
    if warehouse is not None and warehouse.path.exists() and (stale.height or emptied):
        with warehouse.connect() as con:
            names = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables "
                                               "WHERE table_schema='main'").fetchall()}
            con.execute("BEGIN TRANSACTION")
            if STATES in names and stale.height:
                con.register("stale", stale.to_arrow())
                con.execute(f'DELETE FROM "{STATES}" t USING stale s WHERE t.user_id = s.user_id '
                            "AND t.batch_id = s.batch_id AND t.query_id = s.query_id")
                con.unregister("stale")
            for table in EXPORTED:
                if table in names and emptied:
                    con.execute(f'DELETE FROM "{table}" WHERE user_id IN (SELECT unnest(?))', [emptied])
            con.execute("COMMIT")
    return out


# -- the warehouse --------------------------------------------------------------------------------------
def export_batch(layout: DataLayout, warehouse, batch_id: str, tables: tuple[str, ...] = EXPORTED) -> dict[str, int]:
    """Replace the batch's rows of each table in the DuckDB warehouse (one transaction per table), read
    from the Delta table in record batches; users forgotten by then are left out (under the writer lock
    a forget's delete also takes, as `Warehouse.load_users`). `qumem export` then writes them as Parquet."""
    from deltalake import DeltaTable

    from qumem_pipeline.storage.warehouse_locations import record_warehouse

    record_warehouse(layout.store, warehouse.path)  # before any row lands: every forget must find this file
    out: dict[str, int] = {}
    with warehouse.connect() as con:
        for table in tables:
            if not layout.store.exists(table):
                continue
            ds = DeltaTable(layout.table_dir(table)).to_pyarrow_dataset()
            cols = [c for c in ds.schema.names if c not in STORE_COLUMNS]
            flt = (pads.field("batch_id") == batch_id) & (pads.field(PLACEHOLDER) != True)  # noqa: E712
            con.execute("BEGIN TRANSACTION")
            try:
                con.register("incoming", pa.Table.from_batches([], schema=ds.schema).select(cols))
                con.execute(f'CREATE TABLE IF NOT EXISTS "{table}" AS SELECT * FROM incoming LIMIT 0')
                have = {r[0] for r in con.execute(f'DESCRIBE "{table}"').fetchall()}
                for name, dtype, *_ in con.execute("DESCRIBE SELECT * FROM incoming").fetchall():
                    if name not in have:
                        con.execute(f'ALTER TABLE "{table}" ADD COLUMN "{name}" {dtype}')
                con.unregister("incoming")
                con.execute(f'DELETE FROM "{table}" WHERE batch_id = ?', [batch_id])
                for rb in ds.to_batches(filter=flt, columns=[*cols, KEY]):
                    keys = rb.column(KEY).to_pylist()
                    gone = layout.store.tombstones().forgotten_among(sorted(set(keys)))
                    part = pa.Table.from_batches([rb]).select(cols)
                    if gone:
                        part = part.filter(pa.array([k not in gone for k in keys]))
                    con.register("incoming", part)
                    con.execute(f'INSERT INTO "{table}" BY NAME SELECT * FROM incoming')
                    con.unregister("incoming")
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
            out[table] = con.execute(f'SELECT count(*) FROM "{table}" WHERE batch_id = ?', [batch_id]).fetchone()[0]
    return out
