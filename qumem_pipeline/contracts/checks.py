"""Output checks that stop bad data from spreading downstream (run as blocking Dagster asset checks).

Each returns a CheckOutcome; the Dagster layer turns it into an AssetCheckResult. They run on
the frames a step just wrote, so they cost one pass over data already in memory.
"""

from dataclasses import dataclass, field

import polars as pl


@dataclass
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict = field(default_factory=dict)


def schema_conforms(df: pl.DataFrame, expected: dict[str, pl.DataType], table: str) -> CheckOutcome:
    """Every expected column present with the expected type (extra columns are allowed)."""
    problems = []
    for name, dtype in expected.items():
        if name not in df.schema:
            problems.append(f"missing column {name}")
        elif df.schema[name] != dtype:
            problems.append(f"{name}: {df.schema[name]} != {dtype}")
    return CheckOutcome(not problems, f"{table} matches its schema" if not problems else f"{table}: " + "; ".join(problems[:10]),
                        {"problems": len(problems)})


def quarantine_under_ceiling(n_valid: int, n_quarantined: int, max_fraction: float) -> CheckOutcome:
    total = n_valid + n_quarantined
    frac = n_quarantined / total if total else 0.0
    ok = frac <= max_fraction
    return CheckOutcome(ok, f"{n_quarantined}/{total} rows quarantined ({frac:.1%}; ceiling {max_fraction:.0%})",
                        {"quarantined": n_quarantined, "total": total, "fraction": round(frac, 4)})


def episodes_cover_turns(turns_by_user: dict[str, pl.DataFrame], episodes_by_user: dict[str, pl.DataFrame]) -> CheckOutcome:
    """No empty episode, and every turn of every user in exactly one episode."""
    bad = []
    empty = 0
    for u, t in turns_by_user.items():
        e = episodes_by_user.get(u)
        if e is None:
            bad.append(f"{u}: no episodes")
            continue
        empty += int((e["n_turns"] == 0).sum()) if e.height else 0
        covered = [x for ids in e["turn_ids"].to_list() for x in ids]
        if sorted(covered) != sorted(t["turn_index"].to_list()):
            bad.append(f"{u}: {len(covered)} turns in episodes vs {t.height} turns")
    ok = not bad and empty == 0
    return CheckOutcome(ok, "every turn in exactly one non-empty episode" if ok else "; ".join(bad[:10]) or f"{empty} empty episodes",
                        {"users_with_problems": len(bad), "empty_episodes": empty})


def evidence_inside_episodes(memories: pl.DataFrame, episodes: pl.DataFrame) -> CheckOutcome:
    """Every memory cites at least one turn, and only turns of its own episode."""
    if memories.height == 0:
        return CheckOutcome(True, "no memories", {"violations": 0})
    span = episodes.select("episode_id", pl.col("turn_ids").alias("_ep_turns"))
    joined = memories.join(span, on="episode_id", how="left")
    viol = joined.filter(
        pl.col("_ep_turns").is_null()
        | (pl.col("evidence_turn_ids").list.len() == 0)
        | (pl.col("evidence_turn_ids").list.set_difference(pl.col("_ep_turns")).list.len() > 0)
    )
    return CheckOutcome(viol.height == 0, f"{viol.height} memories cite evidence outside their episode",
                        {"violations": viol.height, "memories": memories.height})


def no_future_citations(states: pl.DataFrame, memories: pl.DataFrame) -> CheckOutcome:
    """No query state cites a memory (or a turn) after the query's as_of."""
    if states.height == 0:
        return CheckOutcome(True, "no query states", {"violations": 0})
    turn_viol = states.filter(pl.col("cited_turn_ids").list.max() > pl.col("as_of_position")).height
    pos = memories.select("memory_id", "position")
    exploded = states.select("query_id", "as_of_position", pl.col("cited_memory_ids").alias("memory_id")).explode("memory_id")
    mem_viol = exploded.join(pos, on="memory_id", how="left").filter(pl.col("position") > pl.col("as_of_position")).height
    n = turn_viol + mem_viol
    return CheckOutcome(n == 0, f"{n} citations after as_of", {"violations": n})


def evidence_turns_exist(memories: pl.DataFrame, turns: pl.DataFrame) -> CheckOutcome:
    """Every turn a memory cites is one of its user's current turns: when a source file is withdrawn
    or rewritten, a memory set built on the turns it held is not published (or used) again."""
    if memories.height == 0:
        return CheckOutcome(True, "no memories", {"violations": 0, "missing_turns": 0})
    cited = (memories.select("memory_id", "user_id", pl.col("evidence_turn_ids").alias("turn_index"))
             .explode("turn_index").drop_nulls("turn_index").with_columns(pl.col("turn_index").cast(pl.Int64)))
    have = turns.select("user_id", pl.col("turn_index").cast(pl.Int64)).unique()
    missing = cited.join(have, on=["user_id", "turn_index"], how="anti")
    bad = missing["memory_id"].n_unique()
    users = sorted(missing["user_id"].unique().to_list())
    desc = (f"{bad} memories cite {missing.height} turns that no longer exist (users {', '.join(users[:5])}): rebuild "
            "them from the current turns" if bad else "every evidence turn exists")
    return CheckOutcome(bad == 0, desc, {"violations": bad, "missing_turns": missing.height, "memories": memories.height})
