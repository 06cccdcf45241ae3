"""The memories stage for one run: every episode of the run users decomposed into typed memories by the
LLM, every finished call checkpointed, with the blocking checks on the rows it would write.

`run_memories` is what the `memories` asset calls (assets/memories.py). `checkpointed_llm` wraps a
backend for the other LLM stages (persona profiles, query states) the same way.
"""

import os
import time
from collections.abc import Callable
from datetime import datetime, timezone

import polars as pl

from qumem_pipeline.contracts import checks
from qumem_pipeline.contracts.stage_run import StageFailed, StageRun
from qumem_pipeline.llm.base import LLMError
from qumem_pipeline.memories.call_ledger import CheckpointedLLM
from qumem_pipeline.memories.checkpoints import CheckpointStore
from qumem_pipeline.memories.decompose import PROMPT_VERSION, decompose_episodes
from qumem_pipeline.runtime.progress import ProgressLine

# Finished LLM calls are checkpointed as they finish, written at least every this many seconds / calls.
CHECKPOINT_FLUSH_S = float(os.environ.get("QUMEM_CHECKPOINT_FLUSH_S", "1.0"))
CHECKPOINT_FLUSH_CALLS = int(os.environ.get("QUMEM_CHECKPOINT_FLUSH_CALLS", "64"))


def checkpointed_llm(layout, tables: tuple[str, str], backend, *, code_version: str, prompt_version: str,
                     created_at: datetime) -> CheckpointedLLM:
    """`backend` with every call checkpointed per user in `tables[0]` and ledgered (`call_ledger`)."""
    store = CheckpointStore(layout, table=tables[0]).set_flush_policy(CHECKPOINT_FLUSH_S, CHECKPOINT_FLUSH_CALLS)
    return CheckpointedLLM(backend, store, code_version=code_version, prompt_version=prompt_version,
                           created_at=created_at)


def episodes_with_turns(turns: pl.DataFrame, eps: pl.DataFrame) -> list[dict]:
    """The decomposer's input: each episode with its turns (assistant replies included)."""
    by_index = {r["turn_index"]: r for r in turns.iter_rows(named=True)}
    return [{"user_id": e["user_id"], "episode_id": e["episode_id"], "turns": [by_index[t] for t in e["turn_ids"]]}
            for e in eps.iter_rows(named=True)]


def read_inputs(layout, users: list[str]) -> tuple[list[dict], pl.DataFrame, pl.DataFrame]:
    """(episodes with their turns, every episode's turn ids, every current (user_id, turn_index)) of the run
    users, one read per table. A user with no turns (their source files were withdrawn) has present, empty
    turns and episodes: no inputs, and publishing writes them empty in every memories table."""
    inputs, all_eps, all_turns = [], [], []
    turns_of, eps_of = layout.read_users("turns", users), layout.read_users("episodes", users)
    for u in users:
        turns_df, eps_df = turns_of.get(u), eps_of.get(u)
        if turns_df is None or eps_df is None:
            raise StageFailed(f"user {u}: materialize `turns` and `episodes` first")
        stale = set(eps_df["turn_ids"].explode().drop_nulls().to_list()) - set(turns_df["turn_index"].to_list()) \
            if eps_df.height else set()
        if stale:
            raise StageFailed(f"user {u}: episodes cite {len(stale)} turns that are no longer in `turns` "
                              "(the archive changed since): materialize `episodes` first")
        inputs.extend(episodes_with_turns(turns_df, eps_df))
        all_eps.append(eps_df.select("episode_id", "turn_ids"))
        all_turns.append(turns_df.select(pl.lit(u).alias("user_id"), pl.col("turn_index").cast(pl.Int64)))
    eps = pl.concat(all_eps) if all_eps else pl.DataFrame(schema={"episode_id": pl.String, "turn_ids": pl.List(pl.Int64)})
    turns_now = pl.concat(all_turns) if all_turns else pl.DataFrame(schema={"user_id": pl.String, "turn_index": pl.Int64})
    return inputs, eps, turns_now


def run_memories(layout, users: list[str], backend, *, max_tokens: int, log: Callable[[str], None],
                 progress: ProgressLine) -> StageRun:
    """Decompose the run users' episodes (every call checkpointed; a rerun pays for no finished call)."""
    inputs, eps, turns_now = read_inputs(layout, users)
    log(f"decomposing {len(inputs)} episodes of {len(users)} users ({3 * len(inputs)} LLM calls)")
    t_llm = time.perf_counter()
    store = CheckpointStore(layout).set_flush_policy(CHECKPOINT_FLUSH_S, CHECKPOINT_FLUSH_CALLS)
    try:
        with progress:
            out = decompose_episodes(inputs, backend, created_at=datetime.now(timezone.utc), max_tokens=max_tokens,
                                     checkpoint=store, progress=progress)
    except LLMError as exc:
        saved = len(getattr(exc, "finished_outcomes", None) or [])
        raise StageFailed(f"{exc} Finished LLM calls are checkpointed under {store.layout.table_dir('memory_checkpoints')} "
                          f"({saved} finished in this run); rerun the same users once the endpoint is back and only the "
                          "missing calls are sent.") from exc
    llm_s = time.perf_counter() - t_llm

    def publish():  # one transaction per table for all of the run's users
        layout.replace_users("memories", users, out.memories)
        layout.replace_users("llm_ledger", users, out.ledger)
        layout.replace_or_remove_users("memory_quarantine", users, out.quarantine)
        store.compact_users({u: out.call_keys_by_user.get(u, set()) for u in users})

    outcomes = {"evidence_inside_episode": checks.evidence_inside_episodes(out.memories, eps),
                "evidence_turns_exist": checks.evidence_turns_exist(out.memories, turns_now)}
    s = out.summary
    log(f"decomposed {len(inputs)} episodes: {s['llm_calls']} LLM calls in {llm_s:.1f}s "
        f"({s['llm_calls'] / max(llm_s, 1e-9):.1f} calls/s, {s['completion_tokens'] / max(llm_s, 1e-9):.0f} completion tok/s)")
    return StageRun(outcomes, publish, _metadata(users, inputs, out, llm_s, backend))


def _metadata(users, inputs, out, llm_s: float, backend) -> dict:
    s = out.summary
    return {
        "users": len(users),
        "episodes": len(inputs),
        "dagster/row_count": out.memories.height,
        "memories_by_type": dict(out.memories.group_by("type").len().rows()) if out.memories.height else {},
        "llm_calls": s["llm_calls"],
        "llm_calls_reused_from_checkpoint": out.stats.reused_calls,
        "quarantined_calls": out.quarantine.height,
        "calls_per_100_turns": round(s["calls_per_100_turns"], 2),
        "prompt_tokens_per_turn": round(s["prompt_tokens_per_turn"], 1),
        "completion_tokens_per_turn": round(s["completion_tokens_per_turn"], 1),
        "prompt_tokens": s["prompt_tokens"],  # run totals from the token ledger
        "completion_tokens": s["completion_tokens"],
        "llm_seconds": round(llm_s, 3),
        "completion_tokens_per_s": round(s["completion_tokens"] / llm_s, 1) if llm_s > 0 else 0.0,
        "prefill_saved_by_prefix_cache": round(s["prefill_saved_fraction"], 3),
        "evidence_ids_dropped": out.stats.evidence_ids_dropped,
        "duplicates_collapsed": out.stats.duplicates_collapsed,
        "model": backend.model_name,
        "backend": backend.backend_name,
        "prompt_version": PROMPT_VERSION,
    }
