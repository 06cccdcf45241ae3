"""The episodes stage for one run: the run users' turns segmented into episodes by the continuity
classifier, with the blocking checks on the rows it would write.

`run_episodes` is what the `episodes` asset calls (assets/episodes.py); the classifier is handed in
(loaded once per process by the orchestrator's resource).
"""

import time
from collections.abc import Callable

import polars as pl

from qumem_pipeline.contracts import checks
from qumem_pipeline.contracts.stage_run import StageFailed, StageRun
from qumem_pipeline.episodes.segmentation import EPISODE_SCHEMA, build_episodes_for_users
from qumem_pipeline.runtime.progress import ProgressLine


def run_episodes(layout, users: list[str], model, *, batch_size: int, token_budget: int,
                 skip_forgotten: Callable[[list[str]], list[str]], progress: ProgressLine) -> StageRun | None:
    """Segment the run users' turns (one read for all of them) into episodes. A user without turns is
    an error (`turns` not materialized) unless `skip_forgotten` drops them (a forget that landed inside
    this step); None when no user is left."""
    turns_by_user = layout.read_users("turns", users)  # a read per user opens the Delta table once per user
    missing = skip_forgotten([u for u in users if u not in turns_by_user])
    if missing:
        raise StageFailed(f"no turns for user {missing[0]} ({len(missing)} users): materialize `turns` first")
    users = [u for u in users if u in turns_by_user]
    if not users:
        return None
    t1 = time.perf_counter()
    with progress:
        by_user, stats = build_episodes_for_users(
            turns_by_user,
            lambda pairs: model.predict_same_proba(pairs, batch_size=batch_size),
            rule=model.rule,
            similarity=model.pair_cosine,  # used only when the rule reads the cosine
            embed_histories=model.history_embeddings,  # used only when the rule has block features
            classifier_version=model.version,
            token_budget=token_budget,
            progress=progress,  # pairs done / all, after each user (each user's pairs are calls of their own)
        )
    classify_s = time.perf_counter() - t1
    sizes = [n for df in by_user.values() for n in df["n_turns"].to_list()]
    outcomes = {
        "every_turn_in_one_nonempty_episode": checks.episodes_cover_turns(turns_by_user, by_user),
        "schema_conforms": checks.schema_conforms(
            next(iter(by_user.values())) if by_user else pl.DataFrame(schema=EPISODE_SCHEMA), EPISODE_SCHEMA, "episodes"),
    }
    return StageRun(outcomes, lambda: layout.replace_parts("episodes", by_user), {
        "users": stats.users,
        "dagster/row_count": stats.episodes,
        "user_utterances": stats.user_utterances,
        "classifier_decisions": stats.decisions,
        "forced_splits": stats.forced_splits,
        "session_breaks": stats.session_breaks,
        "oversize_single_units": stats.oversize_single_units,
        "mean_turns_per_episode": round(sum(sizes) / len(sizes), 2) if sizes else 0.0,
        "pairs_per_s": round(stats.decisions / classify_s, 1) if classify_s > 0 else 0.0,
        "classifier_version": model.version,
        "device": str(model.device),
    })
