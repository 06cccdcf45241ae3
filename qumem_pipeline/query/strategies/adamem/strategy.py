"""The ``adamem`` query strategy: route plan -> hybrid retrieval -> research loop (<= 2) -> working answer.

Same contract as the ``qumem`` and ``topk`` strategies (``base.QueryStrategy``, registered as
``adamem`` in ``registry``; rows use ``base.STATE_SCHEMA``), and the same stage batching: every LLM
stage is one batch over all queries of the run, and every retrieval round one call for all queries.
It needs an ``AdaMemRetriever`` (``retriever_kind = "adamem"``).

- Route planning is deterministic (cue detection, ``route.plan_route``), recorded in ``plan``; the
  resolved participant and cues go in ``needs``.
- Research agent (one batch per iteration): from the retrieved evidence (turns, memories, profile
  entries as aliases M1..Mn) infer the user state with citations, and say whether the evidence
  suffices; if not, it names one follow-up search. At most 2 iterations: the follow-ups of the
  queries that asked for one are retrieved in one more round and researched again on the merged
  evidence.
- Working agent (one batch): a concise answer from the final state, in ``response``.
"""

import copy
import hashlib
import json
from collections.abc import Sequence
from datetime import datetime, timezone

from qumem_pipeline.contracts.stage_versions import stage_version
from qumem_pipeline.llm.base import ChatRequest, LLMBackend
from qumem_pipeline.llm.retry import generate_with_retry
from qumem_pipeline.memories.call_ledger import RESEARCH, call_tags
from qumem_pipeline.query.strategies.adamem.participants import resolve
from qumem_pipeline.query.strategies.adamem.retriever import DEFAULT_K, AdaMemRetriever
from qumem_pipeline.query.strategies.adamem.route import plan_route
from qumem_pipeline.query.strategies.base import (
    USER_STATE_SCHEMA, Progress, Query, QueryStrategy, RetrievedMemory, StateOutput, TokenCounts, answer_queries,
    candidate_index, candidate_structs, check_no_future, cited_turns, output_frames, quarantine_row,
    render_candidates, resolve_citations, user_message,
)

__all__ = ["ADAMEM_PROMPT_VERSION", "AdaMemRetriever", "AdaMemStrategy", "MAX_ITERATIONS", "infer_adamem_states"]

MAX_ITERATIONS = 2
RESEARCH_MAX_TOKENS, WORKING_MAX_TOKENS = 800, 160
RESEARCH_SYSTEM = (
    "You are the research agent of a conversational memory system. From the retrieved evidence (each "
    "item has an id like M3: raw messages, memories and profile entries, with when they were stated), "
    "infer what is known that answers the current question: relevant facts in chronological order, "
    "preferences (earlier -> current) and applicable principles, citing the ids that support every item. "
    "Use only the evidence given. Then say whether the evidence suffices; if not, give one short "
    "follow-up search that would find what is missing. Answer with JSON only."
)
WORKING_SYSTEM = (
    "You are the working agent of a conversational memory system. Answer the question in one short "
    "sentence or phrase using only the research notes. Answer with JSON only."
)
RESEARCH_SCHEMA = copy.deepcopy(USER_STATE_SCHEMA)
RESEARCH_SCHEMA["properties"]["sufficient"] = {"type": "boolean"}
RESEARCH_SCHEMA["properties"]["follow_up"] = {"type": "string", "maxLength": 120}
RESEARCH_SCHEMA["required"] = [*USER_STATE_SCHEMA["required"], "sufficient", "follow_up"]
WORKING_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 200}},
                  "required": ["answer"], "additionalProperties": False}
ADAMEM_PROMPT_VERSION = "adamem-v1-" + hashlib.sha256(json.dumps(
    [RESEARCH_SYSTEM, WORKING_SYSTEM, RESEARCH_SCHEMA, WORKING_SCHEMA], sort_keys=True).encode()).hexdigest()[:10]


def _merge(a: list[RetrievedMemory], b: list[RetrievedMemory]) -> list[RetrievedMemory]:
    best: dict[str, RetrievedMemory] = {}
    for c in [*a, *b]:
        if c.memory_id not in best or c.score > best[c.memory_id].score:
            best[c.memory_id] = c
    return sorted(best.values(), key=lambda c: (c.position, -c.score, c.memory_id))


def infer_adamem_states(
    queries: Sequence[Query], llm: LLMBackend, retriever: AdaMemRetriever, *, k: int = DEFAULT_K,
    created_at: datetime | None = None, progress: Progress | None = None,
) -> StateOutput:
    created_at = created_at or datetime.now(timezone.utc)
    n = len(queries)
    tokens = TokenCounts(n)
    quarantine: list[dict] = []

    def step(name):
        if progress:
            progress(name, n, n)

    targets = [resolve(q.query, retriever.bundles[q.user_id].participants) if q.user_id in retriever.bundles else None
               for q in queries]
    plans = [plan_route(q.query) for q in queries]
    searches: list[list[dict]] = [[{"query": q.query, "route": plans[i].as_dict()}] for i, q in enumerate(queries)]
    hits = retriever.retrieve_routed([(q.user_id, q.query, q.as_of_position, plans[i], targets[i])
                                      for i, q in enumerate(queries)], k)
    candidates = [sorted((h.as_retrieved() for h in hs), key=lambda c: (c.position, -c.score, c.memory_id)) for hs in hits]
    step("retrieval 1")

    states: list[dict | None] = [None] * n
    todo = list(range(n))
    for it in range(1, MAX_ITERATIONS + 1):
        # defence in depth: the retriever masks future units already
        check_no_future(queries, candidates, "evidence", rows=todo)
        rs = generate_with_retry(llm, [
            ChatRequest(f"{queries[i].query_id}/research{it}",
                        [{"role": "system", "content": RESEARCH_SYSTEM},
                         {"role": "user", "content": user_message(queries[i], render_candidates(candidates[i])
                                                                  + "\n\nReturn the research notes as JSON.")}],
                        RESEARCH_SCHEMA, RESEARCH_MAX_TOKENS, "research",
                        metadata=call_tags(queries[i].user_id, RESEARCH, queries[i].query_id))
            for i in todo
        ])
        follow: list[int] = []
        for i, r in zip(todo, rs):
            tokens.account(i, r)
            if not r.ok:
                if states[i] is None:  # a failed second round keeps the first round's notes
                    quarantine.append(quarantine_row(queries[i], f"research{it}", r, ADAMEM_PROMPT_VERSION, created_at))
                continue
            states[i] = r.parsed
            fu = (r.parsed.get("follow_up") or "").strip()
            if it < MAX_ITERATIONS and not r.parsed.get("sufficient", True) and fu:
                follow.append(i)
                searches[i].append({"query": fu, "route": plans[i].as_dict()})
        step(f"research {it}")
        if not follow:
            break
        more = retriever.retrieve_routed([(queries[i].user_id, searches[i][-1]["query"], queries[i].as_of_position,
                                           plans[i], targets[i]) for i in follow], k)
        for i, hs in zip(follow, more):
            candidates[i] = _merge(candidates[i], [h.as_retrieved() for h in hs])
        step(f"retrieval {it + 1}")
        todo = follow

    resolved: list[tuple[dict, list[str], int] | None] = [
        resolve_citations(states[i], candidates[i]) if states[i] is not None else None for i in range(n)]
    answerable = [i for i in range(n) if resolved[i] is not None]
    responses: list[str | None] = [None] * n
    answers = answer_queries(llm, queries, answerable, lambda i: "Research notes: " + json.dumps(resolved[i][0]),
                             system=WORKING_SYSTEM, schema=WORKING_SCHEMA, max_tokens=WORKING_MAX_TOKENS,
                             request_suffix="working", kind="working_answer", account=tokens.account)
    for i, a in answers.items():
        responses[i] = a
    step("working answer")

    by_id = candidate_index(candidates)
    rows = []
    for i, q in enumerate(queries):
        if resolved[i] is None:
            continue
        state, cited, dropped = resolved[i]
        rows.append({
            "query_id": q.query_id, "user_id": q.user_id, "query": q.query, "as_of_position": q.as_of_position,
            "strategy": "adamem", "needs": json.dumps({"target": targets[i], "cues": list(plans[i].cues)}),
            "plan": json.dumps(searches[i]), "plan_repaired": None,
            "candidates": candidate_structs(candidates[i]),
            "state": json.dumps(state), "cited_memory_ids": cited, "cited_turn_ids": cited_turns(cited, by_id),
            "dropped_citations": dropped, "response": responses[i], "model": llm.model_name,
            "prompt_version": ADAMEM_PROMPT_VERSION, "code_version": stage_version("query_states"),
            "prompt_tokens": tokens.per_query[i][0], "completion_tokens": tokens.per_query[i][1], "created_at": created_at,
        })
    states_df, q_df = output_frames(rows, quarantine)
    stats = {"queries": n, "states": states_df.height, "quarantined": q_df.height,
             "research_iterations_2": sum(1 for s in searches if len(s) > 1),
             "dropped_citations": sum(r[2] for r in resolved if r), "mean_candidates": (sum(map(len, candidates)) / n) if n else 0.0,
             **tokens.totals()}
    return StateOutput(states=states_df, quarantine=q_df, stats=stats)


class AdaMemStrategy(QueryStrategy):
    """AdaMem's route-planned hybrid retrieval with a bounded research loop and a working answer."""

    name = "adamem"
    version = ADAMEM_PROMPT_VERSION
    retriever_kind = "adamem"
    default_k = DEFAULT_K

    def infer(self, queries: Sequence[Query], llm: LLMBackend, retriever: AdaMemRetriever, *, k: int | None = None,
              respond: bool = False, created_at: datetime | None = None, progress: Progress | None = None) -> StateOutput:
        """``respond`` is ignored: the working answer is part of the strategy."""
        if not isinstance(retriever, AdaMemRetriever):
            raise TypeError(f"strategy 'adamem' needs an AdaMemRetriever, got {type(retriever).__name__}")
        return infer_adamem_states(queries, llm, retriever, k=self.default_k if k is None else k,
                                   created_at=created_at, progress=progress)
