"""The contract every importer meets: source format in, one raw turn frame + parse failures out.

Importers only translate formats. They never drop a row: anything they cannot parse at all
(broken JSON, non-UTF-8 bytes, a record of the wrong shape) becomes a ParseFailure, and
everything else goes into the raw frame, where `qumem_pipeline.ingest.validate` decides
valid vs. quarantined with one set of rules for every source.
"""

from dataclasses import dataclass, field

import polars as pl

# Columns of the raw frame every importer returns. All are strings except turn_index
# (Int64, null when the source has no explicit position) and source_row (Int64).
# timestamp is a string (ISO-8601 or epoch seconds as text) or null; validation parses it.
RAW_COLUMNS: dict[str, pl.DataType] = {
    "user_id": pl.String,
    "conversation_id": pl.String,
    "session_id": pl.String,
    "turn_index": pl.Int64,
    "role": pl.String,
    "speaker": pl.String,
    "text": pl.String,
    "timestamp": pl.String,
    "source_ref": pl.String,
    "source_file": pl.String,
    "source_row": pl.Int64,
}


@dataclass(frozen=True)
class ParseFailure:
    """A source record that could not even be read into the raw frame."""

    source_file: str
    source_row: int | None
    field: str
    reason: str
    raw: str | None
    user_id: str | None = None


@dataclass
class ImportResult:
    raw: pl.DataFrame
    failures: list[ParseFailure] = field(default_factory=list)

    @staticmethod
    def empty() -> "ImportResult":
        return ImportResult(raw=empty_raw_frame(), failures=[])


def empty_raw_frame() -> pl.DataFrame:
    return pl.DataFrame(schema=RAW_COLUMNS)


def raw_frame(records: list[dict]) -> pl.DataFrame:
    """Build a raw frame from dict records, filling absent columns with nulls."""
    if not records:
        return empty_raw_frame()
    cols = {name: [r.get(name) for r in records] for name in RAW_COLUMNS}
    return pl.DataFrame(cols, schema=RAW_COLUMNS)


def escape_raw(data: bytes | str, limit: int = 4096) -> str:
    """Keep a bad record readable in quarantine: text as-is, undecodable bytes escaped, long ones cut."""
    if isinstance(data, bytes):
        text = data.decode("utf-8", errors="backslashreplace")
    else:
        text = data
    if len(text) > limit:
        return text[:limit] + f"...[truncated {len(text) - limit} chars]"
    return text
