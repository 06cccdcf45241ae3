"""Retrieval -> A3 (user state Z_q) -> optional response Psi, for planned queries (QUMem §3.4).

The second half of the ``qumem`` strategy and the whole of the ``topk`` baseline: they differ only
in where the plans come from (A1/A2, or the raw query over every store). Candidates are shown to
A3 as short aliases (M1, M2, ...), which small models cite far more reliably than hashes; aliases
are mapped back to memory ids and any citation of a memory that was not retrieved is dropped and
counted.
"""

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Sequence

from qumem_pipeline.query.version import stage_version
from qumem_pipeline.llm.base import ChatRequest, LLMBackend
from qumem_pipeline.llm.retry import generate_with_retry
from qumem_pipeline.memories.call_ledger import A3, call_tags
from qumem_pipeline.memories.decompose import MEMORY_TYPES
from qumem_pipeline.query.strategies.agents import (
    A3_MAX_TOKENS, A3_SCHEMA, A3_SYSTEM, QUERY_PROMPT_VERSION, RESPONSE_MAX_TOKENS, RESPONSE_SCHEMA, RESPONSE_SYSTEM,
)
from qumem_pipeline.query.strategies.base import (
    Progress, Query, Retriever, StateOutput, TokenCounts, alias_constraint, answer_queries, candidate_index,
    candidate_structs,
    check_no_future, cited_turns, output_frames, quarantine_row, render_candidates, resolve_citations, user_message,
)


def merge_candidates(first: Sequence, second: Sequence) -> list:
    """Both retrievals' candidates, one per memory id, each with its best score (first's order, then second's new ones)."""
    best: dict[str, Any] = {}
    for c in [*first, *second]:
        if c.memory_id not in best or c.score > best[c.memory_id].score:
            best[c.memory_id] = c
    return list(best.values())


def is_query_anchor(entry: tuple[str, Sequence[str]], query: str) -> bool:
    """True for a plan entry that is the query itself over every store (the anchor)."""
    text, stores = entry
    return text.strip().lower() == query.strip().lower() and set(stores) == set(MEMORY_TYPES)


def retrieve_planned(queries: Sequence[Query], plans: Sequence[Sequence[tuple[str, list[str]]]], retriever: Retriever,
                     *, k: int, anchor_k: int | None = None) -> list[list]:
    """The retrieval step: every plan of every query in one call (``k`` per sub-query and store), then the
    query itself over every store ``anchor_k`` deep when that is deeper, merged by memory id; never past as_of.

    With a deeper anchor, the plan's own anchor entry is left out of the first call: its k hits are the
    top of the deeper call's, so searching it twice would buy nothing. One function so the LoCoMo
    harness measures exactly the retrieval the strategy feeds to A3."""
    deeper_anchor = bool(anchor_k and anchor_k > k)
    shallow = [[e for e in plans[i] if not (deeper_anchor and is_query_anchor(e, q.query))]
               for i, q in enumerate(queries)]
    sent = [i for i, p in enumerate(shallow) if p]
    found = retriever.retrieve([(queries[i].user_id, shallow[i], queries[i].as_of_position) for i in sent], k) if sent else []
    candidates: list[list] = [[] for _ in queries]
    for i, row in zip(sent, found):
        candidates[i] = row
    if deeper_anchor:
        deeper = retriever.retrieve(
            [(q.user_id, [(q.query.strip(), list(MEMORY_TYPES))], q.as_of_position) for q in queries], anchor_k)
        candidates = [merge_candidates(a, b) for a, b in zip(candidates, deeper)]
    check_no_future(queries, candidates)  # defence in depth: the retriever must already guarantee this
    return candidates


@dataclass
class Plans:
    """What came before retrieval, per query: needs (JSON-able), plan [(query, stores)], why repaired."""

    needs: list[list[dict]]
    plans: list[list[tuple[str, list[str]]]]
    repaired: list[str | None]


def infer_from_plans(
    strategy: str, queries: Sequence[Query], planned: Plans, llm: LLMBackend, retriever: Retriever, tokens: TokenCounts,
    *, k: int, respond: bool, created_at: datetime | None, progress: Progress | None, anchor_k: int | None = None,
    candidates: Sequence[Sequence] | None = None,
) -> StateOutput:
    """``anchor_k``: the query itself is also retrieved over every store, this deep (its plan rewrites get ``k``).
    ``candidates``: what a strategy retrieved its own way (per query), instead of ``retrieve_planned``."""
    created_at = created_at or datetime.now(timezone.utc)
    n = len(queries)
    quarantine: list[dict] = []

    def step(name: str) -> None:
        if progress:
            progress(name, n, n)

    if candidates is None:
        candidates = retrieve_planned(queries, planned.plans, retriever, k=k, anchor_k=anchor_k)
    else:
        check_no_future(queries, candidates)
    candidates = [sorted(cs, key=lambda c: (c.position, -c.score)) for cs in candidates]
    step("retrieval")

    # A3: user states, one batch.
    a3 = generate_with_retry(llm, [
        ChatRequest(f"{q.query_id}/a3",
                    [{"role": "system", "content": A3_SYSTEM},
                     {"role": "user", "content": user_message(q, render_candidates(candidates[i]) + "\n\nReturn the user state as JSON.")}],
                    A3_SCHEMA, A3_MAX_TOKENS, "user_state", metadata=call_tags(q.user_id, A3, q.query_id),
                    constraint_schema=alias_constraint(llm, A3_SCHEMA, len(candidates[i])))
        for i, q in enumerate(queries)
    ])
    states: list[dict | None] = [None] * n
    cited: list[list[str]] = [[] for _ in range(n)]
    dropped = [0] * n
    for i, r in enumerate(a3):
        tokens.account(i, r)
        if r.ok:
            states[i], cited[i], dropped[i] = resolve_citations(r.parsed or {}, candidates[i])
        else:
            quarantine.append(quarantine_row(queries[i], "A3", r, QUERY_PROMPT_VERSION, created_at))
    step("A3 user states")

    responses: list[str | None] = [None] * n
    if respond:
        todo = [i for i in range(n) if states[i] is not None]
        answers = answer_queries(llm, queries, todo, lambda i: "Inferred user state: " + json.dumps(states[i]),
                                 system=RESPONSE_SYSTEM, schema=RESPONSE_SCHEMA, max_tokens=RESPONSE_MAX_TOKENS,
                                 request_suffix="psi", kind="response", account=tokens.account)
        for i, a in answers.items():
            responses[i] = a
        step("response")

    by_id = candidate_index(candidates)
    rows = []
    for i, q in enumerate(queries):
        if states[i] is None:
            continue
        rows.append({
            "query_id": q.query_id, "user_id": q.user_id, "query": q.query, "as_of_position": q.as_of_position,
            "strategy": strategy, "needs": json.dumps(planned.needs[i]),
            "plan": json.dumps([{"query": t, "stores": s} for t, s in planned.plans[i]]),
            "plan_repaired": planned.repaired[i],
            "candidates": candidate_structs(candidates[i]),
            "state": json.dumps(states[i]), "cited_memory_ids": cited[i], "cited_turn_ids": cited_turns(cited[i], by_id),
            "dropped_citations": dropped[i], "response": responses[i], "model": llm.model_name,
            "prompt_version": QUERY_PROMPT_VERSION, "code_version": stage_version("query_states"),
            "prompt_tokens": tokens.per_query[i][0], "completion_tokens": tokens.per_query[i][1], "created_at": created_at,
        })
    states_df, q_df = output_frames(rows, quarantine)
    stats = {
        "queries": n, "states": states_df.height, "quarantined": q_df.height,
        "plans_repaired": sum(1 for r in planned.repaired if r), "dropped_citations": sum(dropped),
        "mean_candidates": (sum(len(c) for c in candidates) / n) if n else 0.0,
        **tokens.totals(),
    }
    return StateOutput(states=states_df, quarantine=q_df, stats=stats)
