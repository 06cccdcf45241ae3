"""Local scale-out: every step of a run in its own process, up to QUMEM_MAX_CONCURRENT at once.

    dagster dev -m deploy.multiprocess                       # UI, runs use this executor
    dagster job execute -m deploy.multiprocess -j ingest_job  # one run from the shell

The `gpu` and `warehouse` pools (dagster.yaml) still hold GPU steps and the DuckDB writer to one at
a time across processes; what runs side by side is CPU work of different assets. Each step process
loads its own models, so the in-process default stays better for small runs on one machine.
"""

import os

import dagster as dg

from assets.definitions import build_definitions

MAX_CONCURRENT = int(os.environ.get("QUMEM_MAX_CONCURRENT", "2"))

executor = dg.multiprocess_executor.configured({"max_concurrent": MAX_CONCURRENT}, name="qumem_multiprocess")
defs = build_definitions(executor=executor)


def job(name: str) -> dg.JobDefinition:
    """A job of these definitions, for `dg.build_reconstructable_job("deploy.multiprocess", "job", (name,))`:
    every step process re-imports this module and calls this to find its job."""
    return defs.resolve_job_def(name)
