"""Stable user → bucket mapping shared by the table store's physical layout and the `user_buckets`
partition scheme.

Why a hand-rolled hash: polars' and Python's built-in hashes are seeded or version-dependent, and a
bucket is fixed for a table's life, so the mapping must be the same in every process and release.
"""

import hashlib

DEFAULT_BUCKETS = 64


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
