"""Which users need a run, and how they are packed into runs: shared by the nightly schedule, the
discovery sensor and `qumem run`, in both partition schemes (assets/partitions.py).

What was built for each user is read from the instance, not kept by the caller: the fingerprint
that `turns` records in its materialization metadata (every user of the run), and whether the
job's final asset was materialized after it.

* `users` scheme: one partition per user, so each user's latest `turns` materialization is found
  by partition (one indexed query), and users to rebuild are packed into contiguous ranges of the
  partition order that hold only them (an unchanged user inside a range would be marked
  materialized without being rebuilt).
* `user_buckets` scheme: a bucket's latest materialization holds only the users its last run
  rebuilt, so `turns` materializations are read newest first until every registered user has been
  seen (after a full rebuild: about users / users-per-run events). A user is finished when the run
  that recorded its fingerprint also materialized the final asset for its bucket. Users to rebuild
  are sorted by bucket and cut into runs of at most `per_run` users; each run names its users
  (`store_run_users`), so the buckets it spans rebuild only those.
"""

from dataclasses import dataclass, field

import dagster as dg

from assets.partitions import (
    RUN_USERS_TAG,
    SCHEME,
    partition_key_of,
    store_run_users,
)
from qumem_pipeline.ingest.incremental import contiguous_ranges, unfinished

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

    def run_request(self, run_key: str, extra_tags: dict[str, str] | None = None) -> dg.RunRequest:
        tags = {**self.tags, **(extra_tags or {})}
        if self.single_key is not None:
            tags.pop(RANGE_START), tags.pop(RANGE_END)
            return dg.RunRequest(run_key=run_key, partition_key=self.single_key, tags=tags)
        return dg.RunRequest(run_key=run_key, tags=tags)


def pack_runs(instance: dg.DagsterInstance, order: list[str], selected: set[str], per_run: int,
              scheme: str = SCHEME) -> list[PlannedRun]:
    """Runs of at most `per_run` users covering exactly `selected` (`order`: the registry order)."""
    if scheme == "users":
        return [PlannedRun(users, users[0], users[-1], {RANGE_START: users[0], RANGE_END: users[-1]})
                for users in contiguous_ranges(order, selected, per_run)]
    if per_run < 1:
        raise ValueError(f"max_per_run must be >= 1, got {per_run}")
    by_key = sorted((partition_key_of(u, scheme), u) for u in selected)
    runs = []
    for i in range(0, len(by_key), per_run):
        chunk = by_key[i : i + per_run]
        users = [u for _, u in chunk]
        tags = {RANGE_START: chunk[0][0], RANGE_END: chunk[-1][0], **store_run_users(instance, users)}
        runs.append(PlannedRun(users, chunk[0][0], chunk[-1][0], tags))
    return runs


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
