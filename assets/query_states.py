import time
from datetime import datetime, timezone

import dagster as dg
import polars as pl

from assets.ingest import turns
from assets.check_results import gate, no_users_result
from assets.partitions import run_user_ids, user_backfill_policy, users_partitions
from assets.progress import ProgressLogger, llm_call_progress
from assets.adamem import memory_graph
from assets.llm_calls import checkpointed_llm, ledger_metadata, llm_failure
from assets.retrieval import memory_indexes
from qumem_pipeline.contracts import checks
from qumem_pipeline.runtime.faults import fault_point
from qumem_pipeline.llm.base import LLMError
from qumem_pipeline.memories.call_ledger import QUERY_TABLES
from qumem_pipeline.query.queries import read_queries, to_queries
from qumem_pipeline.query.retrievers import MissingUpstream, retriever_for
from qumem_pipeline.query.strategies.registry import get_strategy
from assets.versions import code_version, version_metadata
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
    users = run_user_ids(context)
    if not users:
        return no_users_result(context)
    layout = pipeline.layout()
    t0 = time.perf_counter()
    if not pipeline.queries_path:
        layout.replace_or_remove_users("query_states", users, pl.DataFrame(schema={"user_id": pl.String}))
        layout.replace_or_remove_users(QUERY_TABLES[1], users, pl.DataFrame(schema={"user_id": pl.String}))
        return dg.MaterializeResult(
            metadata={"queries": 0, "note": "no queries_path configured"},
            check_results=[dg.AssetCheckResult(check_name=n, passed=True, description="no queries")
                           for n in ("no_citation_after_as_of", "evidence_turns_exist")],
        )
    valid, bad = read_queries(pipeline.queries_path)
    valid = valid.filter(pl.col("user_id").is_in(users))
    held = layout.read_users("turns", users)  # one read for the run; None: never written
    turns_by_user = {u: held.get(u) for u in users}
    # A user with no turns (their source files were withdrawn) has no history to answer from: their
    # queries get no state, and publishing removes the states and quarantine rows they had.
    no_history = [u for u, t in turns_by_user.items() if t is not None and t.height == 0]
    queries = to_queries(valid, {u: t for u, t in turns_by_user.items() if t is not None and t.height})
    mems = layout.read_table("memories", users)
    if mems is None:
        raise dg.Failure("materialize `memories` first")
    have = [t.select("user_id", "turn_index") for t in turns_by_user.values() if t is not None and t.height]
    evidence = checks.evidence_turns_exist(mems, pl.concat(have) if have else pl.DataFrame(
        schema={"user_id": pl.String, "turn_index": pl.Int64}))
    if not evidence.passed:  # a stale memory set: no state is built from it (nor LLM call paid), none published
        nothing = checks.CheckOutcome(True, "no states built: the memories cite turns that no longer exist", {"violations": 0})
        check_results, _ = gate(context, {"no_citation_after_as_of": nothing, "evidence_turns_exist": evidence}, lambda: None)
        return dg.MaterializeResult(check_results=check_results, metadata={
            "queries": len(queries), "blocked_by": "evidence_turns_exist", "seconds": round(time.perf_counter() - t0, 3),
            **version_metadata("query_states")})
    strategy = get_strategy(pipeline.query_strategy)
    try:
        retriever = retriever_for(strategy, layout, [u for u in users if u not in no_history], turns_by_user, mems,
                                  embedder.model)
    except MissingUpstream as exc:
        raise dg.Failure(str(exc)) from exc
    k = strategy.default_k if strategy.default_k is not None else pipeline.retrieval_k
    progress = ProgressLogger(context.log, f"user states for {len(queries)} queries")
    created_at = datetime.now(timezone.utc)
    # every A1/A2/A3/answer call checkpointed per user and ledgered: a rerun pays for no finished call
    calls = checkpointed_llm(layout, QUERY_TABLES, llm.backend, "query_states", strategy.version, created_at)
    # each agent's batch reports per finished call; the heartbeat covers retrieval and long batches
    calls.progress = llm_call_progress(progress)

    def stage_done(stage: str, done: int, total: int) -> None:
        context.log.info(f"{stage} done ({done}/{total} queries)")
        progress.stage(f"next stage after {stage}")

    try:
        with progress:
            out = strategy.infer(queries, calls, retriever, k=k, respond=pipeline.respond, created_at=created_at,
                                 progress=stage_done)
    except LLMError as exc:
        raise llm_failure(exc, calls) from exc
    future = checks.no_future_citations(out.states, mems)

    def publish():
        layout.replace_or_remove_users("query_states", users, out.states)
        layout.replace_or_remove_users("query_quarantine", users, out.quarantine)
        layout.replace_or_remove_users(QUERY_TABLES[1], users, calls.ledger())
        calls.compact(users)

    check_results, _ = gate(context, {"no_citation_after_as_of": future, "evidence_turns_exist": evidence}, publish)
    # interleaving tests: the last step before `warehouse` has committed. (Not inside the warehouse step: a
    # forget's data op shares its pool, so it waits for that step instead of landing inside it.)
    fault_point("query_states.committed")
    return dg.MaterializeResult(
        check_results=check_results,
        metadata={
            "queries": len(queries), "dagster/row_count": out.states.height, "strategy": pipeline.query_strategy,
            "input_rows_quarantined": bad.height,
            "queries_of_users_without_turns": valid.filter(pl.col("user_id").is_in(no_history)).height,
            **{k: v for k, v in out.stats.items() if isinstance(v, (int, float))},
            **ledger_metadata(calls),
            "model": llm.backend.model_name, "prompt_version": strategy.version,
            "seconds": round(time.perf_counter() - t0, 3), **version_metadata("query_states"),
        },
    )
