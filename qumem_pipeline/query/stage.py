"""The query-states stage for one run: the run users' personalization queries answered by the configured
strategy (A1 needs -> A2 plan -> retrieval <= as_of -> A3 state, each stage batched over all queries), every
LLM call checkpointed and ledgered, with the blocking checks on the rows it would write.

`run_query_states` is what the `query_states` asset calls (assets/query_states.py); the LLM backend and the
embedder are handed in (loaded once per process by the orchestrator's resources).
"""

from collections.abc import Callable
from datetime import datetime, timezone

import polars as pl

from qumem_pipeline.contracts import checks
from qumem_pipeline.contracts.stage_run import StageFailed, StageRun
from qumem_pipeline.llm.base import LLMError
from qumem_pipeline.memories.call_ledger import QUERY_TABLES
from qumem_pipeline.memories.stage import checkpointed_llm
from qumem_pipeline.query.queries import read_queries, to_queries
from qumem_pipeline.query.retrievers import MissingUpstream, retriever_for
from qumem_pipeline.query.strategies.registry import get_strategy
from qumem_pipeline.query.version import stage_version
from qumem_pipeline.runtime.progress import ProgressLine, llm_call_progress

CHECKS = ("no_citation_after_as_of", "evidence_turns_exist")


def no_queries(layout, users: list[str]) -> StageRun:
    """No queries file configured: the run users' states and ledger rows are removed, the checks pass."""
    def publish():
        layout.replace_or_remove_users("query_states", users, pl.DataFrame(schema={"user_id": pl.String}))
        layout.replace_or_remove_users(QUERY_TABLES[1], users, pl.DataFrame(schema={"user_id": pl.String}))

    return StageRun({n: checks.CheckOutcome(True, "no queries") for n in CHECKS}, publish,
                    {"queries": 0, "note": "no queries_path configured"})


def run_query_states(layout, users: list[str], *, queries_path: str | None, strategy_name: str, retrieval_k: int,
                     respond: bool, backend, embedder, log: Callable[[str], None],
                     progress_for: Callable[[str], ProgressLine]) -> StageRun:
    """Answer the run users' queries from their current memories (see the module doc). A user with no turns
    (their source files were withdrawn) has no history to answer from: their queries get no state, and
    publishing removes the states and quarantine rows they had. Memories citing turns that no longer exist
    build no state (nor pay an LLM call) and publish nothing."""
    if not queries_path:
        return no_queries(layout, users)
    valid, bad = read_queries(queries_path)
    valid = valid.filter(pl.col("user_id").is_in(users))
    held = layout.read_users("turns", users)  # one read for the run; None: never written
    turns_by_user = {u: held.get(u) for u in users}
    no_history = [u for u, t in turns_by_user.items() if t is not None and t.height == 0]
    queries = to_queries(valid, {u: t for u, t in turns_by_user.items() if t is not None and t.height})
    mems = layout.read_table("memories", users)
    if mems is None:
        raise StageFailed("materialize `memories` first")
    have = [t.select("user_id", "turn_index") for t in turns_by_user.values() if t is not None and t.height]
    evidence = checks.evidence_turns_exist(mems, pl.concat(have) if have else pl.DataFrame(
        schema={"user_id": pl.String, "turn_index": pl.Int64}))
    if not evidence.passed:  # a stale memory set: no state is built from it (nor LLM call paid), none published
        nothing = checks.CheckOutcome(True, "no states built: the memories cite turns that no longer exist", {"violations": 0})
        return StageRun({"no_citation_after_as_of": nothing, "evidence_turns_exist": evidence}, lambda: None,
                        {"queries": len(queries), "blocked_by": "evidence_turns_exist"})
    strategy = get_strategy(strategy_name)
    try:
        retriever = retriever_for(strategy, layout, [u for u in users if u not in no_history], turns_by_user, mems,
                                  embedder)
    except MissingUpstream as exc:
        raise StageFailed(str(exc)) from exc
    created_at = datetime.now(timezone.utc)
    # every A1/A2/A3/answer call checkpointed per user and ledgered: a rerun pays for no finished call
    calls = checkpointed_llm(layout, QUERY_TABLES, backend, code_version=stage_version("query_states"),
                             prompt_version=strategy.version, created_at=created_at)
    progress = progress_for(f"user states for {len(queries)} queries")
    out = _infer(strategy, queries, calls, retriever, progress, log, created_at=created_at, respond=respond,
                 k=strategy.default_k if strategy.default_k is not None else retrieval_k)

    def publish():
        layout.replace_or_remove_users("query_states", users, out.states)
        layout.replace_or_remove_users("query_quarantine", users, out.quarantine)
        layout.replace_or_remove_users(QUERY_TABLES[1], users, calls.ledger())
        calls.compact(users)

    s = calls.summary()
    return StageRun({"no_citation_after_as_of": checks.no_future_citations(out.states, mems),
                     "evidence_turns_exist": evidence}, publish, {
        "queries": len(queries), "dagster/row_count": out.states.height, "strategy": strategy_name,
        "input_rows_quarantined": bad.height,
        "queries_of_users_without_turns": valid.filter(pl.col("user_id").is_in(no_history)).height,
        **{k: v for k, v in out.stats.items() if isinstance(v, (int, float))},
        "llm_calls": s["llm_calls"], "llm_calls_sent": s["llm_calls_sent"],
        "llm_calls_reused_from_checkpoint": s["llm_calls_replayed"], "tokens_by_stage": s["tokens_by_stage"],
        "model": backend.model_name, "prompt_version": strategy.version,
    })


def _infer(strategy, queries, calls, retriever, progress: ProgressLine, log, **kw):
    """The strategy's stage-batched inference; each agent's batch reports per finished call, the heartbeat
    covers retrieval and long batches. An LLM failure names where the finished calls are checkpointed."""
    def stage_done(stage: str, done: int, total: int) -> None:
        log(f"{stage} done ({done}/{total} queries)")
        progress.stage(f"next stage after {stage}")

    calls.progress = llm_call_progress(progress)
    try:
        with progress:
            return strategy.infer(queries, calls, retriever, progress=stage_done, **kw)
    except LLMError as exc:
        raise StageFailed(
            f"{exc} Finished LLM calls are checkpointed under {calls.store.layout.table_dir(calls.store.table)} "
            f"({calls.sent} answered in this run, {calls.replayed} replayed); rerun the same users once the endpoint "
            "is back and only the missing calls are sent.") from exc
