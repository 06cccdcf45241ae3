import time

import dagster as dg

from assets.check_results import materialize, no_users_result
from assets.episodes import episodes
from assets.partitions import run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger
from assets.versions import code_version
from qumem_pipeline.contracts.stage_run import StageFailed
from qumem_pipeline.memories.stage import run_memories
from resources import PipelineConfig
from resources.models import LLMResource


@dg.asset(
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    deps=[episodes],
    pool="gpu",
    code_version=code_version("memories"),  # source + prompt + LLM model id + upstream
    group_name="memories",
    kinds={"parquet"},
    description="Typed memories (fact / preference / insight) per episode, with evidence turn ids, "
    "plus the LLM quarantine and the token ledger.",
    check_specs=[dg.AssetCheckSpec("evidence_inside_episode", asset="memories", blocking=True),
                 dg.AssetCheckSpec("evidence_turns_exist", asset="memories", blocking=True,
                                   description="Every evidence turn is one of the user's current turns.")],
)
def memories(context: dg.AssetExecutionContext, pipeline: PipelineConfig, llm: LLMResource) -> dg.MaterializeResult:
    """The run users' episodes decomposed into typed memories (qumem_pipeline/memories/stage.py)."""
    users, t0 = run_user_ids(context), time.perf_counter()
    if not users:
        return no_users_result(context)
    try:
        run = run_memories(pipeline.layout(), users, llm.backend, max_tokens=llm.max_tokens, log=context.log.info,
                           progress=ProgressLogger(context.log, "LLM calls (checkpointed)"))
    except StageFailed as exc:
        raise dg.Failure(description=str(exc)) from exc
    return materialize(context, run, "memories", t0)
