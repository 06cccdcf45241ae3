"""Archive -> validated turn table -> per-user Parquet partitions, with per-user fingerprints.

The fingerprint is a content hash of a user's validated turns. It is what lets a nightly
run rebuild only users whose history changed, and what discovery compares against.
"""

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import blake3
import numpy as np
import polars as pl

from qumem_pipeline.storage.forget import ForgetRegistry
from qumem_pipeline.contracts.ids import valid_user_id_expr
from qumem_pipeline.ingest.importers.base import ImportResult
from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.storage.layout import DataLayout
from qumem_pipeline.ingest.validate import DEFAULT_MAX_TEXT_CHARS, ValidationResult, validate
from qumem_pipeline.ingest.version import stage_version

FINGERPRINT_SCHEMA = {
    "user_id": pl.String,
    "fingerprint": pl.String,
    "n_turns": pl.Int64,
    "n_quarantined": pl.Int64,
    "code_version": pl.String,
}
WRITER_THREADS = max(2, min(8, (os.cpu_count() or 2) * 2))
_FINGERPRINT_FIELDS = ["conversation_id", "session_id", "role", "speaker", "text", "timestamp", "source_ref"]


@dataclass(frozen=True)
class ArchiveConfig:
    path: str
    format: str | None = None  # None = detect from the path
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS
    strict: bool = False


def import_archive(cfg: ArchiveConfig) -> ImportResult:
    from qumem_pipeline.ingest.importers import import_archive as dispatch

    if not os.path.exists(cfg.path) and not any(ch in cfg.path for ch in "*?["):
        raise FileNotFoundError(f"archive not found: {cfg.path}")
    return dispatch(cfg.path, cfg.format)


def load_archive(cfg: ArchiveConfig, forgotten: ForgetRegistry | None = None) -> ValidationResult:
    """Import and validate the whole archive; forgotten users' rows never get past this point."""
    result = validate(import_archive(cfg), max_text_chars=cfg.max_text_chars, strict=cfg.strict)
    if forgotten is not None and len(forgotten):
        # Test each distinct user once, not each row.
        gone = [u for u in result.turns["user_id"].unique().to_list() + result.quarantine["user_id"].drop_nulls().unique().to_list()
                if forgotten.contains(u)]
        result = ValidationResult(
            turns=result.turns.filter(~pl.col("user_id").is_in(gone)),
            quarantine=result.quarantine.filter(pl.col("user_id").is_null() | ~pl.col("user_id").is_in(gone)),
        )
    return result


def _line_expr() -> pl.Expr:
    """One turn as text, ended by "\x1e": turn_index and the content fields, unit-separated, nulls as
    U+2400; the timestamp as integer microseconds since the epoch (formatting a UTC datetime as text
    cost more than the rest of the line). The end mark rides on the last field (short), not on the
    whole line: appending it to the line built every line a second time."""
    fields = [pl.col("turn_index").cast(pl.String)] + [
        (pl.col(c).dt.epoch("us") if c == "timestamp" else pl.col(c)).cast(pl.String).fill_null("\u2400")
        for c in _FINGERPRINT_FIELDS]
    fields[-1] = fields[-1] + "\x1e"
    return pl.concat_str(fields, separator="\x1f")


def fingerprint_user(turns: pl.DataFrame) -> str:
    """BLAKE3 (256-bit, hex) of one user's turns in history order: one line per turn, lines
    "\x1e"-joined. A content hash for change detection (docs/storage.md#content-hashes).

    Stable across runs, processes and machines (tests/test_ingest_fingerprints.py keeps the
    definition, a Python join, as its oracle)."""
    if turns.height == 0:
        return _EMPTY_FINGERPRINT
    users = turns["user_id"].unique()
    if users.len() != 1:
        raise ValueError(f"fingerprint_user: expected one user's turns, got {users.len()} users")
    return UserRuns(turns).fingerprints()[users[0]]


_EMPTY_FINGERPRINT = EMPTY_FINGERPRINT = blake3.blake3(b"").hexdigest()
_FINGERPRINT_BLOCK_ROWS = 1 << 17


class UserRuns:
    """A turn table in history order, seen as one contiguous run of rows per user: each user's
    frame is a zero-copy slice (partition_by would copy every text once more)."""

    def __init__(self, turns: pl.DataFrame):
        self.turns = _in_history_order(turns)
        self.empty = turns.clear()
        self._rows: dict[str, tuple[int, int]] = {}
        if self.turns.height:
            runs = self.turns["user_id"].rle().struct.unnest()
            start = 0
            for user, n in zip(runs["value"].to_list(), runs["len"].to_list()):
                self._rows[user] = (start, n)
                start += n

    @property
    def users(self) -> list[str]:
        return list(self._rows)

    @property
    def counts(self) -> dict[str, int]:
        """user -> turns, from the runs already found (a group_by would hash every row's user id)."""
        return {u: n for u, (_, n) in self._rows.items()}

    def frame(self, user_id: str) -> pl.DataFrame:
        rows = self._rows.get(user_id)
        return self.turns.slice(*rows) if rows else self.empty

    def fingerprints(self, users: Iterable[str] | None = None) -> dict[str, str]:
        """user -> fingerprint (every user with turns, or those of ``users`` that have turns)."""
        out: dict[str, str] = {}
        for block in self.fingerprint_blocks(users):
            out.update(block.hash())
        return out

    def fingerprint_blocks(self, users: Iterable[str] | None = None) -> list["FingerprintBlock"]:
        """The wanted users cut into blocks of whole users of at most ~128k rows (a bigger user is
        a block of its own), in history order; each block is hashed in one pass, independently.

        Building the lines per user cost ~0.7 ms of fixed overhead each (a select and an Arrow
        export per user): at 1,000 users that was more than the line building itself. With
        ``users``, rows of other users fall inside a block only when they lie between two wanted
        users within one block's span.
        """
        wanted = None if users is None else set(users)
        runs = [r for r in self._rows.items() if wanted is None or r[0] in wanted]
        blocks = []
        i = 0
        while i < len(runs):
            first = runs[i][1][0]
            j = i + 1
            while j < len(runs) and runs[j][1][0] + runs[j][1][1] - first <= _FINGERPRINT_BLOCK_ROWS:
                j += 1
            blocks.append(FingerprintBlock(self.turns, runs[i:j]))
            i = j
        return blocks


class FingerprintBlock:
    """Consecutive users of a history-ordered table, hashed together: their rows become one Arrow
    string array whose lines end in "\x1e", so each user's lines are one contiguous byte range of
    it, hashed without a copy."""

    def __init__(self, turns: pl.DataFrame, runs: list[tuple[str, tuple[int, int]]]):
        self.turns = turns
        self.runs = runs

    @property
    def users(self) -> list[str]:
        return [u for u, _ in self.runs]

    def hash(self) -> dict[str, str]:
        first = self.runs[0][1][0]
        last = self.runs[-1][1][0] + self.runs[-1][1][1]
        lines = (
            self.turns.slice(first, last - first)
            .select(_line_expr())
            .to_series()
            .to_arrow(compat_level=pl.CompatLevel.oldest())  # large_string: int64 offsets
        )
        _, offsets, data = lines.buffers()
        bounds = np.frombuffer(offsets, dtype=np.int64)[lines.offset :]
        view = memoryview(data)
        out = {}
        for user, (start, n) in self.runs:
            begin, end = int(bounds[start - first]), int(bounds[start - first + n])
            out[user] = blake3.blake3(view[begin : end - 1]).hexdigest()  # no separator after the last
        return out


def _in_history_order(turns: pl.DataFrame) -> pl.DataFrame:
    """Sorted by (user_id, turn_index); validated tables already are, so usually no sort at all."""
    if turns.height < 2:
        return turns
    u, t = pl.col("user_id"), pl.col("turn_index")
    ordered = ((u > u.shift()) | ((u == u.shift()) & (t >= t.shift()))).slice(1).all()
    return turns if turns.select(ordered).item() else turns.sort(["user_id", "turn_index"])


def user_fingerprints(turns: pl.DataFrame) -> dict[str, str]:
    """user -> fingerprint for every user with turns; the same function the writes record."""
    return UserRuns(turns).fingerprints()


def write_users(
    layout: DataLayout,
    result: ValidationResult,
    user_ids: list[str],
    progress=None,
) -> dict[str, dict]:
    """Write turns, quarantine and fingerprint rows for each of `user_ids`: one transaction per table."""
    user_ids = list(dict.fromkeys(user_ids))
    runs = UserRuns(result.turns)
    q = result.quarantine.with_columns(
        _key=pl.when(valid_user_id_expr()).then(pl.col("user_id")).otherwise(pl.lit(UNATTRIBUTED))
    )
    # Hashing releases the GIL: the fingerprint blocks run on a few threads.
    fingerprints: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=WRITER_THREADS) as pool:
        for fp in pool.map(lambda block: block.hash(), runs.fingerprint_blocks(user_ids)):
            fingerprints.update(fp)
    turns = runs.turns.filter(pl.col("user_id").is_in(user_ids)) if user_ids else runs.empty
    qq = q.filter(pl.col("_key").is_in(user_ids)).drop("_key")
    n_q = dict(qq.group_by("user_id").len().iter_rows()) if qq.height else {}
    n_t = dict(turns.group_by("user_id").len().iter_rows()) if turns.height else {}
    stats = {u: {"turns": n_t.get(u, 0), "quarantined": n_q.get(u, 0),
                 "fingerprint": fingerprints.get(u, _EMPTY_FINGERPRINT)} for u in user_ids}
    fp = pl.DataFrame(
        {"user_id": user_ids, "fingerprint": [stats[u]["fingerprint"] for u in user_ids],
         "n_turns": [stats[u]["turns"] for u in user_ids], "n_quarantined": [stats[u]["quarantined"] for u in user_ids],
         "code_version": [stage_version("turns")] * len(user_ids)},
        schema=FINGERPRINT_SCHEMA,
    )
    if user_ids:
        layout.replace_users("turns", user_ids, turns)
        layout.replace_or_remove_users("quarantine", user_ids, qq)
        # Recorded only after the user's data is in place: a fingerprint vouches for its turns.
        layout.replace_users("fingerprints", user_ids, fp)
    if progress:
        progress(len(user_ids), len(user_ids))
    return stats


def write_unattributed_quarantine(layout: DataLayout, result: ValidationResult) -> int:
    """Rows with no usable user id cannot live under a user: keep them in their own partition."""
    q = result.quarantine.filter(
        ~valid_user_id_expr()
    )
    layout.write_user_table("quarantine", UNATTRIBUTED, q)
    return q.height
