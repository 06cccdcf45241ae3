"""One set of validation rules for every source: raw frame in, valid turns + quarantine out.

Vectorised in polars so validating a million turns costs about as much as reading them.
Each bad row is quarantined with the first field that failed and a specific reason; the
valid rows of the same file carry on. In strict mode any bad row fails the run instead.
"""

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import polars as pl

from qumem_pipeline.contracts.ids import USER_ID_PATTERN, valid_user_id_expr
from qumem_pipeline.ingest.importers.base import ImportResult, ParseFailure
from qumem_pipeline.contracts.schema import QUARANTINE_SCHEMA, ROLES, TURN_SCHEMA
from qumem_pipeline.ingest.version import stage_version

DEFAULT_MAX_TEXT_CHARS = 100_000
# Timestamps further ahead than this (clock skew allowance) are treated as bad data.
FUTURE_TOLERANCE = timedelta(days=1)

TURN_POLARS_SCHEMA = pl.Schema(pl.DataFrame(TURN_SCHEMA.empty_table()).schema)
QUARANTINE_POLARS_SCHEMA = pl.Schema(pl.DataFrame(QUARANTINE_SCHEMA.empty_table()).schema)


class StrictValidationError(ValueError):
    """Raised in strict mode: the archive has bad rows and the operator asked to fail on them."""


@dataclass
class ValidationResult:
    turns: pl.DataFrame
    quarantine: pl.DataFrame

    def counts(self) -> dict:
        reasons = (
            self.quarantine.group_by("field").len().sort("field").rows()
            if self.quarantine.height
            else []
        )
        return {
            "valid_turns": self.turns.height,
            "quarantined": self.quarantine.height,
            "users": self.turns["user_id"].n_unique() if self.turns.height else 0,
            "quarantined_by_field": {f: n for f, n in reasons},
        }


def parse_timestamps(col: pl.Expr) -> pl.Expr:
    """ISO-8601 (Z, offset or naive = UTC), 'YYYY-MM-DD HH:MM:SS', a date, or epoch seconds -> UTC."""
    s = col.str.strip_chars()
    with_tz = s.str.replace(r"Z$", "+00:00").str.replace(r" ", "T").str.to_datetime(
        "%Y-%m-%dT%H:%M:%S%.f%z", strict=False, time_unit="us", time_zone="UTC"
    )
    naive = (
        s.str.replace(r" ", "T")
        .str.to_datetime("%Y-%m-%dT%H:%M:%S%.f", strict=False, time_unit="us")
        .dt.replace_time_zone("UTC")
    )
    date_only = s.str.to_date("%Y-%m-%d", strict=False).cast(pl.Datetime("us")).dt.replace_time_zone("UTC")
    epoch = s.cast(pl.Float64, strict=False)
    from_epoch = (
        pl.when(epoch.is_finite() & (epoch.abs() < 1e11))
        .then((epoch * 1_000_000).cast(pl.Int64, strict=False))
        .otherwise(None)
        .cast(pl.Datetime("us"))
        .dt.replace_time_zone("UTC")
    )
    return pl.coalesce(with_tz, naive, date_only, from_epoch)


# The common formats, each parsed in one cheap pass; the full parser only sees what they miss.
_FAST_UTC_FORMATS = ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S%.fZ")


def with_parsed_timestamps(df: pl.DataFrame) -> pl.DataFrame:
    """Add `_ts`: fast formats first, the full parser only for the rows they missed."""
    ts = pl.col("timestamp")
    missed = pl.col("_ts").is_null() & ts.is_not_null()
    df = df.with_columns(
        _ts=ts.str.to_datetime(_FAST_UTC_FORMATS[0], strict=False, time_unit="us").dt.replace_time_zone("UTC")
    )
    for parse in (
        ts.str.to_datetime(_FAST_UTC_FORMATS[1], strict=False, time_unit="us").dt.replace_time_zone("UTC"),
        parse_timestamps(ts),
    ):
        if not df.select(missed.any()).item():
            break
        df = df.with_columns(_ts=pl.when(missed).then(parse).otherwise(pl.col("_ts")))
    return df


def validate(
    imported: ImportResult,
    *,
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
    strict: bool = False,
    now: datetime | None = None,
) -> ValidationResult:
    """The whole-file path: row rules, then duplicates and history order over every row at once."""
    candidates, bad = check_rows(imported, max_text_chars=max_text_chars, now=now)
    good, dups = _split_duplicates(candidates)
    quarantine = pl.concat(
        [bad.filter(~pl.col("_parse")).drop("_parse"), _quarantine_rows(dups), bad.filter(pl.col("_parse")).drop("_parse")],
        how="vertical",
    )
    if strict:
        raise_if_bad(quarantine)
    return ValidationResult(turns=_finalise_turns(good), quarantine=quarantine)


def raise_if_bad(quarantine: pl.DataFrame) -> None:
    """Strict mode: any quarantined row fails the run, naming the first one's file, row and field."""
    if quarantine.height:
        first = quarantine.row(0, named=True)
        raise StrictValidationError(
            f"{quarantine.height} bad row(s); first: {first['source_file']}:{first['source_row']} "
            f"field {first['field']}: {first['reason']}"
        )


def check_rows(
    imported: ImportResult,
    *,
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
    now: datetime | None = None,
    pos_offset: int = 0,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rules that look at one row alone: (candidate rows with `_pos`, `_ts`; their quarantine rows).

    Every rule but the duplicate one is row-local, so a file can be checked batch by batch
    (`pos_offset` numbers a batch's rows after the previous batches'); `merge_candidates` then
    applies the duplicate rule and the history order over a user's candidates from every batch
    and file. The quarantine frame has a `_parse` column: True for importer parse failures.
    """
    now = now or datetime.now(timezone.utc)
    raw = with_parsed_timestamps(imported.raw.with_row_index("_pos", offset=pos_offset).with_columns(pl.col("_pos").cast(pl.Int64)))
    uid = pl.col("user_id")
    # The id rule (a regex) runs once per distinct user, not once per row.
    ids = raw.select(pl.col("user_id").unique())
    valid_uid = uid.is_in(ids.filter(valid_user_id_expr())["user_id"].implode())
    text_len = pl.col("text").str.len_chars()
    ts = pl.col("_ts")
    checks = [  # (field, failed?, reason) - the first failing check names the row's problem
        ("user_id", uid.is_null(), pl.lit("missing user_id")),
        ("user_id", ~valid_uid, pl.lit("invalid user id (allowed: ") + pl.lit(USER_ID_PATTERN.pattern) + pl.lit(", no '..')")),
        ("conversation_id", _blank(pl.col("conversation_id")), pl.lit("missing conversation_id")),
        ("role", pl.col("role").is_null(), pl.lit("missing role")),
        ("role", ~pl.col("role").is_in(list(ROLES)), pl.lit("unknown role '") + pl.col("role") + pl.lit("' (expected one of user, assistant, other)")),
        ("text", _blank(pl.col("text")), pl.lit("missing text")),
        ("text", text_len > max_text_chars, pl.lit("oversize text: ") + text_len.cast(pl.String) + pl.lit(f" chars > limit {max_text_chars}")),
        ("timestamp", pl.col("timestamp").is_not_null() & ts.is_null(), pl.lit("unparseable timestamp '") + pl.col("timestamp").str.slice(0, 64) + pl.lit("'")),
        ("timestamp", ts > pl.lit(now + FUTURE_TOLERANCE), pl.lit("timestamp in the future: ") + pl.col("timestamp").str.slice(0, 64)),
        ("turn_index", pl.col("turn_index") < 0, pl.lit("negative turn_index")),
    ]
    code: pl.Expr = pl.lit(None, dtype=pl.Int32)
    for i, (_, failed, _) in reversed(list(enumerate(checks))):
        code = pl.when(failed.fill_null(False)).then(pl.lit(i, dtype=pl.Int32)).otherwise(code)
    checked = raw.with_columns(_code=code)
    # Filtering copies every text: skip it when no row failed (the common case).
    all_good = checked["_code"].null_count() == checked.height
    good = (checked if all_good else checked.filter(pl.col("_code").is_null())).drop("_code")
    # Reasons are built only for the (few) bad rows.
    bad = checked.filter(pl.col("_code").is_not_null())
    field: pl.Expr = pl.lit(None, dtype=pl.String)
    reason: pl.Expr = pl.lit(None, dtype=pl.String)
    for i, (name, _, why) in enumerate(checks):
        field = pl.when(pl.col("_code") == i).then(pl.lit(name)).otherwise(field)
        reason = pl.when(pl.col("_code") == i).then(why).otherwise(reason)
    bad = bad.with_columns(_field=field, _reason=reason)
    quarantine = pl.concat(
        [_quarantine_rows(bad).with_columns(_parse=pl.lit(False)),
         _failure_rows(imported.failures).with_columns(_parse=pl.lit(True))],
        how="vertical",
    )
    return good, quarantine


# Every duplicate's quarantine reason starts so: a rebuild recomputes these, never keeps them.
DUPLICATE_REASON_PREFIX = "duplicate turn id: "
# Candidate columns named so ride along into the turn table without the prefix (provenance).
KEEP_PREFIX = "_keep_"


def merge_candidates(candidates: pl.DataFrame, *, ordered_per_user: bool = False) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """Candidate rows of whole users (any batches and files, in source order = `_pos`) ->
    (turns in history order, numbered; the duplicate candidates; their quarantine rows).

    `ordered_per_user`: the caller vouches that each user's rows are in source order already,
    though users interleave (a sync's staged keys, one after another): every step below orders
    within a user only, so the sort by `_pos` (a copy of every row) is skipped."""
    if not ordered_per_user and not candidates["_pos"].is_sorted():
        candidates = candidates.sort("_pos")
    good, dups = _split_duplicates(candidates)
    return _finalise_turns(good), dups.drop("_dup_idx", "_dup_ref", "_field", "_reason"), _quarantine_rows(dups)


def _blank(col: pl.Expr) -> pl.Expr:
    """Null or whitespace only; a search for one non-space character copies no text (strip_chars would)."""
    return col.is_null() | ~col.str.contains(r"\S")


def _split_duplicates(good: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Keep the first occurrence of each turn id; later copies are quarantined, naming the first.

    Rows are in source order (`_pos`), so "first" is `is_first_distinct`. A 64-bit row hash
    finds the few candidates cheaply; the exact comparison runs on those candidates only.
    """
    marked = good.with_columns(
        _dup_idx=_later_copies(good, ["user_id", "turn_index"], "turn_index"),
        _dup_ref=_later_copies(good, ["user_id", "conversation_id", "source_ref"], "source_ref"),
    )
    is_dup = pl.col("_dup_idx") | pl.col("_dup_ref")
    # Reasons are built for the duplicates only (a when/then over every row would build them all).
    dups = marked.filter(is_dup).with_columns(
        _field=pl.when(pl.col("_dup_idx")).then(pl.lit("turn_index")).otherwise(pl.lit("source_ref")),
        _reason=pl.when(pl.col("_dup_idx"))
        .then(pl.lit(DUPLICATE_REASON_PREFIX + "turn_index ") + pl.col("turn_index").cast(pl.String) + pl.lit(" already seen for this user"))
        .otherwise(pl.lit(DUPLICATE_REASON_PREFIX + "source_ref '") + pl.col("source_ref") + pl.lit("' already seen in this conversation")),
    )
    return (marked if dups.height == 0 else marked.filter(~is_dup)), dups


def _later_copies(df: pl.DataFrame, key: list[str], required: str) -> pl.Series:
    """True for each row whose `key` (with `required` not null) already appeared earlier."""
    none = pl.repeat(False, df.height, dtype=pl.Boolean, eager=True)
    if df.height == 0 or df[required].null_count() == df.height:
        return none
    has_key = pl.col(required).is_not_null()
    maybe = df.select((has_key & pl.struct(key).hash().is_duplicated()).alias("m")).to_series()
    if not maybe.any():
        return maybe
    cand = df.with_row_index("_i").filter(maybe)
    later = cand.filter(~pl.struct(key).is_first_distinct())["_i"]
    return none.scatter(later, True)


def _quarantine_rows(df: pl.DataFrame) -> pl.DataFrame:
    if df.height == 0:
        return pl.DataFrame(schema=QUARANTINE_POLARS_SCHEMA)
    src_cols = [c for c in df.columns if not c.startswith("_") and c not in ("source_file", "source_row")]
    raw_json = [json.dumps(r, ensure_ascii=False, default=str) for r in df.select(src_cols).iter_rows(named=True)]
    return df.select(
        user_id=pl.col("user_id"),
        source_file=pl.col("source_file"),
        source_row=pl.col("source_row"),
        field=pl.col("_field"),
        reason=pl.col("_reason"),
        raw=pl.Series(raw_json, dtype=pl.String).str.slice(0, 4096),
        code_version=pl.lit(stage_version("turns")),
    ).cast(dict(QUARANTINE_POLARS_SCHEMA))


def _failure_rows(failures: list[ParseFailure]) -> pl.DataFrame:
    if not failures:
        return pl.DataFrame(schema=QUARANTINE_POLARS_SCHEMA)
    return pl.DataFrame(
        {
            "user_id": [f.user_id for f in failures],
            "source_file": [f.source_file for f in failures],
            "source_row": [f.source_row for f in failures],
            "field": [f.field for f in failures],
            "reason": [f.reason for f in failures],
            "raw": [f.raw for f in failures],
            "code_version": [stage_version("turns")] * len(failures),
        },
        schema=QUARANTINE_POLARS_SCHEMA,
    )


def _order_time(good: pl.DataFrame) -> pl.Expr:
    """When a turn without turn_index counts as said, for ordering: its timestamp; unstamped, the
    timestamp of the next stamped turn of its conversation in source order (it was said no later);
    null, so last in the history, when no stamped turn follows it in its conversation."""
    if not good.select((pl.col("turn_index").is_null() & pl.col("_ts").is_null()).any()).item():
        return pl.col("_ts")
    return pl.col("_ts").backward_fill().over(["user_id", "conversation_id"], order_by=["source_file", "source_row", "_pos"])


def _finalise_turns(good: pl.DataFrame) -> pl.DataFrame:
    """Order each user's history and number it 0..N-1: explicit turn_index first; turns without one
    by time (``_order_time``), then source order (file, row)."""
    order = good.select(
        pl.arg_sort_by(["user_id", "turn_index", _order_time(good), "source_file", "source_row", "_pos"], nulls_last=True)
    ).to_series()
    # Archives written user by user are already in this order: then skip the gather (a copy of every text).
    in_order = good.height == 0 or (order == pl.int_range(0, good.height, dtype=order.dtype, eager=True)).all()
    ordered = good if in_order else good[order]
    return ordered.select(
        user_id=pl.col("user_id"),
        conversation_id=pl.col("conversation_id"),
        session_id=pl.coalesce(pl.col("session_id"), pl.col("conversation_id")),
        turn_index=(pl.int_range(pl.len()).over("user_id")).cast(pl.Int64),
        role=pl.col("role"),
        speaker=pl.col("speaker"),
        text=pl.col("text"),
        timestamp=pl.col("_ts"),
        source_ref=pl.col("source_ref"),
        source_file=pl.col("source_file"),
        code_version=pl.lit(stage_version("turns")),
        *[pl.col(c).alias(c[len(KEEP_PREFIX):]) for c in good.columns if c.startswith(KEEP_PREFIX)],
    ).cast(dict(TURN_POLARS_SCHEMA))
