"""Per-user checkpoints of finished decomposition calls, so a crashed or failed run never pays twice.

Every finished (episode, memory type) call — memories parsed, or quarantined after its retry —
is appended to `<data>/memory_checkpoints/user_id=<id>/batch-<run>-<n>.parquet` (temp file +
rename) as it finishes (`record`, flushed within a second or a few dozen calls; `flush` on
failure). A rerun loads them and sends only the missing calls to the LLM.
The key hashes the exact prompt (episode transcript, type instruction, system text), the prompt
version, the model id and max_tokens, so a changed episode, prompt or model is recomputed, never
served stale. When a user's memories are written, `compact` folds the batches into one
`part-0.parquet` holding only the keys still in use; it stays as a result cache (a rerun after a
later-stage crash repeats no call), and, living under `user_id=<id>`, it goes with `forget`.
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import polars as pl

from qumem_pipeline.memories.recording import BufferedRecorder
from qumem_pipeline.storage.layout import PART_FILE, TMP_PREFIX, DataLayout, atomic_write_parquet

TABLE = "memory_checkpoints"

CHECKPOINT_SCHEMA = pl.Schema(
    {
        "key": pl.String,
        "user_id": pl.String,
        "episode_id": pl.String,
        "type": pl.String,
        "status": pl.String,  # ok | quarantined
        "output": pl.String,  # the parsed JSON output (ok)
        "quarantine": pl.String,  # the quarantine row as JSON, without created_at (quarantined)
        "ledger": pl.String,  # the call's ledger rows as a JSON list, without created_at
        "created_at": pl.Datetime("us", "UTC"),
    }
)


def call_key(user_id: str, episode_id: str, mem_type: str, messages: list[dict[str, str]],
             prompt_version: str, model: str, max_tokens: int) -> str:
    """Content key of one decomposition call: same key <=> the same request to the same model."""
    blob = json.dumps([user_id, episode_id, mem_type, messages, prompt_version, model, int(max_tokens)],
                      sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@dataclass
class CallOutcome:
    """The final result of one (episode, type) call, fresh or restored."""

    key: str
    user_id: str
    episode_id: str
    type: str
    status: str
    output: dict[str, Any] | None
    quarantine: dict[str, Any] | None
    ledger: list[dict[str, Any]]
    created_at: datetime

    def to_row(self) -> dict[str, Any]:
        return {
            "key": self.key, "user_id": self.user_id, "episode_id": self.episode_id, "type": self.type,
            "status": self.status,
            "output": None if self.output is None else json.dumps(self.output, sort_keys=True, ensure_ascii=False),
            "quarantine": None if self.quarantine is None else json.dumps(self.quarantine, ensure_ascii=False),
            "ledger": json.dumps(self.ledger, ensure_ascii=False), "created_at": self.created_at,
        }

    @classmethod
    def from_row(cls, r: dict[str, Any]) -> "CallOutcome":
        return cls(
            key=r["key"], user_id=r["user_id"], episode_id=r["episode_id"], type=r["type"], status=r["status"],
            output=None if r["output"] is None else json.loads(r["output"]),
            quarantine=None if r["quarantine"] is None else json.loads(r["quarantine"]),
            ledger=json.loads(r["ledger"]), created_at=r["created_at"],
        )


class CheckpointStore(BufferedRecorder):
    """Append-only per-user checkpoint files under the data root; `record`/`flush` (BufferedRecorder)
    take one finished call at a time and write them in small groups through `append`."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.layout = DataLayout(root)
        self._run = f"{time.time_ns()}-{os.getpid()}"
        self._seq = 0
        self.unreadable: list[Path] = []

    def user_dir(self, user_id: str) -> Path:
        return self.layout.user_dir(TABLE, user_id)

    def files(self, user_id: str) -> list[Path]:
        d = self.user_dir(user_id)
        if not d.exists():
            return []
        return sorted(p for p in d.glob("*.parquet") if not p.name.startswith(TMP_PREFIX))

    def load(self, user_ids: list[str]) -> dict[str, CallOutcome]:
        """Every finished call of these users, by key. An unreadable file is skipped (its calls rerun)."""
        out: dict[str, CallOutcome] = {}
        for u in user_ids:
            for p in self.files(u):
                try:
                    df = pl.read_parquet(p)
                except Exception:  # noqa: BLE001 - a cache: losing it costs calls, not correctness
                    self.unreadable.append(p)
                    continue
                for r in df.iter_rows(named=True):
                    out[r["key"]] = CallOutcome.from_row(r)
        return out

    def append(self, outcomes: list[CallOutcome]) -> list[Path]:
        """Write one new batch file per user for these finished calls (atomic)."""
        by_user: dict[str, list[CallOutcome]] = {}
        for o in outcomes:
            by_user.setdefault(o.user_id, []).append(o)
        written = []
        for u, rows in sorted(by_user.items()):
            self._seq += 1
            written.append(self._write(self.user_dir(u) / f"batch-{self._run}-{self._seq:06d}.parquet", rows))
        return written

    def compact(self, user_id: str, keep_keys: set[str]) -> Path | None:
        """Fold the user's batches into part-0.parquet with only `keep_keys`; drop the batch files."""
        old = self.files(user_id)
        rows = {k: o for k, o in self.load([user_id]).items() if k in keep_keys}
        target = self.user_dir(user_id) / PART_FILE
        path = None
        if rows:
            path = self._write(target, [rows[k] for k in sorted(rows)])
        else:
            target.unlink(missing_ok=True)
        for p in old:
            if p != target:
                p.unlink(missing_ok=True)
        if not rows:
            try:
                self.user_dir(user_id).rmdir()
            except OSError:
                pass
        return path

    def _write(self, target: Path, rows: list[CallOutcome]) -> Path:
        return atomic_write_parquet(pl.DataFrame([o.to_row() for o in rows], schema=CHECKPOINT_SCHEMA), target)
