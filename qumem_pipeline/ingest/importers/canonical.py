"""Canonical JSONL / Parquet archives: a file, a directory of files, or a glob.

JSONL takes a fast path (polars reads the whole file with the raw schema, no per-line Python);
only when that fails (a truncated line, bad bytes, a wrong type) is the file re-read line by
line, so the bad lines become ParseFailures and every good line of the same file still arrives.
Both paths give the same table for the same file (tests/test_importer_canonical.py).
"""

import glob
import io
import json
import mmap
import os
import re
from pathlib import Path

import numpy as np
import polars as pl

from qumem_pipeline.ingest.importers.base import (
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
    try:
        df = pl.read_ndjson(path, schema=SOURCE_COLUMNS, row_index_name="source_row", row_index_offset=1)
    except Exception:  # noqa: BLE001 - any fast-path failure means: find the bad lines one by one
        return _import_jsonl_lines(path, path.read_bytes())
    if df.height != _count_lines(path):
        # Blank lines (polars skips them): number the rows by the non-blank lines instead.
        data = path.read_bytes()
        nonblank = [i + 1 for i, line in enumerate(data.split(b"\n")) if line.strip()]
        if len(nonblank) != df.height:
            return _import_jsonl_lines(path, data)
        df = df.with_columns(source_row=pl.Series(nonblank, dtype=pl.Int64))
    df = df.with_columns(source_file=pl.lit(str(path), dtype=pl.String), source_row=pl.col("source_row").cast(pl.Int64))
    df = df.select(list(RAW_COLUMNS))
    suspect = df.select(_suspect_expr()).to_series()
    if not suspect.any():
        return ImportResult(raw=df)
    return _reparse_rows(path, path.read_bytes(), df, suspect)


def import_jsonl_bytes(src: str, data: bytes, first_line: int = 1, n_lines: int | None = None) -> ImportResult:
    """`import_jsonl_file` on a run of whole lines of a file that starts at line `first_line`:
    the same fast path and the same line-by-line fallback, so a file read block by block gives
    the rows and failures the whole-file read gives (tests/test_ingest_streaming.py)."""
    if not data or data.isspace():  # isspace stops at the first other byte; strip would copy
        return ImportResult(raw=empty_raw_frame())
    try:
        df = pl.read_ndjson(io.BytesIO(data), schema=SOURCE_COLUMNS, row_index_name="source_row", row_index_offset=first_line)
    except Exception:  # noqa: BLE001 - as in import_jsonl_file
        return _import_jsonl_lines(Path(src), data, first_line)
    n_lines = (data.count(b"\n") if n_lines is None else n_lines) + (data[-1:] != b"\n")
    if df.height != n_lines:
        nonblank = [i + first_line for i, line in enumerate(data.split(b"\n")) if line.strip()]
        if len(nonblank) != df.height:
            return _import_jsonl_lines(Path(src), data, first_line)
        df = df.with_columns(source_row=pl.Series(nonblank, dtype=pl.Int64))
    df = df.with_columns(source_file=pl.lit(src, dtype=pl.String), source_row=pl.col("source_row").cast(pl.Int64))
    df = df.select(list(RAW_COLUMNS))
    suspect = df.select(_suspect_expr()).to_series()
    if not suspect.any():
        return ImportResult(raw=df)
    return _reparse_rows(Path(src), data, df, suspect, first_line)


def _count_lines(path: Path, block: int = 1 << 24) -> int:
    """Lines in the file (a last line without "\\n" counts), counted on a memory map: no copy.

    polars skips blank lines and fails on a line holding anything but one object, so
    `rows == lines` means no blank lines and row i is line i (no per-line Python).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = np.frombuffer(mm, dtype=np.uint8)
            n = sum(int(np.count_nonzero(view[i : i + block] == 10)) for i in range(0, size, block))
            last = int(view[-1])
            del view  # release the buffer before the map closes
    return n + (last != 10)


# polars turns any JSON value in a String column into text: a number into digits, true/false,
# an object or array into its JSON. The line-by-line path treats structures and booleans as
# errors and may format a float differently, so rows whose text could have come from a
# non-string value (rare in real archives) are re-read by that path, keeping the two identical.
# One regex anchored at the start: most values fail it on their first character.
_MAYBE_NOT_A_STRING = r"^(?:[\[{]|true$|false$|-?\d+\.\d+$|-?\d{16,}$|-0$)"


def _suspect_expr() -> pl.Expr:
    return pl.any_horizontal([pl.col(c).str.contains(_MAYBE_NOT_A_STRING) for c in STRING_FIELDS]).fill_null(False).alias("suspect")


def _reparse_rows(path: Path, data: bytes, df: pl.DataFrame, suspect: pl.Series, first_line: int = 1) -> ImportResult:
    """Replace the suspect rows by what the line-by-line path makes of their lines."""
    line_ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == ord("\n"))
    records: list[dict] = []
    failures: list[ParseFailure] = []
    src = str(path)
    for lineno in df.filter(suspect)["source_row"].to_list():
        local = lineno - first_line + 1  # line number inside `data`
        start = int(line_ends[local - 2]) + 1 if local > 1 else 0
        end = int(line_ends[local - 1]) if local - 1 < len(line_ends) else len(data)
        record, failure = _parse_line(src, lineno, data[start:end])
        if failure is not None:
            failures.append(failure)
        elif record is not None:
            records.append(record)
    raw = pl.concat([df.filter(~suspect), raw_frame(records)], how="vertical").sort("source_row")
    return ImportResult(raw=raw, failures=failures)


def _with_source(df: pl.DataFrame, source_file: str, rows: pl.Series) -> pl.DataFrame:
    return df.with_columns(
        pl.lit(source_file, dtype=pl.String).alias("source_file"),
        rows.alias("source_row"),
    ).select(list(RAW_COLUMNS))


def _import_jsonl_lines(path: Path, data: bytes, first_line: int = 1) -> ImportResult:
    records: list[dict] = []
    failures: list[ParseFailure] = []
    src = str(path)
    for lineno, line in enumerate(data.split(b"\n"), start=first_line):
        if not line.strip():
            continue
        record, failure = _parse_line(src, lineno, line)
        if failure is not None:
            failures.append(failure)
        elif record is not None:
            records.append(record)
    return ImportResult(raw=raw_frame(records), failures=failures)


def _first_key_wins(pairs: list[tuple[str, object]]) -> dict:
    """A key given twice keeps its first value, as polars' reader does (json.loads keeps the last)."""
    out: dict = {}
    for k, v in pairs:
        out.setdefault(k, v)
    return out


def _parse_line(src: str, lineno: int, line: bytes) -> tuple[dict | None, ParseFailure | None]:
    """One JSONL line -> a raw record, or the ParseFailure saying why it cannot be one."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, ParseFailure(src, lineno, "(line)", f"not valid UTF-8 at byte {e.start}", escape_raw(line),
                                  user_id=_salvage_user_id(line))
    try:
        obj = json.loads(text, object_pairs_hook=_first_key_wins)
    except json.JSONDecodeError as e:
        return None, ParseFailure(src, lineno, "(line)", f"invalid JSON: {e.msg} at column {e.colno}", escape_raw(text),
                                  user_id=_salvage_user_id(line))
    if not isinstance(obj, dict):
        return None, ParseFailure(src, lineno, "(line)", f"expected a JSON object, got {type(obj).__name__}", escape_raw(text))
    record, problem = coerce_record(obj)
    if problem is not None:
        field, reason = problem
        uid = obj.get("user_id") if isinstance(obj.get("user_id"), str) else None
        return None, ParseFailure(src, lineno, field, reason, escape_raw(text), user_id=uid)
    record["source_file"] = src
    record["source_row"] = lineno
    return record, None


def coerce_record(obj: dict) -> tuple[dict, tuple[str, str] | None]:
    """Map one JSON object onto the raw columns; scalars become text, structures are errors."""
    out: dict = {}
    for name in STRING_FIELDS:
        v = obj.get(name)
        if v is None or isinstance(v, str):
            out[name] = v
        elif isinstance(v, int) and not isinstance(v, bool):
            out[name] = str(v)
        elif isinstance(v, float):
            # 1.0 and 1 are the same id (and polars reads both as "1")
            out[name] = str(int(v)) if v.is_integer() and abs(v) < 2**53 else str(v)
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
        return ImportResult(raw=empty_raw_frame(), failures=[unreadable_parquet(src, e)])
    return parquet_frame(df, src)


def unreadable_parquet(src: str, e: BaseException) -> ParseFailure:
    reason = f"not a readable Parquet file: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return ParseFailure(src, None, "(file)", reason, None)


def parquet_frame(df: pl.DataFrame, src: str, first_row: int = 1) -> ImportResult:
    """Rows of a Parquet file (or one batch of it, starting at row `first_row`) -> raw frame."""
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
    rows = pl.int_range(first_row, first_row + df.height, dtype=pl.Int64, eager=True)
    if df.height and bad_mask.any():
        for i in bad_mask.arg_true().to_list():
            row = df.row(i, named=True)
            fields = [n for n in SOURCE_COLUMNS if n in df.columns and row[n] is not None and out[n][i] is None]
            failures.append(
                ParseFailure(src, first_row + i, fields[0], f"cannot convert {fields[0]}={row[fields[0]]!r} to {SOURCE_COLUMNS[fields[0]]}",
                             escape_raw(json.dumps(row, default=str)))
            )
        out = out.filter(~bad_mask)
        rows = rows.filter(~bad_mask)
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
