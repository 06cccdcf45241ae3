"""The user registry and the planned runs' user lists, as Delta tables of the table store.

Why here and not in the orchestrator: Dagster's dynamic partitions are not meant for millions of
keys (dagster #15679, #12441), and a run's user list in its key-value store grows the instance
with every plan. Both live in the data root instead, bucketed by user like every other table, so a
reader of some buckets opens only their files (`TableStore.read_buckets`), and `forget` erases a
user from them as from any table (`storage/forget.py` walks every table).

`user_registry` (key `user_id`): one row per registered user:
- `registered_at`, `registered_fingerprint`: when it was registered and its archive content then;
- `fingerprint`, `run_id`, `materialized_at`: the content (`recorded_form`) its latest `turns`
  materialization published, and the run that did it (null: never materialized).
Registration only appends rows for users not seen in the registry: an append never conflicts, so
concurrent registrations all land; two of them adding the same user leave two rows, which reads
collapse (earliest registration, latest materialization) and the user's next materialization
rewrites as one. Recording a materialization replaces the run's users' rows (one commit,
conflict-checked and retried by the store).

`run_users` (key `user_id`): `(digest, user_id)` rows, appended once per plan for all its runs. A
planned run's tag carries only the digest (`users_digest`); its steps read the rows of the digest
from the run's buckets only.
"""

import hashlib
from datetime import datetime, timezone
from typing import Iterable

import polars as pl
import pyarrow.dataset as pads

from qumem_pipeline.contracts.buckets import user_bucket
from qumem_pipeline.storage.table_store import BUCKET, KEY, PLACEHOLDER, TableStore, sql_literal

REGISTRY_TABLE = "user_registry"
RUN_USERS_TABLE = "run_users"
_TS = pl.Datetime("us", "UTC")
REGISTRY_SCHEMA = {"user_id": pl.String, "registered_at": _TS, "registered_fingerprint": pl.String,
                   "fingerprint": pl.String, "run_id": pl.String, "materialized_at": _TS}
RUN_USERS_SCHEMA = {"digest": pl.String, "user_id": pl.String, "planned_at": _TS}


def users_digest(users: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(sorted(users)).encode("utf-8")).hexdigest()[:32]


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _collapse(df: pl.DataFrame) -> pl.DataFrame:
    """One row per user: the earliest registration, the latest materialization (+ its bucket)."""
    cols = [*REGISTRY_SCHEMA, BUCKET]
    df = df.select(cols)
    if df["user_id"].is_unique().all():
        return df
    reg = df.sort("registered_at").group_by("user_id", maintain_order=True).agg(
        pl.col("registered_at").first(), pl.col("registered_fingerprint").first(), pl.col(BUCKET).first())
    mat = df.sort("materialized_at", nulls_last=False).group_by("user_id").agg(
        pl.col("fingerprint").last(), pl.col("run_id").last(), pl.col("materialized_at").last())
    return reg.join(mat, on="user_id", how="left").select(cols)


class UserRegistry:
    """The registry and run user lists of one data root."""

    def __init__(self, store: TableStore | str):
        self.store = store if isinstance(store, TableStore) else TableStore(store)

    @property
    def n_buckets(self) -> int:
        return self.store.buckets_of(REGISTRY_TABLE)

    # ------------------------------------------------------------------ the registry
    def state(self, buckets: Iterable[int] | None = None, columns: list[str] | None = None,
              with_bucket: bool = False) -> pl.DataFrame:
        """One row per registered user (REGISTRY_SCHEMA, or `user_id` + `columns`), of `buckets` only
        when given, sorted by user; `with_bucket`: plus the store's `user_bucket` column."""
        cols = list(REGISTRY_SCHEMA) if columns is None else list(dict.fromkeys(["user_id", *columns]))
        ids_only = cols == ["user_id"]
        need = (cols if ids_only else list(REGISTRY_SCHEMA)) + [BUCKET]
        if buckets is None:
            df = self.store.read(REGISTRY_TABLE, columns=need)
        else:
            df = self.store.read_buckets(REGISTRY_TABLE, buckets, columns=need)
        out_cols = cols + ([BUCKET] if with_bucket else [])
        if df is None:
            return pl.DataFrame(schema={c: REGISTRY_SCHEMA.get(c, pl.Int32) for c in out_cols})
        df = df.filter(~pl.col(PLACEHOLDER))
        if ids_only:  # user ids only: unique is the whole collapse
            df = df.select("user_id", BUCKET).unique("user_id")
        else:
            df = _collapse(df)
        return df.select(out_cols).sort("user_id")

    def users(self, buckets: Iterable[int] | None = None) -> list[str]:
        """Registered users (of `buckets` when given), sorted."""
        return self.state(buckets, columns=["user_id"])["user_id"].to_list()

    def users_of_buckets(self, buckets: Iterable[int]) -> list[str]:
        return self.users(buckets)

    def among(self, users: Iterable[str]) -> set[str]:
        """Which of `users` are registered (reads their buckets only)."""
        users = set(users)
        if not users:
            return set()
        n = self.n_buckets
        have = self.users({user_bucket(u, n) for u in users})
        return users & set(have)

    def register(self, users: Iterable[str], fingerprints: dict[str, str] | None = None,
                 known: Iterable[str] | None = None) -> list[str]:
        """Append the users not registered yet (one commit); returns those added, sorted. `known`:
        the registered users when the caller has just read them (saves reading them again)."""
        users = sorted(set(users))
        if not users:
            return []
        have = set(known) if known is not None else self.among(users)
        new = [u for u in users if u not in have]
        if not new:
            return []
        fps = fingerprints or {}
        now = _now()
        rows = pl.DataFrame({"user_id": new, "registered_at": [now] * len(new),
                             "registered_fingerprint": [fps.get(u) for u in new]},
                            schema={k: REGISTRY_SCHEMA[k] for k in ("user_id", "registered_at", "registered_fingerprint")})
        rows = rows.with_columns(pl.lit(None, pl.String).alias("fingerprint"), pl.lit(None, pl.String).alias("run_id"),
                                 pl.lit(None, _TS).alias("materialized_at"))
        self.store.append(REGISTRY_TABLE, rows.select(list(REGISTRY_SCHEMA)))
        return new

    def record_materialized(self, fingerprints: dict[str, str], run_id: str) -> int:
        """The run's users' published content (user -> recorded fingerprint): one replace commit."""
        if not fingerprints:
            return -1
        users = sorted(fingerprints)
        n = self.n_buckets
        old = self.state({user_bucket(u, n) for u in users})
        old = old.filter(pl.col("user_id").is_in(users))
        now = _now()
        new = pl.DataFrame({"user_id": users, "fingerprint": [fingerprints[u] for u in users],
                            "run_id": [run_id] * len(users), "materialized_at": [now] * len(users)},
                           schema={k: REGISTRY_SCHEMA[k] for k in ("user_id", "fingerprint", "run_id", "materialized_at")})
        rows = new.join(old.select("user_id", "registered_at", "registered_fingerprint"), on="user_id", how="left")
        rows = rows.with_columns(pl.col("registered_at").fill_null(now)).select(list(REGISTRY_SCHEMA))
        return self.store.replace_keyed(REGISTRY_TABLE, users, rows, placeholders=False)

    # ------------------------------------------------------------------ planned runs' user lists
    def store_run_users(self, runs: list[list[str]]) -> list[str]:
        """Record each run's user list (one commit for all of them); returns their digests."""
        digests = [users_digest(users) for users in runs]
        rows = [(d, u) for d, users in zip(digests, runs) for u in sorted(set(users))]
        if rows:
            df = pl.DataFrame(rows, schema={"digest": pl.String, "user_id": pl.String}, orient="row")
            df = df.with_columns(pl.lit(_now(), _TS).alias("planned_at")).select(list(RUN_USERS_SCHEMA))
            self.store.append(RUN_USERS_TABLE, df)
        return digests

    def run_users(self, digest: str, buckets: Iterable[int]) -> list[str] | None:
        """The users of the planned run `digest` in `buckets` (those buckets' files only), sorted;
        None when the table does not exist."""
        df = self.store.read_buckets(RUN_USERS_TABLE, buckets, columns=["digest", "user_id"],
                                     where=pads.field("digest") == digest)
        if df is None:
            return None
        return sorted(set(df.filter(~pl.col(PLACEHOLDER))["user_id"].to_list()))

    def prune_run_users(self, planned_before: datetime, keep: Iterable[str] = ()) -> int:
        """Delete the user lists planned before `planned_before`, except the digests in `keep` (those
        of runs not finished yet): the table otherwise grows by every plan's users for ever, and
        every bucket read and every forget walks it. A run whose list was pruned fails naming its
        digest (assets/partitions.py); the users it had left are planned again by the next tick,
        whose comparison is with the registry's materialized fingerprints, not with old lists.
        Returns rows deleted."""
        if not self.store.exists(RUN_USERS_TABLE):
            return 0
        cutoff = planned_before.astimezone(timezone.utc).isoformat()
        predicate = f"planned_at < '{cutoff}'"
        kept = sorted(set(keep))
        if kept:
            predicate += f" AND digest NOT IN ({', '.join(sql_literal(d) for d in kept)})"
        return self.store.delete_where(RUN_USERS_TABLE, predicate, operation="prune-run-users")

    def buckets_of(self, users: Iterable[str]) -> set[int]:
        n = self.n_buckets
        return {user_bucket(u, n) for u in users}


__all__ = ["REGISTRY_TABLE", "RUN_USERS_TABLE", "REGISTRY_SCHEMA", "UserRegistry", "users_digest", "KEY"]
