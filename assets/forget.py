"""`forget_user_job`: erase a user from the data root, every warehouse and the Dagster instance.

The data part is linearizable with concurrent runs by the store's own transactions
(`qumem_pipeline/storage/forget.py`); it needs no waiting. The instance part waits for in-flight
runs that cover the user (their range or bucket) to end before it unregisters the partition and
scrubs the records: deleting a dynamic partition under a running range makes Dagster fail the
whole run ("Partition range ... is not a valid range"), and a run still going would record the
partition again. Those runs can no longer write the user (every commit drops forgotten users),
and the planned user lists are rewritten without the user first so their later steps skip them.
"""

import os
import time

import dagster as dg

from assets.erasure import rewrite_run_user_lists, scrub_instance
from assets.partitions import (SCHEME, USER_REGISTRY, bucket_partition_keys, partition_key_of, registered_users)
from qumem_pipeline.contracts.ids import validate_user_id
from qumem_pipeline.ingest.sync import key_forgotten_files
from qumem_pipeline.storage.forget import forget_user
from resources import PipelineConfig

RUN_WAIT_S = float(os.environ.get("QUMEM_FORGET_RUN_WAIT_S", "3600"))
_IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
              dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


class ForgetConfig(dg.Config):
    user_id: str


def runs_covering(instance: dg.DagsterInstance, user_id: str, exclude: str | None = None) -> list[str]:
    """In-flight runs whose partition or partition range holds the user (or the user's bucket)."""
    key = partition_key_of(user_id)
    order = registered_users(instance) if SCHEME == "users" else bucket_partition_keys()
    pos = {k: i for i, k in enumerate(order)}
    out = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=_IN_FLIGHT)):
        if run.run_id == exclude:
            continue
        tags = run.tags
        if tags.get("dagster/partition") == key:
            out.append(run.run_id)
            continue
        start, end = tags.get("dagster/asset_partition_range_start"), tags.get("dagster/asset_partition_range_end")
        if start is None or end is None:
            continue
        if key in (start, end) or (key in pos and start in pos and end in pos and pos[start] <= pos[key] <= pos[end]):
            out.append(run.run_id)
        elif key not in pos or start not in pos or end not in pos:
            out.append(run.run_id)  # cannot tell: wait rather than break it
    return out


def wait_for_runs(instance: dg.DagsterInstance, user_id: str, exclude: str | None, log) -> None:
    deadline, waited = time.monotonic() + RUN_WAIT_S, False
    while True:
        covering = runs_covering(instance, user_id, exclude)
        if not covering:
            return
        if time.monotonic() > deadline:
            raise dg.Failure(f"forget: {len(covering)} run(s) covering the user still in flight after {RUN_WAIT_S:.0f}s "
                             f"({', '.join(covering[:5])}); the data is erased, rerun the forget to finish the instance")
        if not waited:
            log.info(f"forget: data erased; waiting for {len(covering)} in-flight run(s) over the user's partition")
            waited = True
        time.sleep(1.0)


@dg.op(pool="warehouse", description="Delete a user from every table, log, index file and warehouse.")
def forget_user_op(context: dg.OpExecutionContext, config: ForgetConfig, pipeline: PipelineConfig) -> dg.Output:
    user_id = validate_user_id(config.user_id)
    # configured warehouse: only when set explicitly or local (an object-store root's default is the cwd)
    configured = pipeline.warehouse().path if (pipeline.warehouse_path or "://" not in pipeline.data_root) else None
    report = forget_user(pipeline.data_root, configured, user_id)
    # the ingest manifest names files by path: those of users all forgotten are keyed (ingest/manifest.py)
    keyed = key_forgotten_files(pipeline.layout())
    # Counts only: user content and ids never go into Dagster's event log.
    return dg.Output(
        True,
        metadata={
            "tables": len(report["tables"]),
            "rows_deleted": sum(report["rows_deleted"].values()),
            "files_removed": sum(report["files_removed"].values()),
            "log_files_rewritten": sum(report["log_files_rewritten"].values()),
            "warehouses": len(report["warehouse_rows_deleted"]),
            "warehouse_rows_deleted": sum(sum(v.values()) for v in report["warehouse_rows_deleted"].values()),
            "manifest_files_keyed": keyed,
        },
    )


@dg.op(description="Unregister the user and scrub the instance once no in-flight run covers them. "
       "Outside the warehouse pool: it may wait for runs whose warehouse step needs that pool.")
def forget_instance_op(context: dg.OpExecutionContext, erased) -> dg.Output:
    user_id = validate_user_id(context.run_config["ops"]["forget_user_op"]["config"]["user_id"])
    lists = rewrite_run_user_lists(context.instance, user_id)
    wait_for_runs(context.instance, user_id, context.run_id, context.log)
    if context.instance.has_dynamic_partition(USER_REGISTRY, user_id):
        context.instance.delete_dynamic_partition(USER_REGISTRY, user_id)
    scrubbed = scrub_instance(context.instance, user_id)
    return dg.Output(None, metadata={"run_user_lists_rewritten": lists, "instance_rows_deleted": scrubbed["deleted"],
                                     "instance_values_redacted": scrubbed["redacted"]})


@dg.job(description="Forget one user everywhere (GDPR-style erasure). Config: ops.forget_user_op.config.user_id",
        executor_def=dg.in_process_executor)
def forget_user_job():
    forget_instance_op(forget_user_op())
