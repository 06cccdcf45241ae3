"""How runs are partitioned: per user, or per storage bucket of users. Deployment configuration.

`QUMEM_PARTITION_SCHEME`:
* `users` (default): `DynamicPartitionsDefinition("users")`, one partition per user. The UI shows
  each user's status; right up to Dagster's guidance of ~100,000 partitions per asset (its UI is
  reported to freeze above ~40,000).
* `user_buckets`: `StaticPartitionsDefinition`, one partition per storage bucket of the table
  store (`qumem_pipeline.contracts.buckets`, `QUMEM_BUCKETS`, default 64: the same N and hash the
  store uses), for deployments past that size; partition count stays N at any user count.

The registry of known users: in `users`, the instance's dynamic partitions named `users`
(`USER_REGISTRY`: what the UI lists); in `user_buckets`, the `user_registry` Delta table of the
data root (qumem_pipeline/storage/user_registry.py: each user's bucket, registration and last
materialized fingerprints), so no per-user state is kept in the instance and a reader of some
buckets opens only their files. Registration, `qumem users` and `forget` work the same in both.
No asset body branches on the scheme: every asset calls `users_for_run(context)`, the one
function that maps a run's partition keys to its users. A run launched by the planner
(`assets/planning.py`: the nightly schedule, the discovery sensor, `qumem run`) in the bucket
scheme names exactly which users it is for: a digest tag, the list in the data root's `run_users`
table, read from the run's buckets only; so a bucket run rebuilds its changed users only. A run
without that tag (a UI backfill of some buckets) takes every registered user of its buckets, and
the memories stage's finished-call checkpoints keep it from paying LLM calls twice.

Dagster uses the smallest max_partitions_per_run across a selection, so all assets must carry the
same policy or a backfill silently degrades to one partition per run.
"""

import os
import warnings
from pathlib import Path

import dagster as dg

from qumem_pipeline.contracts.buckets import DEFAULT_BUCKETS, bucket_key, configured_buckets, user_bucket

# backfill_policy is marked beta; it is exactly the feature many-users-per-run relies on.
warnings.filterwarnings("ignore", category=dg.BetaWarning)

SCHEMES = ("users", "user_buckets")
SCHEME = os.environ.get("QUMEM_PARTITION_SCHEME") or "users"
if SCHEME not in SCHEMES:
    raise ValueError(f"QUMEM_PARTITION_SCHEME={SCHEME!r}: expected one of {SCHEMES}")
# the one bucket count (QUMEM_BUCKETS; QUMEM_USER_BUCKETS, its earlier name, must agree): the table store's N
N_BUCKETS = configured_buckets() or DEFAULT_BUCKETS
USERS_PER_RUN = int(os.environ.get("QUMEM_USERS_PER_RUN", "50"))
# UI backfills in the bucket scheme: buckets per run (each holds ~users/N_BUCKETS users).
BUCKETS_PER_RUN = int(os.environ.get("QUMEM_BUCKETS_PER_RUN", "1"))

USER_REGISTRY = "users"  # dynamic partitions holding every registered user (`users` scheme)
RUN_USERS_TAG = "qumem/run_users"  # digest of the run's user list (rows of the data root's `run_users` table)
RUN_USERS_COUNT_TAG = "qumem/run_users_count"
RUN_USERS_KV_PREFIX = "qumem/run_users/"  # where lists lived in the instance before run_users (erasure scrubs them)


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


def _store_buckets(keys, n_store: int) -> set[int]:
    """Store buckets (the tables' N) that hold the users of partition keys `keys` (the scheme's N):
    the buckets b with b mod N_BUCKETS among the keys' buckets when the store's N is a multiple
    of it (the same hash: contracts/buckets.py), else every bucket (then filtered by key)."""
    wanted = {int(k[1:]) for k in keys}
    if n_store % N_BUCKETS:
        return set(range(n_store))
    return {b for b in range(n_store) if b % N_BUCKETS in wanted}


def _data_root(pipeline=None) -> str:
    """The data root of the Delta registry: the pipeline resource's, else QUMEM_DATA_ROOT (the default
    resources' fallback)."""
    if pipeline is not None:
        return pipeline.data_root
    return os.environ.get("QUMEM_DATA_ROOT") or str(Path.cwd() / "data")


def user_registry(pipeline=None):
    """The Delta registry of the bucket scheme (qumem_pipeline/storage/user_registry.py)."""
    from qumem_pipeline.storage.user_registry import UserRegistry

    return UserRegistry(_data_root(pipeline))


def registered_users(instance: dg.DagsterInstance, pipeline=None) -> list[str]:
    """Every registered user: in registration order (`users`: the dynamic partitions), or sorted
    (`user_buckets`: the Delta registry of the pipeline's data root)."""
    if SCHEME == "user_buckets":
        return user_registry(pipeline).users()
    return list(instance.get_dynamic_partitions(USER_REGISTRY))


def register_users(instance: dg.DagsterInstance, users: list[str], pipeline=None,
                   fingerprints: dict[str, str] | None = None, known=None) -> list[str]:
    """Add the users not yet registered; returns those added."""
    if SCHEME == "user_buckets":
        return user_registry(pipeline).register(users, fingerprints, known=known)
    known = set(registered_users(instance)) if known is None else set(known)
    new = [u for u in users if u not in known]
    if new:
        instance.add_dynamic_partitions(USER_REGISTRY, new)
    return new


def register_unforgotten(instance: dg.DagsterInstance, new: list[str], pipeline, fingerprints=None, known=None,
                         planned=()) -> set[str]:
    """Register `new` (as `register_users`), THEN read the forget registry afresh: returns which of
    `new` and `planned` are forgotten, and in the `users` scheme deletes again the partitions this
    call added for them. Why this order: a forget appends its tombstone before it unregisters the
    partition, so either the forget's unregister comes after this add (and removes it), or this
    re-read sees the tombstone; a tick that checked before adding could re-add a forgotten id after
    the forget scrubbed the instance. Planned users forgotten meanwhile are for the caller to drop
    from its runs. (The `user_buckets` registry is a guarded table: its commit drops them itself.)"""
    added = register_users(instance, new, pipeline, fingerprints, known=known)
    forgotten = pipeline.forgotten() if pipeline is not None and hasattr(pipeline, "forgotten") else None
    if forgotten is None or not len(forgotten):
        return set()
    gone = forgotten.among(sorted(set(new) | set(planned)))
    if SCHEME == "users":
        for u in added:
            if u in gone:  # only partitions this call added: no run over them is in flight yet
                instance.delete_dynamic_partition(USER_REGISTRY, u)
    return gone


_IN_CHUNK = 1000


def registered_among(instance: dg.DagsterInstance, users: list[str], pipeline=None) -> set[str]:
    """Which of `users` are registered: the Delta registry's buckets of those users (bucket scheme),
    or an indexed query for just those keys where the instance's event log is Dagster's SQL storage
    (SQLite, PostgreSQL), instead of reading the whole registry."""
    if SCHEME == "user_buckets":
        return user_registry(pipeline).among(users)
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


def users_of_keys(instance: dg.DagsterInstance, keys: list[str], scheme: str = SCHEME, pipeline=None) -> list[str]:
    """Partition keys -> users: the keys themselves, or the registered users in those buckets (the
    registry's files of those buckets only)."""
    if scheme == "users":
        return list(keys)
    reg = user_registry(pipeline)
    wanted = set(keys)
    users = reg.users(_store_buckets(wanted, reg.n_buckets))
    return [u for u in users if partition_key_of(u, scheme) in wanted]


def users_digest(users: list[str]) -> str:
    from qumem_pipeline.storage.user_registry import users_digest as digest

    return digest(users)


def run_tags(users: list[str], digest: str) -> dict[str, str]:
    return {RUN_USERS_TAG: digest, RUN_USERS_COUNT_TAG: str(len(users))}


def store_run_users(instance: dg.DagsterInstance, users: list[str], pipeline=None) -> dict[str, str]:
    """Record a run's exact user list in the data root's `run_users` table (read by every host and
    step pod); returns the tags that point a run at it (the digest: the instance holds no list)."""
    (digest,) = user_registry(pipeline).store_run_users([users])
    return run_tags(users, digest)


def record_materialized(context: dg.AssetExecutionContext, pipeline, fingerprints: dict[str, str]) -> None:
    """Bucket scheme: the run's users' published fingerprints into the Delta registry (what the
    nightly schedule and the sensor compare the archive with). The `users` scheme reads them from
    the event log (assets/planning.py)."""
    if SCHEME == "user_buckets" and fingerprints:
        user_registry(pipeline).record_materialized(fingerprints, context.run.run_id)


def _planned_users(context: dg.AssetExecutionContext, keys: list[str]) -> list[str] | None:
    """The planned users of this run's buckets (the `run_users` files of those buckets only)."""
    digest = context.run.tags.get(RUN_USERS_TAG)
    if not digest:
        return None
    pipeline = getattr(context.resources, "pipeline", None)
    users = planned_users_of(pipeline, digest, keys)
    if not users:
        forgotten = pipeline.forgotten() if pipeline is not None and hasattr(pipeline, "forgotten") else None
        if users is None or not (forgotten is not None and len(forgotten)):
            # a forget (it erases the user from run_users too) is the one way a planned list empties
            raise dg.Failure(f"run tag {RUN_USERS_TAG}={digest} names a user list the data root does not hold "
                             "(table maintenance deletes lists older than its run_users_retention_days): "
                             "plan a new run; the nightly tick plans every user still unmaterialized")
        return []
    return users


def planned_users_of(pipeline, digest: str, keys: list[str]) -> list[str] | None:
    """The users of the run list `digest` in partitions `keys`: the `run_users` files of those buckets
    only (None: no such table)."""
    reg = user_registry(pipeline)
    users = reg.run_users(digest, _store_buckets(keys, reg.n_buckets))
    if users is None:
        return None
    wanted = set(keys)
    return [u for u in users if partition_key_of(u) in wanted]


# run id + partition keys -> that run's users, for the steps of one run executed by one process (the
# in-process executor, `qumem run`): one read of the run's buckets per run instead of one per step.
_run_users_memo: dict[tuple[str, tuple[str, ...]], list[str]] = {}
_RUN_USERS_MEMO_SIZE = 8


def resolve_run_users(context: dg.AssetExecutionContext) -> list[str]:
    """A run's users from its partition keys and tags, before validation and the forgotten check."""
    keys = list(context.partition_keys)
    if SCHEME == "user_buckets":
        planned = _planned_users(context, keys)
        if planned is not None:
            return planned
        return users_of_keys(context.instance, keys, pipeline=getattr(context.resources, "pipeline", None))
    return users_of_keys(context.instance, keys)


def users_for_run(context: dg.AssetExecutionContext) -> list[str]:
    """The users of this run, validated before they become paths or SQL: its partitions' users,
    narrowed to the run's planned users when it names them (bucket scheme)."""
    from qumem_pipeline.contracts.ids import validate_user_id

    memo_key = (context.run.run_id, tuple(context.partition_keys))
    if memo_key in _run_users_memo:
        return not_forgotten(context, _run_users_memo[memo_key])
    users = [validate_user_id(u) for u in resolve_run_users(context)]
    while len(_run_users_memo) >= _RUN_USERS_MEMO_SIZE:
        _run_users_memo.pop(next(iter(_run_users_memo)))
    _run_users_memo[memo_key] = users
    return not_forgotten(context, users)


def not_forgotten(context: dg.AssetExecutionContext, users: list[str]) -> list[str]:
    """`users` less those forgotten as of now (the registry read at each step, never memoized): a
    forget that lands while a run covering the user is going on (`forget_user_job` waits for that
    run before it scrubs the instance) has deleted the user's rows, so a later step would find the
    user's upstream rows missing and fail the whole run. It skips them instead (their commits drop
    them anyway); a forget never fails the run of the other users."""
    pipeline = getattr(context.resources, "pipeline", None)
    forgotten = pipeline.forgotten() if pipeline is not None and hasattr(pipeline, "forgotten") else None
    if forgotten is None or not len(forgotten):
        return list(users)
    gone = [u for u in users if forgotten.contains(u)]
    if gone:
        context.log.info(f"{len(gone)} user(s) of this run were forgotten since it started: skipped")
    return [u for u in users if u not in set(gone)]


run_user_ids = users_for_run  # the name the asset bodies use
