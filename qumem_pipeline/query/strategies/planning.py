"""QUMem's planning (§3.4, A1 then A2), shared by the strategies that plan: ``qumem`` and
``qumem_hybrid``, and by the LoCoMo harness's ``qumem`` units.

A1 lists the information needs behind a query, A2 turns them into rewritten queries over the typed
stores; each is ONE LLM batch over all queries of a run. Plans are validated (and repaired, saying
why) before anything is retrieved. Prompts: ``agents``.
"""

from typing import Callable, Sequence

from qumem_pipeline.llm.base import ChatRequest, ChatResult, LLMBackend
from qumem_pipeline.llm.retry import generate_with_retry
from qumem_pipeline.memories.call_ledger import A1, A2, call_tags
from qumem_pipeline.memories.decompose import MEMORY_TYPES
from qumem_pipeline.query.strategies.agents import (
    A1_MAX_TOKENS, A1_SCHEMA, A1_SYSTEM, A2_MAX_TOKENS, A2_SCHEMA, A2_SYSTEM, MAX_PLAN_QUERIES,
)
from qumem_pipeline.query.strategies.base import Query, user_message
from qumem_pipeline.query.strategies.user_state import is_query_anchor

__all__ = ["ANCHOR_DEPTH", "anchored", "plan_retrieval", "validate_plan", "with_query_anchor"]


def validate_plan(raw: dict | None, query: str) -> tuple[list[tuple[str, list[str]]], str | None]:
    """Keep valid (query, stores) pairs; repair what can be repaired, and say why."""
    problems = []
    plan: list[tuple[str, list[str]]] = []
    items = raw.get("queries") if isinstance(raw, dict) else None
    if not isinstance(items, list):
        problems.append("malformed plan")
        items = []
    for it in items[:MAX_PLAN_QUERIES]:
        if not isinstance(it, dict):
            problems.append("malformed plan entry")
            continue
        text = it.get("query") if isinstance(it.get("query"), str) else ""
        stores_raw = it.get("stores") if isinstance(it.get("stores"), list) else []
        stores = [s for s in dict.fromkeys(stores_raw) if s in MEMORY_TYPES]
        if any(x not in MEMORY_TYPES for x in stores_raw):
            problems.append("unknown store dropped")
        if not stores:
            problems.append("empty store set -> all stores")
            stores = list(MEMORY_TYPES)
        if not text.strip():
            problems.append("empty rewritten query -> original query")
            text = query
        plan.append((text.strip(), stores))
    if not plan:
        problems.append("no usable query -> original query over all stores")
        plan = [(query, list(MEMORY_TYPES))]
    return plan, ("; ".join(dict.fromkeys(problems)) or None)


def with_query_anchor(plan: list[tuple[str, list[str]]], query: str) -> list[tuple[str, list[str]]]:
    """A2's plan plus the query itself over every store, unless the plan already has it.

    Why: rewritten queries can drift from what was asked, and then the state is inferred from
    evidence the question never asked for; the query's own top-k anchors the candidates (measured
    on LoCoMo QA, see README). The anchor is recorded in the row's plan, so what was retrieved
    stays visible."""
    if any(is_query_anchor(entry, query) for entry in plan):
        return plan
    return [*plan, (query.strip(), list(MEMORY_TYPES))]


# The query's own retrieval goes this many times deeper than each rewrite's: a rewrite can drift from
# what was asked, the query cannot (README, QA).
ANCHOR_DEPTH = 2


def anchored(plans: Sequence[list[tuple[str, list[str]]]], queries: Sequence[Query], k: int
             ) -> tuple[list[list[tuple[str, list[str]]]], int]:
    """A2's plans with the query anchor, and how deep the anchor is retrieved for ``k``.

    The one place the strategy and the LoCoMo harness take both from, so they cannot drift apart."""
    return [with_query_anchor(p, q.query) for p, q in zip(plans, queries)], ANCHOR_DEPTH * k


def plan_retrieval(
    queries: Sequence[Query],
    llm: LLMBackend,
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[list[list[dict]], list[list[tuple[str, list[str]]]], list[str | None], list[tuple[int, int]]]:
    """A1 (information needs) then A2 (retrieval plan, validated), each ONE batch over all queries.

    Factored out so the retrieval-only LoCoMo harness can run the same planning as the product.
    Returns per query: needs, plan [(query, stores)], why the plan was repaired (or None), and
    (prompt, completion) tokens spent on A1+A2.
    """
    n = len(queries)
    tokens = [[0, 0] for _ in range(n)]
    needs: list[list[dict]] = [[] for _ in range(n)]
    plans: list[list[tuple[str, list[str]]]] = [[(q.query, list(MEMORY_TYPES))] for q in queries]
    repaired: list[str | None] = [None] * n

    def account(i: int, r: ChatResult) -> None:
        tokens[i][0] += r.prompt_tokens
        tokens[i][1] += r.completion_tokens

    # A1: information needs, one batch.
    a1 = generate_with_retry(llm, [
        ChatRequest(f"{q.query_id}/a1", [{"role": "system", "content": A1_SYSTEM},
                                         {"role": "user", "content": user_message(q, 'Return {"needs": [{"need": "...", "why": "..."}]}.')}],
                    A1_SCHEMA, A1_MAX_TOKENS, "information_needs", metadata=call_tags(q.user_id, A1, q.query_id))
        for q in queries
    ])
    for i, r in enumerate(a1):
        account(i, r)
        needs[i] = (r.parsed or {}).get("needs", []) if r.ok else []
        if not r.ok:
            repaired[i] = f"A1 failed ({r.error}); planning from the query alone"
    if progress:
        progress("A1 information needs", n, n)
    # A2: retrieval plans, one batch.
    a2 = generate_with_retry(llm, [
        ChatRequest(
            f"{q.query_id}/a2",
            [{"role": "system", "content": A2_SYSTEM},
             {"role": "user", "content": user_message(
                 q,
                 "Information needs:\n" + ("\n".join(f"- {d.get('need', '')} (why: {d.get('why', '')})" for d in needs[i]) or "- (none listed)")
                 + '\n\nReturn {"queries": [{"query": "...", "stores": ["fact"|"preference"|"insight", ...]}]}.')}],
            A2_SCHEMA, A2_MAX_TOKENS, "retrieval_plan", metadata=call_tags(q.user_id, A2, q.query_id))
        for i, q in enumerate(queries)
    ])
    for i, r in enumerate(a2):
        account(i, r)
        plan, why = validate_plan(r.parsed if r.ok else None, queries[i].query)
        plans[i] = plan
        if why or not r.ok:
            reason = why if r.ok else f"A2 output unusable ({r.error}); {why}"
            repaired[i] = "; ".join(x for x in (repaired[i], reason) if x)
    if progress:
        progress("A2 retrieval plans", n, n)
    return needs, plans, repaired, [(a, b) for a, b in tokens]
