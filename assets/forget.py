import dagster as dg

from assets.partitions import USER_REGISTRY
from qumem_pipeline.storage.forget import forget_user
from qumem_pipeline.contracts.ids import validate_user_id
from resources import PipelineConfig


class ForgetConfig(dg.Config):
    user_id: str


@dg.op(pool="warehouse", description="Delete a user from every table, index file and the warehouse, and its partition.")
def forget_user_op(context: dg.OpExecutionContext, config: ForgetConfig, pipeline: PipelineConfig) -> dg.Output:
    user_id = validate_user_id(config.user_id)
    report = forget_user(pipeline.data_root, pipeline.warehouse().path, user_id)
    if context.instance.has_dynamic_partition(USER_REGISTRY, user_id):
        context.instance.delete_dynamic_partition(USER_REGISTRY, user_id)
    # Counts only: user content never goes into Dagster's event log.
    return dg.Output(
        None,
        metadata={
            "removed_dirs": len(report["removed_dirs"]),
            "warehouse_rows_deleted": dg.MetadataValue.json(report["warehouse_rows_deleted"]),
        },
    )


@dg.job(description="Forget one user everywhere (GDPR-style erasure). Config: ops.forget_user_op.config.user_id")
def forget_user_job():
    forget_user_op()
