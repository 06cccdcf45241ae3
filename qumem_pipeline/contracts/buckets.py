"""Stable user → bucket mapping shared by the table store's physical layout and the `user_buckets`
partition scheme.

Why a hand-rolled hash: polars' and Python's built-in hashes are seeded or version-dependent, and a
bucket is fixed for a table's life, so the mapping must be the same in every process and release.
"""

import hashlib
import os

DEFAULT_BUCKETS = 64
BUCKETS_ENV = "QUMEM_BUCKETS"  # the one bucket count: the table store's N and the user_buckets partitions
OLD_BUCKETS_ENV = "QUMEM_USER_BUCKETS"  # the table store's earlier name for the same count


class BucketCountConflict(ValueError):
    """QUMEM_BUCKETS and QUMEM_USER_BUCKETS are both set and disagree."""


def configured_buckets(environ=None) -> int | None:
    """The deployment's one user-bucket count: `QUMEM_BUCKETS` (`QUMEM_USER_BUCKETS`, its earlier name,
    is still read and must agree with it: the table store and the `user_buckets` partitions hash users with
    the same N); None when neither is set (new tables get DEFAULT_BUCKETS, existing ones keep theirs)."""
    env = os.environ if environ is None else environ
    new, old = env.get(BUCKETS_ENV) or None, env.get(OLD_BUCKETS_ENV) or None
    try:
        values = {name: int(v) for name, v in ((BUCKETS_ENV, new), (OLD_BUCKETS_ENV, old)) if v is not None}
    except ValueError:
        raise BucketCountConflict(f"{BUCKETS_ENV}={new!r} / {OLD_BUCKETS_ENV}={old!r}: a bucket count is a whole number") from None
    if len(set(values.values())) > 1:
        raise BucketCountConflict(f"{BUCKETS_ENV}={new} and {OLD_BUCKETS_ENV}={old} disagree: one bucket count serves the "
                                  f"table store and the user_buckets partitions; set {BUCKETS_ENV} only")
    n = next(iter(values.values()), None)
    if n is not None and n < 1:
        raise BucketCountConflict(f"{BUCKETS_ENV}={n}: the bucket count must be >= 1")
    return n


def user_bucket(user_id: str, n_buckets: int = DEFAULT_BUCKETS) -> int:
    """Bucket of `user_id` among `n_buckets`: the first 8 bytes of blake2b(user_id), mod n."""
    if n_buckets < 1:
        raise ValueError(f"n_buckets must be >= 1, got {n_buckets}")
    digest = hashlib.blake2b(user_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % n_buckets


def bucket_key(bucket: int, n_buckets: int = DEFAULT_BUCKETS) -> str:
    """Partition-key form of a bucket, zero-padded so keys sort in bucket order (`b007`)."""
    width = max(3, len(str(n_buckets - 1)))
    return f"b{bucket:0{width}d}"
