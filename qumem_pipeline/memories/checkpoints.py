"""Per-user checkpoints of finished decomposition calls, so a crashed or failed run never pays twice.

Every finished (episode, memory type) call — memories parsed, or quarantined after its retry —
is appended as a row of the `memory_checkpoints` table (one Delta commit per append, so a crash
keeps every append before it) as it finishes (`record`, flushed within a second or a few dozen calls;
`flush` on failure). A rerun loads them and sends only the missing calls to the LLM.
The key hashes the exact prompt (episode transcript, type instruction, system text), the prompt
version, the model id and the configured max_tokens (a request is sent with twice it, see
`decompose.LENGTH_BUDGET_FACTOR`), so a changed episode, prompt or model is recomputed, never
served stale. When a user's memories are written, `compact` replaces the user's rows with only the
keys still in use; they stay as a result cache (a rerun after a later-stage crash repeats no call),
and, being rows of a user-keyed table, they go with `forget`.

The same store keeps the finished calls of the later LLM stages (persona merges, the query agents),
each asset in its own table (`CheckpointStore(layout, table=...)`, see `memories.call_ledger`), keyed
by `request_call_key`: a table is compacted by the one asset that writes it.
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import polars as pl

from qumem_pipeline.memories.recording import BufferedRecorder
from qumem_pipeline.storage.layout import DataLayout

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


def request_call_key(user_id: str, stage: str, model: str, decoding: dict[str, Any], schema_name: str,
                     json_schema: dict | None, decoding_schema: dict | None, messages: list[dict[str, str]],
                     max_tokens: int, occurrence: int = 0) -> str:
    """Content key of one call of a later stage (`call_ledger`): the user, the stage, the model id, the
    decoding parameters (temperature, seed, max_tokens), the output schemas and a digest of the prompt;
    `occurrence` tells apart the same request sent again in one run (the retry after unusable output)."""
    prompt = hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()
    blob = json.dumps([user_id, stage, model, decoding, int(max_tokens), schema_name, json_schema, decoding_schema,
                       prompt, int(occurrence)], sort_keys=True, ensure_ascii=False, default=str)
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
    """Finished calls as rows of a user-keyed table under the data root (`memory_checkpoints` unless told);
    `record`/`flush` (BufferedRecorder) take one finished call at a time and write them in small groups
    through `append`."""

    def __init__(self, root: "str | os.PathLike | DataLayout", table: str = TABLE) -> None:
        self.layout = root if isinstance(root, DataLayout) else DataLayout(root)
        self.table = table
        self._run = f"{time.time_ns()}-{os.getpid()}"
        self.unreadable: list[str] = []

    def load(self, user_ids: list[str]) -> dict[str, CallOutcome]:
        """Every finished call of these users, by key (a later append wins). An unreadable table is
        skipped, recorded in `unreadable` (its calls rerun): it is a cache, losing it costs calls only."""
        try:
            df = self.layout.read_table(self.table, list(user_ids))
        except Exception:  # noqa: BLE001 - a cache: losing it costs calls, not correctness
            self.unreadable.append(self.layout.table_dir(self.table))
            return {}
        out: dict[str, CallOutcome] = {}
        if df is not None:
            for r in df.iter_rows(named=True):
                out[r["key"]] = CallOutcome.from_row(r)
        return out

    def append(self, outcomes: list[CallOutcome]) -> int:
        """Record these finished calls (all users) in one commit; returns the table version."""
        if not outcomes:
            return -1
        return self.layout.store.append(self.table, self._frame(outcomes))

    def compact(self, user_id: str, keep_keys: set[str]) -> int:
        """Keep only `keep_keys` of the user's checkpoints (one row per key)."""
        return self.compact_users({user_id: keep_keys})

    def compact_users(self, keep_by_user: dict[str, set[str]]) -> int:
        """`compact` for many users in one commit: each user's rows become their kept keys, deduplicated."""
        if not keep_by_user:
            return -1
        loaded = self.load(sorted(keep_by_user))
        rows = [o for k, o in sorted(loaded.items()) if k in keep_by_user.get(o.user_id, set())]
        return self.layout.replace_or_remove_users(self.table, sorted(keep_by_user), self._frame(rows))

    @staticmethod
    def _frame(rows: list[CallOutcome]) -> pl.DataFrame:
        return pl.DataFrame([o.to_row() for o in rows], schema=CHECKPOINT_SCHEMA)
