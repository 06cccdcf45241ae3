"""Personalization query input: a JSONL/Parquet table validated like the turn table.

Each query names a user and a point in time (as_of timestamp, or as_of_turn position); that
point becomes `as_of_position`, the latest turn whose evidence the answer may use, chosen so that
every turn up to it is at or before the query's time (see ``as_of_position``).
"""

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import polars as pl

from qumem_pipeline.contracts.ids import USER_ID_PATTERN
from qumem_pipeline.query.strategies.base import Query
from qumem_pipeline.ingest.validate import with_parsed_timestamps

QUERY_RAW = {"query_id": pl.String, "user_id": pl.String, "query": pl.String, "as_of": pl.String,
             "as_of_turn": pl.Int64, "task_context": pl.String}
QUERY_TABLE_SCHEMA = pl.Schema({"query_id": pl.String, "user_id": pl.String, "query": pl.String,
                                "as_of": pl.Datetime("us", "UTC"), "as_of_turn": pl.Int64, "task_context": pl.String})
QUERY_INPUT_QUARANTINE = pl.Schema({"source_row": pl.Int64, "query_id": pl.String, "user_id": pl.String,
                                    "field": pl.String, "reason": pl.String, "raw": pl.String})
MAX_QUERY_CHARS = 8000


def read_queries(path: str | os.PathLike) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(valid queries, quarantined rows with field + reason)."""
    p = Path(path)
    if p.suffix.lower() in (".parquet", ".pq"):
        numbered = [(i + 1, r, None) for i, r in enumerate(pl.read_parquet(p).to_dicts())]
    else:
        numbered = list(jsonl_records(p.read_bytes().split(b"\n")))
    return validate_query_records(numbered)


def jsonl_records(lines, start: int = 1):
    """(line number, object, None) per non-blank JSONL line, or (line number, {"_raw": text}, why) for a
    line that is not a JSON object. `lines` are bytes; numbering starts at `start` (blank lines count)."""
    for i, line in enumerate(lines, start=start):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
            if isinstance(obj, dict):
                yield i, obj, None
                continue
            err = "expected a JSON object"
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            err = f"unreadable line: {e}"
        yield i, {"_raw": line.decode("utf-8", "backslashreplace").rstrip("\r\n")[:2000]}, err


def validate_query_records(numbered, seen: set[str] | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Validate (row number, object, error) records: (valid queries with their `_row`-less table schema,
    quarantined rows with source_row, field, reason). A query_id seen before (earlier in these records,
    or in `seen`: the ids an earlier chunk of the same batch kept) is quarantined as a duplicate; the
    ids kept here are added to `seen`."""
    records, bad = [], []
    for row_no, obj, err in numbered:
        if err:
            bad.append({"source_row": row_no, "query_id": None, "user_id": None, "field": "(line)", "reason": err, "raw": obj.get("_raw")})
            continue
        rec = {k: obj.get(k) for k in QUERY_RAW}
        if isinstance(rec["as_of"], datetime):
            rec["as_of"] = rec["as_of"].isoformat()
        problem = _check(rec)
        if problem:
            bad.append({"source_row": row_no, "query_id": _s(rec["query_id"]), "user_id": _s(rec["user_id"]),
                        "field": problem[0], "reason": problem[1], "raw": json.dumps(obj, default=str)[:2000]})
        else:
            rec["_row"] = row_no
            records.append(rec)
    df = pl.DataFrame(records, schema={**QUERY_RAW, "_row": pl.Int64}) if records else pl.DataFrame(schema={**QUERY_RAW, "_row": pl.Int64})
    df = with_parsed_timestamps(df.rename({"as_of": "timestamp"})).rename({"timestamp": "as_of_raw"})
    unparsed = df.filter(pl.col("as_of_raw").is_not_null() & pl.col("_ts").is_null())
    for r in unparsed.iter_rows(named=True):
        bad.append({"source_row": r["_row"], "query_id": r["query_id"], "user_id": r["user_id"], "field": "as_of",
                    "reason": f"unparseable as_of '{r['as_of_raw'][:64]}'", "raw": None})
    df = df.filter(~(pl.col("as_of_raw").is_not_null() & pl.col("_ts").is_null()))
    first = pl.col("_row") == pl.col("_row").min().over("query_id")
    earlier = pl.Series([q in seen for q in df["query_id"].to_list()], dtype=pl.Boolean) if seen else pl.lit(False)
    dup = df.filter((pl.col("query_id").is_duplicated() & ~first) | earlier)
    for r in dup.iter_rows(named=True):
        bad.append({"source_row": r["_row"], "query_id": r["query_id"], "user_id": r["user_id"], "field": "query_id",
                    "reason": "duplicate query_id", "raw": None})
    df = df.filter(~pl.col("_row").is_in(dup["_row"].implode()))
    if seen is not None:
        seen.update(df["query_id"].to_list())
    valid = df.sort("_row").select(
        "query_id", "user_id", "query", pl.col("_ts").alias("as_of"), "as_of_turn", "task_context", "_row"
    ).cast({**dict(QUERY_TABLE_SCHEMA), "_row": pl.Int64})
    q = pl.DataFrame(bad, schema=QUERY_INPUT_QUARANTINE) if bad else QUERY_INPUT_QUARANTINE.to_frame()
    return valid.drop("_row") if seen is None else valid, q.sort("source_row")


def _s(v):
    return v if isinstance(v, str) else None


def _check(rec: dict) -> tuple[str, str] | None:
    if not isinstance(rec["query_id"], str) or not rec["query_id"].strip():
        return "query_id", "missing query_id"
    uid = rec["user_id"]
    if not isinstance(uid, str) or not USER_ID_PATTERN.fullmatch(uid) or ".." in uid:
        return "user_id", f"invalid user id {uid!r}"
    if not isinstance(rec["query"], str) or not rec["query"].strip():
        return "query", "missing query text"
    if len(rec["query"]) > MAX_QUERY_CHARS:
        return "query", f"oversize query: {len(rec['query'])} chars > {MAX_QUERY_CHARS}"
    if rec["as_of"] is not None and not isinstance(rec["as_of"], (str, int, float)):
        return "as_of", "as_of must be an ISO-8601 string or epoch seconds"
    if rec["as_of"] is not None and not isinstance(rec["as_of"], str):
        rec["as_of"] = str(rec["as_of"])
    t = rec["as_of_turn"]
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
        return "as_of_turn", f"as_of_turn must be a non-negative integer, got {t!r}"
    if rec["task_context"] is not None and not isinstance(rec["task_context"], str):
        return "task_context", "task_context must be a string"
    return None


def as_of_position(turns: pl.DataFrame, as_of: datetime | None, as_of_turn: int | None) -> int:
    """The last turn_index the query may draw evidence from (inclusive); -1 when none.

    as_of_turn wins when given: it is a position already. With neither, the end of the history.
    With a timestamp t, the answer may use exactly the turns that are *known by t*: a stamped turn
    when its timestamp is <= t; an unstamped one once a stamped turn after it in the history is
    <= t (bounded by stamped neighbours; trailing unstamped turns are never known by a timestamp).
    Every consumer filters by position (unit position = its latest evidence turn), so the result
    is the longest history prefix whose turns are all known by t: then a memory visible at
    ``as_of_position`` cites only turns known by t, whatever the archive's order. When turn
    timestamps follow history order (ingest orders turns without turn_index by time), this is the
    last turn stamped <= t; an explicit turn_index order that contradicts the timestamps ends the
    prefix at the first turn stamped after t (conservative: nothing later leaks in).
    """
    if as_of_turn is not None:
        return int(as_of_turn)
    if turns.height == 0:
        return -1
    if as_of is None:
        return int(turns["turn_index"].max())
    if as_of.tzinfo is None:
        as_of = as_of.replace(tzinfo=timezone.utc)
    ordered = turns.select("turn_index", "timestamp").sort("turn_index")
    known_by = ordered["timestamp"].backward_fill()  # the next stamped turn at or after each turn
    hidden = (~(known_by <= as_of).fill_null(False)).arg_true()
    if hidden.len() == 0:
        return int(ordered["turn_index"][-1])
    first = int(hidden[0])
    return int(ordered["turn_index"][first - 1]) if first else -1


def to_queries(valid: pl.DataFrame, turns_by_user: dict[str, pl.DataFrame]) -> list[Query]:
    out = []
    for r in valid.iter_rows(named=True):
        turns = turns_by_user.get(r["user_id"])
        if turns is None:
            continue
        out.append(Query(r["query_id"], r["user_id"], r["query"], as_of_position(turns, r["as_of"], r["as_of_turn"]), r["task_context"]))
    return out

