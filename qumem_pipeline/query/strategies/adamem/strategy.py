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

from qumem_pipeline.query.version import stage_version
from qumem_pipeline.llm.base import ChatRequest, LLMBackend
from qumem_pipeline.llm.retry import generate_with_retry
from qumem_pipeline.memories.call_ledger import RESEARCH, call_tags
from qumem_pipeline.query.strategies.adamem.participants import resolve
from qumem_pipeline.query.strategies.adamem.retriever import DEFAULT_K, AdaMemRetriever
from qumem_pipeline.query.strategies.user_state import merge_candidates
from qumem_pipeline.query.strategies.adamem.route import plan_route
from qumem_pipeline.query.strategies.base import (
    USER_STATE_SCHEMA, Progress, Query, QueryStrategy, RetrievedMemory, StateOutput, TokenCounts, alias_constraint,
    answer_queries,
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


def _in_order(candidates) -> list[RetrievedMemory]:
    return sorted(candidates, key=lambda c: (c.position, -c.score, c.memory_id))


class _AdaMemRun:
    """One stage-batched run over all queries: per query its route plan, searches, evidence, notes."""

    def __init__(self, queries: Sequence[Query], llm: LLMBackend, retriever: AdaMemRetriever, k: int,
                 created_at: datetime, progress: Progress | None):
        self.queries, self.llm, self.retriever, self.k, self.created_at = queries, llm, retriever, k, created_at
        self.progress = progress
        n = self.n = len(queries)
        self.tokens = TokenCounts(n)
        self.quarantine: list[dict] = []
        self.targets = [resolve(q.query, retriever.bundles[q.user_id].participants) if q.user_id in retriever.bundles
                        else None for q in queries]
        self.plans = [plan_route(q.query) for q in queries]
        self.searches: list[list[dict]] = [[{"query": q.query, "route": self.plans[i].as_dict()}]
                                           for i, q in enumerate(queries)]
        self.candidates: list[list[RetrievedMemory]] = [[] for _ in range(n)]
        self.states: list[dict | None] = [None] * n

    def step(self, name: str) -> None:
        if self.progress:
            self.progress(name, self.n, self.n)

    def retrieve(self, rows: list[int], first: bool) -> None:
        """One retrieval round for `rows` (their latest search), merged into their evidence."""
        q = self.queries
        hits = self.retriever.retrieve_routed([(q[i].user_id, self.searches[i][-1]["query"], q[i].as_of_position,
                                                self.plans[i], self.targets[i]) for i in rows], self.k)
        for i, hs in zip(rows, hits):
            found = [h.as_retrieved() for h in hs]
            self.candidates[i] = _in_order(found if first else merge_candidates(self.candidates[i], found))

    def research(self, it: int, todo: list[int]) -> list[int]:
        """One research batch over `todo`; returns the queries that asked for a follow-up search."""
        q = self.queries
        check_no_future(q, self.candidates, "evidence", rows=todo)  # defence in depth: the retriever masks already
        rs = generate_with_retry(self.llm, [
            ChatRequest(f"{q[i].query_id}/research{it}",
                        [{"role": "system", "content": RESEARCH_SYSTEM},
                         {"role": "user", "content": user_message(q[i], render_candidates(self.candidates[i])
                                                                  + "\n\nReturn the research notes as JSON.")}],
                        RESEARCH_SCHEMA, RESEARCH_MAX_TOKENS, "research",
                        metadata=call_tags(q[i].user_id, RESEARCH, q[i].query_id),
                        constraint_schema=alias_constraint(self.llm, RESEARCH_SCHEMA, len(self.candidates[i])))
            for i in todo
        ])
        follow: list[int] = []
        for i, r in zip(todo, rs):
            self.tokens.account(i, r)
            if not r.ok:
                if self.states[i] is None:  # a failed second round keeps the first round's notes
                    self.quarantine.append(quarantine_row(q[i], f"research{it}", r, ADAMEM_PROMPT_VERSION, self.created_at))
                continue
            self.states[i] = r.parsed
            fu = (r.parsed.get("follow_up") or "").strip()
            if it < MAX_ITERATIONS and not r.parsed.get("sufficient", True) and fu:
                follow.append(i)
                self.searches[i].append({"query": fu, "route": self.plans[i].as_dict()})
        return follow

    def answer(self, resolved: list) -> list[str | None]:
        """The working agent's answer (one batch) for every query with usable notes."""
        responses: list[str | None] = [None] * self.n
        answerable = [i for i in range(self.n) if resolved[i] is not None]
        answers = answer_queries(self.llm, self.queries, answerable, lambda i: "Research notes: " + json.dumps(resolved[i][0]),
                                 system=WORKING_SYSTEM, schema=WORKING_SCHEMA, max_tokens=WORKING_MAX_TOKENS,
                                 request_suffix="working", kind="working_answer", account=self.tokens.account)
        for i, a in answers.items():
            responses[i] = a
        return responses

    def output(self, resolved: list, responses: list[str | None]) -> StateOutput:
        by_id = candidate_index(self.candidates)
        rows = []
        for i, q in enumerate(self.queries):
            if resolved[i] is None:
                continue
            state, cited, dropped = resolved[i]
            rows.append({
                "query_id": q.query_id, "user_id": q.user_id, "query": q.query, "as_of_position": q.as_of_position,
                "strategy": "adamem", "needs": json.dumps({"target": self.targets[i], "cues": list(self.plans[i].cues)}),
                "plan": json.dumps(self.searches[i]), "plan_repaired": None,
                "candidates": candidate_structs(self.candidates[i]),
                "state": json.dumps(state), "cited_memory_ids": cited, "cited_turn_ids": cited_turns(cited, by_id),
                "dropped_citations": dropped, "response": responses[i], "model": self.llm.model_name,
                "prompt_version": ADAMEM_PROMPT_VERSION, "code_version": stage_version("query_states"),
                "prompt_tokens": self.tokens.per_query[i][0], "completion_tokens": self.tokens.per_query[i][1],
                "created_at": self.created_at,
            })
        states_df, q_df = output_frames(rows, self.quarantine)
        n = self.n
        stats = {"queries": n, "states": states_df.height, "quarantined": q_df.height,
                 "research_iterations_2": sum(1 for s in self.searches if len(s) > 1),
                 "dropped_citations": sum(r[2] for r in resolved if r),
                 "mean_candidates": (sum(map(len, self.candidates)) / n) if n else 0.0, **self.tokens.totals()}
        return StateOutput(states=states_df, quarantine=q_df, stats=stats)


def infer_adamem_states(
    queries: Sequence[Query], llm: LLMBackend, retriever: AdaMemRetriever, *, k: int = DEFAULT_K,
    created_at: datetime | None = None, progress: Progress | None = None,
) -> StateOutput:
    """Route plan -> retrieval -> research (<= MAX_ITERATIONS rounds, follow-ups retrieved between) ->
    working answer; each LLM stage one batch, each retrieval round one call, over all queries."""
    run = _AdaMemRun(queries, llm, retriever, k, created_at or datetime.now(timezone.utc), progress)
    run.retrieve(list(range(run.n)), first=True)
    run.step("retrieval 1")
    todo = list(range(run.n))
    for it in range(1, MAX_ITERATIONS + 1):
        follow = run.research(it, todo)
        run.step(f"research {it}")
        if not follow:
            break
        run.retrieve(follow, first=False)
        run.step(f"retrieval {it + 1}")
        todo = follow
    resolved = [resolve_citations(run.states[i], run.candidates[i]) if run.states[i] is not None else None
                for i in range(run.n)]
    responses = run.answer(resolved)
    run.step("working answer")
    return run.output(resolved, responses)


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
