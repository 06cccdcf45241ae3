"""Load the asset modules under a partition scheme (QUMEM_PARTITION_SCHEME is read at import, as
a deployment reads it once), and restore the default afterwards."""

import importlib
import os
from contextlib import contextmanager

# In import order: each module binds the partitions / policy of the modules before it.
ASSET_MODULES = [
    "assets.partitions", "assets.planning", "assets.ingest", "assets.episodes", "assets.memories",
    "assets.retrieval", "assets.adamem", "assets.query_states", "assets.warehouse", "assets.forget",
    "assets.schedules", "assets.sensors", "assets.definitions",
]
SCHEME_ENV = ("QUMEM_PARTITION_SCHEME", "QUMEM_BUCKETS", "QUMEM_USERS_PER_RUN")


def _reload() -> dict:
    return {name: importlib.reload(importlib.import_module(name)) for name in ASSET_MODULES}


@contextmanager
def partition_scheme(scheme: str, buckets: int | None = None, users_per_run: int | None = None):
    """Yields {module name: module} loaded with `scheme`; every later import sees the default again."""
    saved = {k: os.environ.get(k) for k in SCHEME_ENV}
    os.environ["QUMEM_PARTITION_SCHEME"] = scheme
    for key, value in (("QUMEM_BUCKETS", buckets), ("QUMEM_USERS_PER_RUN", users_per_run)):
        if value is not None:
            os.environ[key] = str(value)
    try:
        yield _reload()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _reload()
