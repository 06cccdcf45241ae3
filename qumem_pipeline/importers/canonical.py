"""Canonical JSONL / Parquet archives: a file, a directory of files, or a glob.

JSONL takes a fast path (polars reads the whole file with the raw schema); only when that
fails (a truncated line, bad bytes, a wrong type) is the file re-read line by line, so the
bad lines become ParseFailures and every good line of the same file still arrives.
"""

import glob
import io
import json
import os
import re
from pathlib import Path

import polars as pl

from qumem_pipeline.importers.base import (
    RAW_COLUMNS,
    ImportResult,
    ParseFailure,
    empty_raw_frame,
    escape_raw,
    raw_frame,
)

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.txt")
PARQUET_SUFFIXES = (".parquet", ".pq")
# Columns the source file may carry (source_file / source_row are ours).
SOURCE_COLUMNS = {k: v for k, v in RAW_COLUMNS.items() if k not in ("source_file", "source_row")}
STRING_FIELDS = [k for k, v in SOURCE_COLUMNS.items() if v == pl.String]


def expand_paths(path: str | os.PathLike) -> list[Path]:
    """A file, every JSONL/Parquet file under a directory (sorted), or a glob's matches."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = [
            f
            for f in sorted(p.rglob("*"))
            if f.is_file() and f.name.lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES)
        ]
        return files
    matches = sorted(Path(m) for m in glob.glob(str(path), recursive=True))
    files = [m for m in matches if m.is_file()]
    if not files:
        raise FileNotFoundError(f"no archive files found at {path!s}")
    return files


def import_canonical(path: str | os.PathLike) -> ImportResult:
    """Import every canonical JSONL/Parquet file at `path` into one raw frame."""
    frames: list[pl.DataFrame] = []
    failures: list[ParseFailure] = []
    for f in expand_paths(path):
        name = f.name.lower()
        if name.endswith(PARQUET_SUFFIXES):
            res = import_parquet_file(f)
        elif name.endswith(JSONL_SUFFIXES):
            res = import_jsonl_file(f)
        else:
            raise ValueError(f"{f}: unsupported file type (expected .jsonl/.ndjson or .parquet)")
        frames.append(res.raw)
        failures.extend(res.failures)
    raw = pl.concat(frames, how="vertical") if frames else empty_raw_frame()
    return ImportResult(raw=raw, failures=failures)


def import_jsonl_file(path: Path) -> ImportResult:
    data = path.read_bytes()
    try:
        df = pl.read_ndjson(io.BytesIO(data), schema=SOURCE_COLUMNS)
        nonblank = _nonblank_line_numbers(data)
        if len(nonblank) != df.height:
            raise ValueError("row count mismatch; re-read line by line")
        if df.select(_maybe_coerced_structure().any()).item():
            raise ValueError("a JSON object/array/boolean may have been turned into text; re-read line by line")
        return ImportResult(raw=_with_source(df, str(path), nonblank))
    except Exception:  # noqa: BLE001 - any fast-path failure means: find the bad lines one by one
        return _import_jsonl_lines(path, data)


def _maybe_coerced_structure() -> pl.Expr:
    """read_ndjson turns objects, arrays and booleans in a String column into text ('{"a": 1}',
    'true'); the line-by-line path rejects them. Any value that could be such text sends the
    file down that path, so both paths classify every line the same way."""
    return pl.any_horizontal(
        [pl.col(c).str.starts_with("{") | pl.col(c).str.starts_with("[") | pl.col(c).is_in(["true", "false"])
         for c in STRING_FIELDS]
    ).fill_null(False)


_BLANK_LINE = re.compile(rb"\n[ \t\r]*\n")  # literal-led: re's fast scan for "\n" applies


def _nonblank_line_numbers(data: bytes) -> list[int]:
    """1-based line numbers of the non-blank lines (what read_ndjson returns rows for)."""
    body = data[:-1] if data.endswith(b"\n") else data
    n_lines = body.count(b"\n") + 1 if body else 0
    first_blank = body[:1] in (b"\n", b"\r", b" ", b"\t") and not body.split(b"\n", 1)[0].strip()
    last_blank = bool(body) and not body.rsplit(b"\n", 1)[-1].strip()
    if not (first_blank or last_blank or _BLANK_LINE.search(body)):
        return list(range(1, n_lines + 1))
    return [i + 1 for i, line in enumerate(data.split(b"\n")) if line.strip()]


def _with_source(df: pl.DataFrame, source_file: str, rows: list[int]) -> pl.DataFrame:
    return df.with_columns(
        pl.lit(source_file, dtype=pl.String).alias("source_file"),
        pl.Series("source_row", rows, dtype=pl.Int64),
    ).select(list(RAW_COLUMNS))


def _import_jsonl_lines(path: Path, data: bytes) -> ImportResult:
    records: list[dict] = []
    failures: list[ParseFailure] = []
    src = str(path)
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            failures.append(
                ParseFailure(src, lineno, "(line)", f"not valid UTF-8 at byte {e.start}", escape_raw(line),
                             user_id=_salvage_user_id(line))
            )
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            failures.append(
                ParseFailure(src, lineno, "(line)", f"invalid JSON: {e.msg} at column {e.colno}", escape_raw(text),
                             user_id=_salvage_user_id(line))
            )
            continue
        if not isinstance(obj, dict):
            failures.append(
                ParseFailure(src, lineno, "(line)", f"expected a JSON object, got {type(obj).__name__}", escape_raw(text))
            )
            continue
        record, problem = coerce_record(obj)
        if problem is not None:
            field, reason = problem
            uid = obj.get("user_id") if isinstance(obj.get("user_id"), str) else None
            failures.append(ParseFailure(src, lineno, field, reason, escape_raw(text), user_id=uid))
            continue
        record["source_file"] = src
        record["source_row"] = lineno
        records.append(record)
    return ImportResult(raw=raw_frame(records), failures=failures)


def coerce_record(obj: dict) -> tuple[dict, tuple[str, str] | None]:
    """Map one JSON object onto the raw columns; scalars become text, structures are errors."""
    out: dict = {}
    for name in STRING_FIELDS:
        v = obj.get(name)
        if v is None or isinstance(v, str):
            out[name] = v
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = str(v)
        else:
            return out, (name, f"expected a string, got {type(v).__name__}")
    ti = obj.get("turn_index")
    if ti is not None and (isinstance(ti, bool) or not isinstance(ti, int)):
        return out, ("turn_index", f"expected an integer, got {ti!r}")
    out["turn_index"] = ti
    return out, None


def import_parquet_file(path: Path) -> ImportResult:
    src = str(path)
    try:
        df = pl.read_parquet(path)
    except (pl.exceptions.PolarsError, OSError) as e:  # not Parquet, truncated, empty: one failure for the file
        reason = f"not a readable Parquet file: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        return ImportResult(raw=empty_raw_frame(), failures=[ParseFailure(src, None, "(file)", reason, None)])
    cols = []
    for name, dtype in SOURCE_COLUMNS.items():
        if name not in df.columns:
            cols.append(pl.lit(None, dtype=dtype).alias(name))
        elif name == "timestamp" and df.schema[name] != pl.String:
            col = pl.col(name)
            if isinstance(df.schema[name], pl.Datetime) and df.schema[name].time_zone is None:
                col = col.dt.replace_time_zone("UTC")
            cols.append(col.cast(pl.String).alias(name))
        else:
            cols.append(pl.col(name).cast(dtype, strict=False).alias(name))
    out = df.select(cols)
    failures: list[ParseFailure] = []
    # A value that existed but did not survive the cast is a parse failure, never a silent null.
    lost = pl.lit(False)
    for name in SOURCE_COLUMNS:
        if name in df.columns:
            lost = lost | (pl.col(name).is_not_null() & out[name].is_null())
    bad_mask = df.select(lost.alias("bad"))["bad"] if df.height else pl.Series([], dtype=pl.Boolean)
    if df.height and bad_mask.any():
        for i in bad_mask.arg_true().to_list():
            row = df.row(i, named=True)
            fields = [n for n in SOURCE_COLUMNS if n in df.columns and row[n] is not None and out[n][i] is None]
            failures.append(
                ParseFailure(src, i + 1, fields[0], f"cannot convert {fields[0]}={row[fields[0]]!r} to {SOURCE_COLUMNS[fields[0]]}",
                             escape_raw(json.dumps(row, default=str)))
            )
        out = out.filter(~bad_mask)
        rows = [i + 1 for i in range(df.height) if not bad_mask[i]]
    else:
        rows = list(range(1, df.height + 1))
    return ImportResult(raw=_with_source(out, src, rows), failures=failures)


_USER_ID_FIELD = re.compile(r'"user_id"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _salvage_user_id(line: bytes) -> str | None:
    """Attribute a broken line (bad bytes, truncated JSON) to its user when the user_id is readable.

    Without this a user's broken line lands in the unattributed quarantine, where forgetting
    the user cannot find it and every re-ingest writes it again."""
    text = line.decode("utf-8", errors="replace")
    try:
        obj = json.loads(text)
        uid = obj.get("user_id") if isinstance(obj, dict) else None
    except json.JSONDecodeError:
        m = _USER_ID_FIELD.search(text)
        try:
            uid = json.loads(f'"{m.group(1)}"') if m else None
        except json.JSONDecodeError:
            uid = None
    return uid if isinstance(uid, str) and "\ufffd" not in uid else None
