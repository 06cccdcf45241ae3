"""Query-conditioned user-state inference (QUMem §3.4): three agents, batched stage by stage.

A1 (information need) -> A2 (retrieval plan over the typed stores) -> retrieval (never past the
query's as_of) -> A3 (user state Z_q = facts, preference trajectory, insights, each citing
memories) -> optional response Ψ(q, Z_q). Each stage is one LLM batch over *all* queries of the
run, so a server sees full batches. Candidates are shown to A3 as short aliases (M1, M2, ...),
which small models cite far more reliably than hashes; aliases are mapped back to memory ids
and any citation of a memory that was not retrieved is dropped and counted. A1+A2 are
``plan_retrieval`` (also used by the LoCoMo harness's ``qumem`` strategy).

The "topk" strategy is the paper's baseline: one similarity search over all stores with the raw
query, then A3 on what it returned. The "adamem" strategy (second seed) is implemented in
``qumem_pipeline.query.strategies.adamem.strategy`` and dispatched from here; it needs an ``AdaMemRetriever``.
"""

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Protocol, Sequence

import polars as pl

from qumem_pipeline.memories.decompose import MEMORY_TYPES
from qumem_pipeline.llm.base import ChatRequest, ChatResult, LLMBackend
from qumem_pipeline.contracts.stage_versions import stage_version

STRATEGIES = ("qumem", "topk", "adamem")
MAX_NEEDS = 3
MAX_PLAN_QUERIES = 3
# Output budgets per stage: small models fill every string to its maxLength, so the schema
# bounds are what keep a stage's cost predictable.
# Each budget covers the largest output its schema allows, so a valid answer is never cut off.
A1_MAX_TOKENS, A2_MAX_TOKENS, A3_MAX_TOKENS, RESPONSE_MAX_TOKENS = 320, 256, 768, 320

A1_SYSTEM = (
    "You are the information-need agent of a personal assistant's memory system. Given the user's "
    "current query and task context, list the pieces of information about this user that must be "
    "verified from their interaction history before answering, and why each matters. If the query "
    "concerns preferences that may have changed over time, include the earlier and later expressions "
    "of those preferences, the contexts in which each applies, and the reasons for any change. Do not "
    "write search queries. Answer with JSON only."
)
A2_SYSTEM = (
    "You are the retrieval-planning agent of a personal assistant's memory system. Rewrite each "
    "information need as one self-contained search query and choose which memory stores to search: "
    "'fact' (concrete experiences, events, states), 'preference' (choices, likes, constraints and their "
    "reasons), 'insight' (general decision principles). Choose at least one store per query. "
    "Answer with JSON only."
)
A3_SYSTEM = (
    "You are the user-state inference agent of a personal assistant's memory system. From the "
    "retrieved memories (each with an id like M3 and the time it was stated), infer the user's state "
    "relevant to the current query: the relevant facts in chronological order; how the user's "
    "preferences evolved (earlier -> current) and which one applies now and why; and the decision "
    "principles that apply to this task. Cite the ids of the memories that support every item. Use only "
    "the memories given; if they say nothing relevant, return empty lists. Answer with JSON only."
)
RESPONSE_SYSTEM = (
    "You are a personal assistant. Answer the user's query using the inferred user state. Be concise."
)

_ID_LIST = {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}
A1_SCHEMA = {
    "type": "object",
    "properties": {
        "needs": {
            "type": "array",
            "maxItems": MAX_NEEDS,
            "items": {
                "type": "object",
                "properties": {"need": {"type": "string", "maxLength": 100}, "why": {"type": "string", "maxLength": 100}},
                "required": ["need", "why"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["needs"],
    "additionalProperties": False,
}
A2_SCHEMA = {
    "type": "object",
    "properties": {
        "queries": {
            "type": "array",
            "maxItems": MAX_PLAN_QUERIES,
            "items": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 120},
                    "stores": {"type": "array", "items": {"type": "string", "enum": list(MEMORY_TYPES)}, "maxItems": 3},
                },
                "required": ["query", "stores"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["queries"],
    "additionalProperties": False,
}
A3_SCHEMA = {
    "type": "object",
    "properties": {
        "facts": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"statement": {"type": "string", "maxLength": 120}, "memory_ids": _ID_LIST},
                "required": ["statement", "memory_ids"],
                "additionalProperties": False,
            },
        },
        "preference_trajectory": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "aspect": {"type": "string", "maxLength": 60},
                    "earlier": {"type": "string", "maxLength": 100},
                    "current": {"type": "string", "maxLength": 100},
                    "applies_now_because": {"type": "string", "maxLength": 100},
                    "memory_ids": _ID_LIST,
                },
                "required": ["aspect", "earlier", "current", "applies_now_because", "memory_ids"],
                "additionalProperties": False,
            },
        },
        "insights": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {"insight": {"type": "string", "maxLength": 120}, "memory_ids": _ID_LIST},
                "required": ["insight", "memory_ids"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["facts", "preference_trajectory", "insights"],
    "additionalProperties": False,
}
RESPONSE_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 800}},
    "required": ["answer"],
    "additionalProperties": False,
}


def _fingerprint() -> str:
    blob = json.dumps([A1_SYSTEM, A2_SYSTEM, A3_SYSTEM, RESPONSE_SYSTEM, A1_SCHEMA, A2_SCHEMA, A3_SCHEMA], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


QUERY_PROMPT_VERSION = f"query-state-v1-{_fingerprint()}"


@dataclass(frozen=True)
class Query:
    query_id: str
    user_id: str
    query: str
    as_of_position: int  # latest turn_index whose evidence may be used (inclusive)
    task_context: str | None = None


@dataclass
class RetrievedMemory:
    memory_id: str
    type: str
    content: str
    position: int
    score: float
    evidence_turn_ids: list[int] = field(default_factory=list)
    valid_from: datetime | None = None


class Retriever(Protocol):
    """Runs planned (query, stores) pairs for many queries at once; never returns position > as_of."""

    def retrieve(
        self, requests: Sequence[tuple[str, list[tuple[str, list[str]]], int]], k: int
    ) -> list[list[RetrievedMemory]]: ...


STATE_SCHEMA = pl.Schema(
    {
        "query_id": pl.String,
        "user_id": pl.String,
        "query": pl.String,
        "as_of_position": pl.Int64,
        "strategy": pl.String,
        "needs": pl.String,  # JSON
        "plan": pl.String,  # JSON list of {query, stores}
        "plan_repaired": pl.String,  # null, or why the plan was repaired
        "candidates": pl.List(pl.Struct({"memory_id": pl.String, "type": pl.String, "score": pl.Float64, "position": pl.Int64})),
        "state": pl.String,  # JSON Z_q with memory ids
        "cited_memory_ids": pl.List(pl.String),
        "cited_turn_ids": pl.List(pl.Int64),
        "dropped_citations": pl.Int64,
        "response": pl.String,
        "model": pl.String,
        "prompt_version": pl.String,
        "code_version": pl.String,
        "prompt_tokens": pl.Int64,
        "completion_tokens": pl.Int64,
        "created_at": pl.Datetime("us", "UTC"),
    }
)
QUERY_QUARANTINE_SCHEMA = pl.Schema(
    {"query_id": pl.String, "user_id": pl.String, "stage": pl.String, "reason": pl.String, "raw": pl.String,
     "prompt_version": pl.String, "code_version": pl.String, "created_at": pl.Datetime("us", "UTC")}
)


@dataclass
class StateOutput:
    states: pl.DataFrame
    quarantine: pl.DataFrame
    stats: dict[str, Any]


def _user_msg(q: Query, extra: str) -> str:
    ctx = f"\nTask context: {q.task_context}" if q.task_context else ""
    return f"Current query: {q.query}{ctx}\n\n{extra}"


def _generate_with_retry(llm: LLMBackend, reqs: list[ChatRequest]) -> list[ChatResult]:
    """One retry for unparseable output, like the decomposer."""
    results = llm.generate(reqs) if reqs else []
    bad = [i for i, r in enumerate(results) if not r.ok]
    if bad:
        again = llm.generate([reqs[i] for i in bad])
        for i, r in zip(bad, again):
            r.attempts += results[i].attempts
            r.prompt_tokens += results[i].prompt_tokens
            r.completion_tokens += results[i].completion_tokens
            results[i] = r
    return results


def answer_queries(
    llm: LLMBackend, queries: Sequence[Query], todo: Sequence[int], notes: Callable[[int], str], *,
    system: str, schema: dict, max_tokens: int, request_suffix: str, kind: str,
    account: Callable[[int, ChatResult], None],
) -> dict[int, str | None]:
    """One batched answer call per query in ``todo`` over ``notes(i)`` (the qumem response step Psi
    and AdaMem's working answer); unusable output twice gives None."""
    results = _generate_with_retry(llm, [
        ChatRequest(f"{queries[i].query_id}/{request_suffix}",
                    [{"role": "system", "content": system},
                     {"role": "user", "content": _user_msg(queries[i], notes(i) + '\n\nReturn {"answer": "..."}.')}],
                    schema, max_tokens, kind)
        for i in todo
    ])
    out: dict[int, str | None] = {}
    for i, r in zip(todo, results):
        account(i, r)
        out[i] = (r.parsed or {}).get("answer") if r.ok else None
    return out


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


def _render_candidates(cands: list[RetrievedMemory]) -> str:
    if not cands:
        return "Retrieved memories: (none)"
    lines = []
    for i, c in enumerate(cands, start=1):
        when = f", stated {c.valid_from:%Y-%m-%d}" if c.valid_from else f", turn {c.position}"
        lines.append(f"M{i} [{c.type}{when}]: {c.content}")
    return "Retrieved memories (oldest first):\n" + "\n".join(lines)


def _resolve_citations(state: dict, cands: list[RetrievedMemory]) -> tuple[dict, list[str], int]:
    """Replace aliases (M3) with memory ids; drop citations of anything not retrieved."""
    alias = {f"M{i}": c.memory_id for i, c in enumerate(cands, start=1)}
    cited: list[str] = []
    dropped = 0
    out: dict[str, list] = {}
    for section in ("facts", "preference_trajectory", "insights"):
        items = []
        for item in state.get(section, []) or []:
            ids = []
            for a in item.get("memory_ids", []) or []:
                mid = alias.get(str(a).strip().upper())
                if mid is None:
                    dropped += 1
                elif mid not in ids:
                    ids.append(mid)
            items.append({**item, "memory_ids": ids})
            cited.extend(ids)
        out[section] = items
    return out, list(dict.fromkeys(cited)), dropped


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
    a1 = _generate_with_retry(llm, [
        ChatRequest(f"{q.query_id}/a1", [{"role": "system", "content": A1_SYSTEM},
                                         {"role": "user", "content": _user_msg(q, 'Return {"needs": [{"need": "...", "why": "..."}]}.')}],
                    A1_SCHEMA, A1_MAX_TOKENS, "information_needs")
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
    a2 = _generate_with_retry(llm, [
        ChatRequest(
            f"{q.query_id}/a2",
            [{"role": "system", "content": A2_SYSTEM},
             {"role": "user", "content": _user_msg(
                 q,
                 "Information needs:\n" + ("\n".join(f"- {d.get('need', '')} (why: {d.get('why', '')})" for d in needs[i]) or "- (none listed)")
                 + '\n\nReturn {"queries": [{"query": "...", "stores": ["fact"|"preference"|"insight", ...]}]}.')}],
            A2_SCHEMA, A2_MAX_TOKENS, "retrieval_plan")
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


def infer_user_states(
    queries: Sequence[Query],
    llm: LLMBackend,
    retriever: Retriever,
    *,
    strategy: str = "qumem",
    k: int = 5,
    respond: bool = False,
    created_at: datetime | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> StateOutput:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if strategy == "adamem":
        from qumem_pipeline.query.strategies.adamem.strategy import AdaMemRetriever, infer_adamem_states

        if not isinstance(retriever, AdaMemRetriever):
            raise TypeError(f"strategy 'adamem' needs an AdaMemRetriever, got {type(retriever).__name__}")
        return infer_adamem_states(queries, llm, retriever, k=k, created_at=created_at, progress=progress)
    created_at = created_at or datetime.now(timezone.utc)
    n = len(queries)
    tokens = [[0, 0] for _ in range(n)]
    quarantine: list[dict] = []

    def account(i: int, r: ChatResult) -> None:
        tokens[i][0] += r.prompt_tokens
        tokens[i][1] += r.completion_tokens

    def step(name: str) -> None:
        if progress:
            progress(name, n, n)

    needs: list[list[dict]] = [[] for _ in range(n)]
    plans: list[list[tuple[str, list[str]]]] = [[(q.query, list(MEMORY_TYPES))] for q in queries]
    repaired: list[str | None] = [None] * n
    if strategy == "qumem":
        needs, plans, repaired, plan_tokens = plan_retrieval(queries, llm, progress=progress)
        for i, (p_tok, c_tok) in enumerate(plan_tokens):
            tokens[i][0] += p_tok
            tokens[i][1] += c_tok

    # Retrieval: every planned query of every query in one call; never past as_of.
    candidates = retriever.retrieve([(q.user_id, plans[i], q.as_of_position) for i, q in enumerate(queries)], k)
    for i, q in enumerate(queries):
        future = [c.memory_id for c in candidates[i] if c.position > q.as_of_position]
        if future:  # defence in depth: the retriever must already guarantee this
            raise AssertionError(f"retriever returned memories after as_of for query {q.query_id}: {future}")
        candidates[i] = sorted(candidates[i], key=lambda c: (c.position, -c.score))
    step("retrieval")

    # A3: user states, one batch.
    a3 = _generate_with_retry(llm, [
        ChatRequest(f"{q.query_id}/a3",
                    [{"role": "system", "content": A3_SYSTEM},
                     {"role": "user", "content": _user_msg(q, _render_candidates(candidates[i]) + "\n\nReturn the user state as JSON.")}],
                    A3_SCHEMA, A3_MAX_TOKENS, "user_state")
        for i, q in enumerate(queries)
    ])
    states: list[dict | None] = [None] * n
    cited: list[list[str]] = [[] for _ in range(n)]
    dropped = [0] * n
    for i, r in enumerate(a3):
        account(i, r)
        if r.ok:
            states[i], cited[i], dropped[i] = _resolve_citations(r.parsed or {}, candidates[i])
        else:
            quarantine.append({"query_id": queries[i].query_id, "user_id": queries[i].user_id, "stage": "A3",
                               "reason": r.error or "no output", "raw": r.raw_text[:4096],
                               "prompt_version": QUERY_PROMPT_VERSION, "created_at": created_at})
    step("A3 user states")

    responses: list[str | None] = [None] * n
    if respond:
        todo = [i for i in range(n) if states[i] is not None]
        answers = answer_queries(llm, queries, todo, lambda i: "Inferred user state: " + json.dumps(states[i]),
                                 system=RESPONSE_SYSTEM, schema=RESPONSE_SCHEMA, max_tokens=RESPONSE_MAX_TOKENS,
                                 request_suffix="psi", kind="response", account=account)
        for i, a in answers.items():
            responses[i] = a
        step("response")

    by_id = {c.memory_id: c for cs in candidates for c in cs}
    rows = []
    for i, q in enumerate(queries):
        if states[i] is None:
            continue
        turn_ids = sorted({t for m in cited[i] for t in by_id[m].evidence_turn_ids})
        rows.append({
            "query_id": q.query_id, "user_id": q.user_id, "query": q.query, "as_of_position": q.as_of_position,
            "strategy": strategy, "needs": json.dumps(needs[i]),
            "plan": json.dumps([{"query": t, "stores": s} for t, s in plans[i]]),
            "plan_repaired": repaired[i],
            "candidates": [{"memory_id": c.memory_id, "type": c.type, "score": float(c.score), "position": int(c.position)} for c in candidates[i]],
            "state": json.dumps(states[i]), "cited_memory_ids": cited[i], "cited_turn_ids": turn_ids,
            "dropped_citations": dropped[i], "response": responses[i], "model": llm.model_name,
            "prompt_version": QUERY_PROMPT_VERSION, "code_version": stage_version("query_states"),
            "prompt_tokens": tokens[i][0], "completion_tokens": tokens[i][1], "created_at": created_at,
        })
    states_df = pl.DataFrame(rows, schema=STATE_SCHEMA) if rows else STATE_SCHEMA.to_frame()
    q_df = pl.DataFrame(quarantine, schema=QUERY_QUARANTINE_SCHEMA) if quarantine else QUERY_QUARANTINE_SCHEMA.to_frame()
    q_df = q_df.with_columns(code_version=pl.lit(stage_version("query_states"), pl.String))
    stats = {
        "queries": n, "states": states_df.height, "quarantined": q_df.height,
        "plans_repaired": sum(1 for r in repaired if r), "dropped_citations": sum(dropped),
        "mean_candidates": (sum(len(c) for c in candidates) / n) if n else 0.0,
        "prompt_tokens": sum(t[0] for t in tokens), "completion_tokens": sum(t[1] for t in tokens),
    }
    return StateOutput(states=states_df, quarantine=q_df, stats=stats)
