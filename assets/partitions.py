"""How runs are partitioned: per user, or per storage bucket of users. Deployment configuration.

`QUMEM_PARTITION_SCHEME`:
* `users` (default): `DynamicPartitionsDefinition("users")`, one partition per user. The UI shows
  each user's status; right up to Dagster's guidance of ~100,000 partitions per asset (its UI is
  reported to freeze above ~40,000).
* `user_buckets`: `StaticPartitionsDefinition`, one partition per storage bucket of the table
  store (`qumem_pipeline.contracts.buckets`, `QUMEM_BUCKETS`, default 64: the same N and hash the
  store uses), for deployments past that size; partition count stays N at any user count.

In both schemes the registry of known users is the instance's dynamic partitions named `users`
(`USER_REGISTRY`: registration, `qumem users`, `forget` are unchanged). No asset body branches
on the scheme: every asset calls `users_for_run(context)`, the one function that maps a run's
partition keys to its users. A run launched by the planner (`assets/planning.py`: the nightly
schedule, the discovery sensor, `qumem run`) may also name exactly which of those users it is for
(a digest tag, the list in the instance's key-value store), so a bucket run rebuilds its changed
users only; a run without that tag (a UI backfill of some buckets) takes every registered user of
its buckets, and the memories stage's finished-call checkpoints keep it from paying LLM calls twice.

Dagster uses the smallest max_partitions_per_run across a selection, so all assets must carry the
same policy or a backfill silently degrades to one partition per run.
"""

import hashlib
import json
import os
import warnings

import dagster as dg

from qumem_pipeline.contracts.buckets import DEFAULT_BUCKETS, bucket_key, user_bucket

# backfill_policy is marked beta; it is exactly the feature many-users-per-run relies on.
warnings.filterwarnings("ignore", category=dg.BetaWarning)

SCHEMES = ("users", "user_buckets")
SCHEME = os.environ.get("QUMEM_PARTITION_SCHEME") or "users"
if SCHEME not in SCHEMES:
    raise ValueError(f"QUMEM_PARTITION_SCHEME={SCHEME!r}: expected one of {SCHEMES}")
N_BUCKETS = int(os.environ.get("QUMEM_BUCKETS") or DEFAULT_BUCKETS)
USERS_PER_RUN = int(os.environ.get("QUMEM_USERS_PER_RUN", "50"))
# UI backfills in the bucket scheme: buckets per run (each holds ~users/N_BUCKETS users).
BUCKETS_PER_RUN = int(os.environ.get("QUMEM_BUCKETS_PER_RUN", "1"))

USER_REGISTRY = "users"  # dynamic partitions holding every registered user, in both schemes
RUN_USERS_TAG = "qumem/run_users"  # digest of the run's user list (stored under RUN_USERS_KV_PREFIX)
RUN_USERS_COUNT_TAG = "qumem/run_users_count"
RUN_USERS_KV_PREFIX = "qumem/run_users/"


def bucket_partition_keys(n_buckets: int = N_BUCKETS) -> list[str]:
    return [bucket_key(b, n_buckets) for b in range(n_buckets)]


def partitions_for(scheme: str) -> dg.PartitionsDefinition:
    if scheme == "users":
        return dg.DynamicPartitionsDefinition(name=USER_REGISTRY)
    return dg.StaticPartitionsDefinition(bucket_partition_keys())


def backfill_policy_for(scheme: str) -> dg.BackfillPolicy:
    per_run = USERS_PER_RUN if scheme == "users" else BUCKETS_PER_RUN
    return dg.BackfillPolicy.multi_run(max_partitions_per_run=per_run)


# What every partitioned asset uses (the name predates the bucket scheme: "the users' partitions").
users_partitions = partitions_for(SCHEME)
user_backfill_policy = backfill_policy_for(SCHEME)


def partition_key_of(user_id: str, scheme: str = SCHEME) -> str:
    """The partition a user's data belongs to."""
    return user_id if scheme == "users" else bucket_key(user_bucket(user_id, N_BUCKETS), N_BUCKETS)


def registered_users(instance: dg.DagsterInstance) -> list[str]:
    """Every registered user, in registration order."""
    return list(instance.get_dynamic_partitions(USER_REGISTRY))


def register_users(instance: dg.DagsterInstance, users: list[str]) -> list[str]:
    """Add the users not yet registered; returns those added."""
    known = set(registered_users(instance))
    new = [u for u in users if u not in known]
    if new:
        instance.add_dynamic_partitions(USER_REGISTRY, new)
    return new


_IN_CHUNK = 1000


def registered_among(instance: dg.DagsterInstance, users: list[str]) -> set[str]:
    """Which of `users` are registered: an indexed query for just those keys where the instance's
    event log is Dagster's SQL storage (SQLite, PostgreSQL), instead of reading the whole registry
    (0.5 s at 100,000 users on PostgreSQL, once per bucket run)."""
    from dagster._core.storage.event_log.schema import DynamicPartitionsTable
    from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage

    storage = instance.event_log_storage
    if not isinstance(storage, SqlEventLogStorage):
        wanted = set(users)
        return {u for u in registered_users(instance) if u in wanted}
    table, found = DynamicPartitionsTable, set()
    with storage.index_connection() as conn:
        for i in range(0, len(users), _IN_CHUNK):
            query = table.select().with_only_columns(table.c.partition).where(
                table.c.partitions_def_name == USER_REGISTRY, table.c.partition.in_(users[i:i + _IN_CHUNK]))
            found.update(row[0] for row in conn.execute(query).fetchall())
    return found


def users_of_keys(instance: dg.DagsterInstance, keys: list[str], scheme: str = SCHEME) -> list[str]:
    """Partition keys -> users: the keys themselves, or the registered users in those buckets."""
    if scheme == "users":
        return list(keys)
    wanted = set(keys)
    return sorted(u for u in registered_users(instance) if partition_key_of(u, scheme) in wanted)


def users_digest(users: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(users)).encode("utf-8")).hexdigest()[:32]


def store_run_users(instance: dg.DagsterInstance, users: list[str]) -> dict[str, str]:
    """Record a run's exact user list in the instance (shared by every host and step pod); returns
    the tags that point a run at it."""
    digest = users_digest(users)
    instance.run_storage.set_cursor_values({RUN_USERS_KV_PREFIX + digest: json.dumps(sorted(users))})
    return {RUN_USERS_TAG: digest, RUN_USERS_COUNT_TAG: str(len(users))}


def _planned_users(instance: dg.DagsterInstance, tags) -> set[str] | None:
    digest = tags.get(RUN_USERS_TAG)
    if not digest:
        return None
    stored = instance.run_storage.get_cursor_values({RUN_USERS_KV_PREFIX + digest})
    if RUN_USERS_KV_PREFIX + digest not in stored:
        raise dg.Failure(f"run tag {RUN_USERS_TAG}={digest} names a user list the instance does not hold")
    return set(json.loads(stored[RUN_USERS_KV_PREFIX + digest]))


# run id + partition keys -> that run's users, for the steps of one run executed by one process (the
# in-process executor, `qumem run`): in the bucket scheme each lookup reads the whole user registry
# (100,000 rows at 100,000 users), once per run instead of once per step. A few runs' worth is kept.
_run_users_memo: dict[tuple[str, tuple[str, ...]], list[str]] = {}
_RUN_USERS_MEMO_SIZE = 8


def users_for_run(context: dg.AssetExecutionContext) -> list[str]:
    """The users of this run, validated before they become paths or SQL: its partitions' users,
    narrowed to the run's planned users when it names them."""
    from qumem_pipeline.contracts.ids import validate_user_id

    memo_key = (context.run.run_id, tuple(context.partition_keys))
    if memo_key in _run_users_memo:
        return list(_run_users_memo[memo_key])
    planned = _planned_users(context.instance, context.run.tags)
    if planned is not None and SCHEME == "user_buckets":
        # the planned users of these buckets that are still registered (forget unregisters)
        wanted = set(memo_key[1])
        mine = sorted(u for u in planned if partition_key_of(u) in wanted)
        registered = registered_among(context.instance, mine)
        users = [u for u in mine if u in registered]
    else:
        users = users_of_keys(context.instance, list(memo_key[1]))
        if planned is not None:
            users = [u for u in users if u in planned]
    users = [validate_user_id(u) for u in users]
    while len(_run_users_memo) >= _RUN_USERS_MEMO_SIZE:
        _run_users_memo.pop(next(iter(_run_users_memo)))
    _run_users_memo[memo_key] = users
    return list(users)


run_user_ids = users_for_run  # the name the asset bodies use
