import time

import dagster as dg

from assets.adamem import memory_graph
from assets.check_results import materialize, no_users_result
from assets.ingest import turns
from assets.partitions import run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger
from assets.retrieval import memory_indexes
from assets.versions import code_version
from qumem_pipeline.contracts.stage_run import StageFailed
from qumem_pipeline.query.stage import run_query_states
from qumem_pipeline.runtime.faults import fault_point
from resources import PipelineConfig
from resources.models import EmbedderResource, LLMResource


@dg.asset(
    partitions_def=users_partitions,
    backfill_policy=user_backfill_policy,
    deps=[memory_indexes, turns, memory_graph],
    pool="gpu",
    code_version=code_version("query_states"),  # source + prompts + LLM + embedder + upstream
    group_name="personalization",
    kinds={"parquet"},
    description="Query-conditioned user states Z_q for the run's personalization queries "
    "(A1 needs -> A2 plan -> retrieval <= as_of -> A3 state), each stage batched over all queries.",
    check_specs=[dg.AssetCheckSpec("no_citation_after_as_of", asset="query_states", blocking=True),
                 dg.AssetCheckSpec("evidence_turns_exist", asset="query_states", blocking=True,
                                   description="The memories the states draw on cite only turns that still exist.")],
)
def query_states(
    context: dg.AssetExecutionContext, pipeline: PipelineConfig, llm: LLMResource, embedder: EmbedderResource
) -> dg.MaterializeResult:
    """The run users' queries answered by the configured strategy (qumem_pipeline/query/stage.py)."""
    users, t0 = run_user_ids(context), time.perf_counter()
    if not users:
        return no_users_result(context)
    try:
        run = run_query_states(
            pipeline.layout(), users, queries_path=pipeline.queries_path, strategy_name=pipeline.query_strategy,
            retrieval_k=pipeline.retrieval_k, respond=pipeline.respond, backend=llm.backend,
            embedder=embedder.model, log=context.log.info,
            progress_for=lambda label: ProgressLogger(context.log, label))
    except StageFailed as exc:
        raise dg.Failure(description=str(exc)) from exc
    result = materialize(context, run, "query_states", t0)
    # interleaving tests: the last step before `warehouse` has committed. (Not inside the warehouse step: a
    # forget's data op shares its pool, so it waits for that step instead of landing inside it.)
    fault_point("query_states.committed")
    return result
