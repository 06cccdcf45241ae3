"""Which users need a run, and how they are packed into runs: shared by the nightly schedule, the
discovery sensor and `qumem run`, in both partition schemes (assets/partitions.py).

What was built for each user is read from the instance, not kept by the caller: the fingerprint
that `turns` records in its materialization metadata (every user of the run), and whether the
job's final asset was materialized after it.

* `users` scheme: one partition per user, so each user's latest `turns` materialization is found
  by partition (one indexed query), and users to rebuild are packed into contiguous ranges of the
  partition order that hold only them (an unchanged user inside a range would be marked
  materialized without being rebuilt).
* `user_buckets` scheme: what was built lives in the data root's `user_registry` table (each
  user's last published fingerprint and the run that published it: `turns` records them), so a
  plan is one vectorized compare of the archive's fingerprints with the registry, whatever the
  event log holds; a user is finished when the run that published its fingerprint also
  materialized the final asset for its bucket (one indexed event-log query for those runs). Users
  to rebuild are sorted by bucket and cut into runs of at most `per_run` users; each run names its
  users (their lists: one append to the data root's `run_users` table for the whole plan), so the
  buckets it spans rebuild only those.
"""

from dataclasses import dataclass, field

import dagster as dg

import polars as pl

from assets.partitions import (
    N_BUCKETS,
    RUN_USERS_TAG,
    SCHEME,
    bucket_key,
    partition_key_of,
    registered_users,
    run_tags,
    user_registry,
)
from qumem_pipeline.ingest.archive import EMPTY_FINGERPRINT
from qumem_pipeline.ingest.incremental import (RECORDED_FINGERPRINT_CHARS, RebuildPlan, contiguous_ranges,
                                               plan_rebuild, recorded_form, unfinished)

TURNS_KEY = dg.AssetKey("turns")
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
_PAGE = 500


@dataclass(frozen=True)
class PlannedRun:
    users: list[str]
    first_key: str
    last_key: str
    tags: dict[str, str] = field(default_factory=dict)  # range tags (+ the run's user list, buckets)

    @property
    def label(self) -> str:
        """Unique among one plan's runs: the key range, plus the user-list digest where it has one."""
        digest = self.tags.get(RUN_USERS_TAG)
        return f"{self.first_key}..{self.last_key}" + (f":{digest[:16]}" if digest else "")

    @property
    def single_key(self) -> str | None:
        return self.first_key if self.first_key == self.last_key else None

    def run_request(self, run_key: str, extra_tags: dict[str, str] | None = None,
                    job_name: str | None = None) -> dg.RunRequest:
        """`job_name`: needed from a sensor that targets more than one job (the discovery sensor)."""
        tags = {**self.tags, **(extra_tags or {})}
        if self.single_key is not None:
            tags.pop(RANGE_START), tags.pop(RANGE_END)
            return dg.RunRequest(run_key=run_key, partition_key=self.single_key, tags=tags, job_name=job_name)
        return dg.RunRequest(run_key=run_key, tags=tags, job_name=job_name)


def pack_runs(instance: dg.DagsterInstance, order: list[str], selected: set[str], per_run: int,
              scheme: str = SCHEME, pipeline=None) -> list[PlannedRun]:
    """Runs of at most `per_run` users covering exactly `selected` (`order`: the registry order,
    `users` scheme only). Bucket scheme: the runs' user lists go to the data root of `pipeline`."""
    if scheme == "users":
        return [PlannedRun(users, users[0], users[-1], {RANGE_START: users[0], RANGE_END: users[-1]})
                for users in contiguous_ranges(order, selected, per_run)]
    if per_run < 1:
        raise ValueError(f"max_per_run must be >= 1, got {per_run}")
    by_key = sorted((partition_key_of(u, scheme), u) for u in selected)
    chunks = [by_key[i : i + per_run] for i in range(0, len(by_key), per_run)]
    lists = [[u for _, u in chunk] for chunk in chunks]
    digests = user_registry(pipeline).store_run_users(lists) if lists else []
    return [PlannedRun(users, chunk[0][0], chunk[-1][0],
                       {RANGE_START: chunk[0][0], RANGE_END: chunk[-1][0], **run_tags(users, digest)})
            for chunk, users, digest in zip(chunks, lists, digests)]


def live_users(registered: list[str], forgotten) -> list[str]:
    """Registered users minus forgotten ones (`forgotten`: a ForgetRegistry; a forgotten user stays
    registered only when forget stopped half-way): `plan_rebuild` would otherwise take them for
    users that left the archive, and they are `qumem forget`'s, never rebuilt."""
    if forgotten is None or not len(forgotten):
        return registered
    return [u for u in registered if not forgotten.contains(u)]


# ------------------------------------------------------------------ what the instance says was built

def latest_ids(instance: dg.DagsterInstance, key: dg.AssetKey, partitions: list[str]) -> dict[str, int]:
    """partition -> storage id of its latest materialization of `key` (absent if none)."""
    return dict(instance.get_latest_storage_id_by_partition(key, dg.DagsterEventType.ASSET_MATERIALIZATION,
                                                            set(partitions)))


def _fingerprints_of(record) -> dict:
    mat = record.asset_materialization
    recorded = mat.metadata.get("fingerprints") if mat else None
    value = recorded.value if recorded is not None else None
    return value if isinstance(value, dict) else {}


def recorded_fingerprints(instance: dg.DagsterInstance, users: list[str], latest: dict[str, int] | None = None) -> dict[str, str]:
    """users scheme: user -> fingerprint recorded by that user's latest `turns` materialization."""
    latest = latest_ids(instance, TURNS_KEY, users) if latest is None else latest
    out: dict[str, str] = {}
    ids = sorted(latest.values())
    for i in range(0, len(ids), _PAGE):  # bounded queries for archives with many users
        batch = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=TURNS_KEY, storage_ids=ids[i : i + _PAGE]), limit=_PAGE)
        for record in batch.records:
            part = record.partition_key
            fps = _fingerprints_of(record)
            if part and part in fps:
                out[part] = fps[part]
    return out


def _newest_first(instance: dg.DagsterInstance, key: dg.AssetKey):
    cursor = None
    while True:
        page = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key), limit=_PAGE, cursor=cursor,
                                               ascending=False)
        yield from page.records
        if not page.has_more:
            return
        cursor = page.cursor


def _bucket_state(instance: dg.DagsterInstance, registered: list[str], final_key: dg.AssetKey | None
                  ) -> tuple[dict[str, str], set[str]]:
    wanted = set(registered)
    seen: dict[str, tuple[str, int, str]] = {}  # user -> (fingerprint, storage id, run id)
    oldest = None
    for record in _newest_first(instance, TURNS_KEY):
        oldest = record.storage_id
        for u, fp in _fingerprints_of(record).items():
            if u in wanted and u not in seen and partition_key_of(u, "user_buckets") == record.partition_key:
                seen[u] = (fp, record.storage_id, record.run_id)
        if len(seen) == len(wanted):
            break
    recorded = {u: fp for u, (fp, _, _) in seen.items()}
    if final_key is None or not seen:
        return recorded, set()
    finished_runs: set[tuple[str, str]] = set()  # (run id, bucket) that materialized the final asset
    for record in _newest_first(instance, final_key):
        if oldest is not None and record.storage_id < oldest:
            break
        finished_runs.add((record.run_id, record.partition_key))
    incomplete = {u for u, (_, _, run_id) in seen.items()
                  if (run_id, partition_key_of(u, "user_buckets")) not in finished_runs}
    return recorded, incomplete


def recorded_state(instance: dg.DagsterInstance, registered: list[str], final_key: dg.AssetKey | None,
                   scheme: str = SCHEME) -> tuple[dict[str, str], set[str]]:
    """(user -> recorded fingerprint, users whose last run stopped before `final_key`)."""
    if scheme == "users":
        turns_ids = latest_ids(instance, TURNS_KEY, registered)
        incomplete = set() if final_key in (None, TURNS_KEY) else unfinished(
            turns_ids, latest_ids(instance, final_key, registered))
        return recorded_fingerprints(instance, registered, turns_ids), incomplete
    return _bucket_state(instance, registered, None if final_key == TURNS_KEY else final_key)


# ------------------------------------------------------------------ one plan, either scheme

@dataclass(frozen=True)
class Plan:
    plan: RebuildPlan
    recorded: dict[str, str]  # user -> recorded fingerprint (bucket scheme: the users to rebuild only)
    incomplete: set[str]  # users whose last run stopped before the final asset
    order: list[str]  # the partition order pack_runs needs (`users` scheme; empty for buckets)


def plan_users(instance: dg.DagsterInstance, pipeline, current: dict[str, str], final_key: dg.AssetKey | None,
               scheme: str = SCHEME) -> Plan:
    """Compare the archive's fingerprints (`current`) with what was built; `final_key` None: content
    changes only (the sensor), else also users whose last run stopped before `final_key`."""
    forgotten = pipeline.forgotten()
    if scheme == "users":
        registered = registered_users(instance)
        recorded, incomplete = recorded_state(instance, registered, final_key, scheme)
        plan = plan_rebuild(current, live_users(registered, forgotten), recorded, incomplete)
        return Plan(plan, recorded, incomplete, registered + plan.new)
    return _plan_buckets(instance, pipeline, current, None if final_key == TURNS_KEY else final_key, forgotten)


_RUN_CHUNK = 500


def finished_runs(instance: dg.DagsterInstance, key: dg.AssetKey, run_ids: list[str]) -> set[tuple[str, str]]:
    """(run id, partition) pairs for which one of `run_ids` materialized `key`: one indexed query per
    500 runs on Dagster's SQL event log (events by run id), else each run's records."""
    from dagster._core.storage.event_log.schema import SqlEventLogStorageTable
    from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage

    out: set[tuple[str, str]] = set()
    storage = instance.event_log_storage
    if not isinstance(storage, SqlEventLogStorage):
        for run_id in run_ids:
            for rec in instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION).records:
                mat = rec.asset_materialization
                if mat is not None and mat.asset_key == key:
                    out.add((run_id, mat.partition))
        return out
    t = SqlEventLogStorageTable
    with storage.index_connection() as conn:
        for i in range(0, len(run_ids), _RUN_CHUNK):
            query = t.select().with_only_columns(t.c.run_id, t.c.partition).where(
                t.c.asset_key == key.to_string(),
                t.c.dagster_event_type == dg.DagsterEventType.ASSET_MATERIALIZATION.value,
                t.c.run_id.in_(run_ids[i : i + _RUN_CHUNK])).distinct()
            out.update((r, p) for r, p in conn.execute(query).fetchall())
    return out


def _plan_buckets(instance: dg.DagsterInstance, pipeline, current: dict[str, str], final_key: dg.AssetKey | None,
                  forgotten) -> Plan:
    reg = user_registry(pipeline)
    state = reg.state(columns=["fingerprint", "run_id"], with_bucket=True)
    if forgotten is not None and len(forgotten) and state.height:
        gone = [u for u in state["user_id"].to_list() if forgotten.contains(u)]
        state = state.filter(~pl.col("user_id").is_in(gone)) if gone else state
    incomplete = pl.lit(False)
    if final_key is not None and state.height:
        runs = state["run_id"].drop_nulls().unique().to_list()
        done = finished_runs(instance, final_key, sorted(runs))
        done_df = pl.DataFrame(sorted(done), schema={"run_id": pl.String, "_key": pl.String}, orient="row")
        n_store = reg.n_buckets
        if n_store % N_BUCKETS == 0:  # the partition bucket from the stored bucket (same hash, contracts/buckets.py)
            keys = (state["user_bucket"].cast(pl.Int64) % N_BUCKETS).cast(pl.String)
            width = max(3, len(str(N_BUCKETS - 1)))  # contracts/buckets.bucket_key
            state = state.with_columns(pl.format("b{}", keys.str.zfill(width)).alias("_key"))
        else:
            state = state.with_columns(pl.col("user_id").map_elements(partition_key_of, return_dtype=pl.String)
                                       .alias("_key"))
        state = state.join(done_df.with_columns(pl.lit(True).alias("_done")), on=["run_id", "_key"], how="left")
        incomplete = pl.col("fingerprint").is_not_null() & pl.col("_done").is_null()
    state = state.with_columns(incomplete.alias("_incomplete"), pl.lit(True).alias("_registered"))
    cur = pl.DataFrame({"user_id": list(current), "_current": list(current.values())},
                       schema={"user_id": pl.String, "_current": pl.String})
    cur = cur.with_columns(pl.col("_current").str.slice(0, RECORDED_FINGERPRINT_CHARS))
    j = cur.join(state.select("user_id", "fingerprint", "_incomplete", "_registered"), on="user_id",
                 how="full", coalesce=True)
    emptied = recorded_form(EMPTY_FINGERPRINT)
    same = (pl.col("fingerprint") == pl.col("_current")).fill_null(False) & ~pl.col("_incomplete").fill_null(False)
    done_empty = (pl.col("fingerprint") == emptied).fill_null(False) & ~pl.col("_incomplete").fill_null(False)
    j = j.with_columns(pl.when(pl.col("_registered").is_null()).then(pl.lit("new"))
                       .when(pl.col("_current").is_not_null()).then(pl.when(same).then(pl.lit("unchanged"))
                                                                     .otherwise(pl.lit("changed")))
                       .when(done_empty).then(pl.lit("unchanged")).otherwise(pl.lit("removed")).alias("_class"))
    j = j.sort("user_id")
    by = {c: j.filter(pl.col("_class") == c) for c in ("new", "changed", "unchanged", "removed")}
    plan = RebuildPlan(new=by["new"]["user_id"].to_list(), changed=by["changed"]["user_id"].to_list(),
                       unchanged=by["unchanged"]["user_id"].to_list(), removed=by["removed"]["user_id"].to_list())
    rebuild = pl.concat([by["changed"], by["removed"]]).filter(pl.col("fingerprint").is_not_null())
    recorded = dict(rebuild.select("user_id", "fingerprint").iter_rows())
    incomplete_users = set(j.filter(pl.col("_incomplete").fill_null(False))["user_id"].to_list())
    return Plan(plan, recorded, incomplete_users, [])
