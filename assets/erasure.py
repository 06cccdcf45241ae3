"""The Dagster instance's part of a forget, and the audit that an operator keeps as evidence.

Dagster records a user id in many places: the dynamic partition, event rows keyed by partition,
planned-materialization ranges, run tags, run config (a forget's own), metadata keyed by user, the
asset status cache, schedule ticks, compute logs. Instead of a list that goes stale with each
Dagster release, the scrub walks every text column of every table of the instance's SQL storages
(SQLite shards or PostgreSQL alike) and every file under DAGSTER_HOME:
- rows whose event is keyed by the user (partition = id) or plans a range (planned events) are deleted;
- the dynamic partition row is deleted, the asset status cache is cleared (Dagster rebuilds it);
- any other occurrence of the id as a whole token is replaced by `<forgotten>`;
- SQLite files are VACUUMed so no free page keeps a deleted row.
The audit is the same walk, read-only, plus the data root's objects and the warehouses.
"""

import json
import os
import re
import sqlite3
from pathlib import Path

import dagster as dg
import sqlalchemy as sa

from qumem_pipeline.contracts.ids import validate_user_id

REDACTED = "<forgotten>"
_ID_CHARS = "A-Za-z0-9_.\\-"


def token_pattern(user_id: str) -> re.Pattern:
    return re.compile(f"(?<![{_ID_CHARS}]){re.escape(user_id)}(?![{_ID_CHARS}])")


def _connections(instance: dg.DagsterInstance):
    """(name, connection context manager) for every SQL storage of the instance and every run shard."""
    ev, runs, sched = instance.event_log_storage, instance.run_storage, instance.schedule_storage
    out = []
    if hasattr(runs, "connect"):
        out.append(("runs", runs.connect))
    if sched is not None and hasattr(sched, "connect"):
        out.append(("schedules", sched.connect))
    if hasattr(ev, "index_connection"):
        out.append(("events:index", ev.index_connection))
        if hasattr(ev, "get_all_run_ids") and getattr(ev, "is_run_sharded", False):
            for run_id in ev.get_all_run_ids():
                out.append((f"events:{run_id}", lambda r=run_id: ev.run_connection(r)))
    return out


def _text_columns(conn, table: str) -> list[str]:
    cols = sa.inspect(conn).get_columns(table)
    return [c["name"] for c in cols if isinstance(c["type"], (sa.String, sa.Text, sa.LargeBinary))
            or str(c["type"]).upper() in ("TEXT", "VARCHAR", "BLOB", "BYTEA")]


def scan_instance(instance: dg.DagsterInstance, needles: list[str]) -> list[dict]:
    """Every (storage, table, column, rows) where one of `needles` occurs as a whole token."""
    hits = []
    pats = [token_pattern(n) for n in needles]
    for name, connect in _connections(instance):
        with connect() as conn:
            for table in sa.inspect(conn).get_table_names():
                for col in _text_columns(conn, table):
                    for needle, pat in zip(needles, pats):
                        rows = conn.execute(sa.text(f'SELECT "{col}" FROM "{table}" WHERE CAST("{col}" AS TEXT) LIKE :p'),
                                            {"p": f"%{needle}%"}).fetchall()
                        n = sum(1 for (v,) in rows if pat.search(_s(v)))
                        if n:
                            hits.append({"storage": name, "table": table, "column": col, "needle": needle, "rows": n})
    return hits


def _s(v) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)


def scrub_instance(instance: dg.DagsterInstance, user_id: str) -> dict:
    """Remove or redact every instance record of `user_id` (see the module docstring)."""
    validate_user_id(user_id)
    pat, report = token_pattern(user_id), {"deleted": 0, "redacted": 0}
    for name, connect in _connections(instance):
        with connect() as conn:
            tables = set(sa.inspect(conn).get_table_names())
            if "dynamic_partitions" in tables:
                report["deleted"] += conn.execute(sa.text("DELETE FROM dynamic_partitions WHERE partition = :u"),
                                                  {"u": user_id}).rowcount or 0
            if "event_logs" in tables:
                ids = [r[0] for r in conn.execute(sa.text(
                    "SELECT id FROM event_logs WHERE partition = :u OR (event LIKE :p AND dagster_event_type = "
                    "'ASSET_MATERIALIZATION_PLANNED')"), {"u": user_id, "p": f"%{user_id}%"}).fetchall()]
                for i in range(0, len(ids), 500):
                    chunk = ids[i:i + 500]
                    if "asset_event_tags" in tables:
                        conn.execute(sa.text("DELETE FROM asset_event_tags WHERE event_id IN :ids").bindparams(
                            sa.bindparam("ids", expanding=True)), {"ids": chunk})
                    report["deleted"] += conn.execute(sa.text("DELETE FROM event_logs WHERE id IN :ids").bindparams(
                        sa.bindparam("ids", expanding=True)), {"ids": chunk}).rowcount or 0
            if "asset_keys" in tables:
                cols = {c["name"] for c in sa.inspect(conn).get_columns("asset_keys")}
                if "cached_status_data" in cols:
                    conn.execute(sa.text("UPDATE asset_keys SET cached_status_data = NULL WHERE cached_status_data LIKE :p"),
                                 {"p": f"%{user_id}%"})
            for table in tables:
                for col in _text_columns(conn, table):
                    rows = conn.execute(sa.text(f'SELECT DISTINCT "{col}" FROM "{table}" WHERE CAST("{col}" AS TEXT) LIKE :p'),
                                        {"p": f"%{user_id}%"}).fetchall()
                    for (old,) in rows:
                        text = _s(old)
                        if not pat.search(text):
                            continue
                        new = pat.sub(REDACTED, text)
                        value = new.encode() if isinstance(old, (bytes, bytearray)) else new
                        conn.execute(sa.text(f'UPDATE "{table}" SET "{col}" = :new WHERE "{col}" = :old'),
                                     {"new": value, "old": old})
                        report["redacted"] += 1
            if hasattr(conn, "commit") and getattr(conn, "in_transaction", lambda: False)():
                conn.commit()
    report["files_redacted"] = _scrub_home_files(user_id)
    report["sqlite_vacuumed"] = _vacuum_sqlite()
    return report


def _home() -> Path | None:
    home = os.environ.get("DAGSTER_HOME")
    return Path(home) if home else None


def _home_files():
    home = _home()
    if home is None or not home.exists():
        return []
    return [p for p in home.rglob("*") if p.is_file() and not p.name.endswith((".lock",))]


def _scrub_home_files(user_id: str) -> int:
    """Compute logs and other text files under DAGSTER_HOME (SQLite files are scrubbed through SQL)."""
    pat, n = token_pattern(user_id), 0
    for p in _home_files():
        if p.suffix in (".db", ".db-wal", ".db-shm") or p.name.endswith(("-journal",)):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if pat.search(text):
            tmp = p.with_name(p.name + ".scrub")
            tmp.write_text(pat.sub(REDACTED, text), encoding="utf-8")
            os.replace(tmp, p)
            n += 1
    return n


def _vacuum_sqlite() -> int:
    n = 0
    for p in _home_files():
        if p.suffix == ".db":
            con = sqlite3.connect(p, timeout=60)
            try:
                con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                con.execute("VACUUM")
                n += 1
            finally:
                con.close()
    return n


def scan_home_files(needles: list[str]) -> list[str]:
    """Files under DAGSTER_HOME whose bytes contain a needle (SQLite free pages included)."""
    hits = []
    for p in _home_files():
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if any(token_pattern(n).search(data.decode("latin-1")) for n in needles):
            hits.append(str(p))
    return hits


def rewrite_run_user_lists(instance: dg.DagsterInstance, user_id: str) -> int:
    """Planned runs' user lists (key-value store) without the user: in-flight runs skip them."""
    from assets.partitions import RUN_USERS_KV_PREFIX

    runs = instance.run_storage
    if not hasattr(runs, "connect"):
        return 0
    changed = {}
    with runs.connect() as conn:
        if "kvs" not in sa.inspect(conn).get_table_names():
            return 0
        for key, value in conn.execute(sa.text("SELECT key, value FROM kvs WHERE key LIKE :k AND value LIKE :p"),
                                       {"k": RUN_USERS_KV_PREFIX + "%", "p": f"%{user_id}%"}).fetchall():
            users = json.loads(value)
            if user_id in users:
                changed[key] = json.dumps([u for u in users if u != user_id])
    if changed:
        runs.set_cursor_values(changed)
    return len(changed)
