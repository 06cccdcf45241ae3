"""Users are dynamic partitions; every partitioned asset shares one backfill policy.

Dagster uses the smallest max_partitions_per_run across a selection, so all assets must
carry the same policy or a backfill silently degrades to one user per run.
"""

import os
import warnings

import dagster as dg

# backfill_policy is marked beta; it is exactly the feature many-users-per-run relies on.
warnings.filterwarnings("ignore", category=dg.BetaWarning)

users_partitions = dg.DynamicPartitionsDefinition(name="users")

USERS_PER_RUN = int(os.environ.get("QUMEM_USERS_PER_RUN", "50"))
user_backfill_policy = dg.BackfillPolicy.multi_run(max_partitions_per_run=USERS_PER_RUN)


def run_user_ids(context: dg.AssetExecutionContext) -> list[str]:
    """The users of this run (one partition, or a range), validated before they become paths or SQL."""
    from qumem_pipeline.contracts.ids import validate_user_id

    return [validate_user_id(k) for k in context.partition_keys]
