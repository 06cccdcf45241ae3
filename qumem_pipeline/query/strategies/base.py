"""The one interface every query strategy implements, and the types and steps strategies share.

A strategy turns a batch of personalization queries into user states Z_q (QUMem §3.4): rows of
``STATE_SCHEMA`` plus quarantined failures. Every strategy is *stage-batched*: each LLM stage is
one batch over all queries of the run and each retrieval round one call, so a server sees full
batches. Strategies are registered by name in ``registry``; no strategy module imports another,
so what they share lives here (types, the Z_q schema, candidate rendering, citation resolution,
the answer step) and in ``qumem_pipeline.llm.retry``.

No-future-evidence rule: a candidate is usable only if its ``position`` (the latest turn it rests
on) is at or before the query's ``as_of_position``; ``check_no_future`` enforces it on whatever a
retriever returns (defence in depth: retrievers already mask future units).
"""

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Protocol, Sequence

import polars as pl

from qumem_pipeline.query.version import stage_version

from qumem_pipeline.llm.base import ChatRequest, ChatResult, LLMBackend
from qumem_pipeline.llm.retry import generate_with_retry
from qumem_pipeline.memories.call_ledger import QA, call_tags
from qumem_pipeline.query.strategies.state_labels import expand_aliases, expanding

Progress = Callable[[str, int, int], None]


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

_ID_LIST = {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}
# Z_q: facts, preference trajectory, insights, each citing candidate aliases (QUMem's A3 output;
# AdaMem's research agent extends it). Bounds keep small models' output cost predictable.
USER_STATE_SCHEMA = {
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


@dataclass
class StateOutput:
    states: pl.DataFrame
    quarantine: pl.DataFrame
    stats: dict[str, Any]


class QueryStrategy(ABC):
    """A named way of answering queries; ``registry`` maps names to instances.

    ``version`` is the prompt version the strategy records on every row (``prompt_version``);
    ``retriever_kind`` says which retriever ``infer`` expects (``"typed"``: ``Retriever`` over the
    typed memory stores; ``"adamem"``: ``adamem.retriever.AdaMemRetriever``); ``default_k`` is its
    top-k when the caller gives none (None: the pipeline's configured ``retrieval_k``).
    """

    name: str
    version: str
    retriever_kind: str = "typed"
    default_k: int | None = None

    @abstractmethod
    def infer(
        self,
        queries: Sequence[Query],
        llm: LLMBackend,
        retriever: Any,
        *,
        k: int | None = None,
        respond: bool = False,
        created_at: datetime | None = None,
        progress: Progress | None = None,
    ) -> StateOutput:
        """User states for all ``queries``, each stage one batch over all of them."""


def user_message(q: Query, extra: str) -> str:
    ctx = f"\nTask context: {q.task_context}" if q.task_context else ""
    return f"Current query: {q.query}{ctx}\n\n{extra}"


def human_date(ts: datetime) -> str:
    """A date as LoCoMo's answers write it ("7 May 2023"): day, month name, year."""
    return f"{ts.day} {ts:%B %Y}"


def render_candidates(cands: list[RetrievedMemory]) -> str:
    if not cands:
        return "Retrieved memories: (none)"
    lines = []
    for i, c in enumerate(cands, start=1):
        # the session date in words ("20 January 2023"), so "yesterday" in a memory or turn can be resolved
        when = f", stated {human_date(c.valid_from)}" if c.valid_from else f", turn {c.position}"
        lines.append(f"M{i} [{c.type}{when}]: {c.content}")
    return "Retrieved memories (oldest first):\n" + "\n".join(lines)


def alias_constraint(llm: Any, schema: dict, n_shown: int) -> dict | None:
    """A decoding schema whose ``memory_ids`` admit only the n aliases shown (M1..Mn), for a backend whose
    profile decodes plain text (the embedded small models), else None (decode against ``schema``).

    Why: the embedded 135M model cites "M1_2" for M1 and M2, so every citation of its states was dropped
    and its states rested on nothing (tests/test_dagster_pipeline.py). Larger models cite the aliases as
    shown; their recorded calls keep the schema they were made with."""
    from qumem_pipeline.llm.model_profiles import map_schema_nodes, output_bounds_of

    bounds = output_bounds_of(llm) or ""
    if "plain" not in bounds.split(","):
        return None
    shown = [f"M{i}" for i in range(1, n_shown + 1)]

    def only_shown(out: dict) -> dict:
        ids = out.get("properties", {}).get("memory_ids")
        if ids is not None:
            out["properties"] = {**out["properties"], "memory_ids": (
                {**ids, "items": {"type": "string", "enum": shown}} if shown else {**ids, "maxItems": 0})}
        return out

    return map_schema_nodes(schema, only_shown)


_CITED_ALIAS = re.compile(r"^\W*[Mm]\s*(\d{1,3})\W*$")


def citation_alias(value: object) -> str | None:
    """"M3" for a cited "M3", "m3", "[m3]" or "(M3)": small models wrap the alias they were shown (the embedded
    135M model writes "[m1]"), and a wrapped alias still names one shown memory."""
    m = _CITED_ALIAS.match(str(value))
    return f"M{int(m.group(1))}" if m else None


def resolve_citations(state: dict, cands: list[RetrievedMemory]) -> tuple[dict, list[str], int]:
    """Replace aliases (M3) with memory ids; drop citations of anything not retrieved. Aliases written in
    the state's text become the memories' texts (``state_labels``), cited by the item."""
    alias = {f"M{i}": c.memory_id for i, c in enumerate(cands, start=1)}
    texts = {a: (c.memory_id, c.content) for a, c in zip(alias, cands)}
    expand = expanding()
    cited: list[str] = []
    dropped = 0
    out: dict[str, list] = {}
    for section in ("facts", "preference_trajectory", "insights"):
        items = []
        for item in state.get(section, []) or []:
            ids = []
            for a in item.get("memory_ids", []) or []:
                mid = alias.get(citation_alias(a))
                if mid is None:
                    dropped += 1
                elif mid not in ids:
                    ids.append(mid)
            item = dict(item)
            if expand:
                for key, value in list(item.items()):
                    if key != "memory_ids" and isinstance(value, str):
                        item[key], more, missing = expand_aliases(value, texts)
                        ids += [m for m in more if m not in ids]
                        dropped += missing
            items.append({**item, "memory_ids": ids})
            cited.extend(ids)
        out[section] = items
    return out, list(dict.fromkeys(cited)), dropped


def check_no_future(queries: Sequence[Query], candidates: Sequence[list[RetrievedMemory]], what: str = "memories",
                    rows: Sequence[int] | None = None) -> None:
    """Refuse candidates after as_of: a unit's position, or any turn it rests on, past the query's as_of."""
    for i in (range(len(queries)) if rows is None else rows):
        as_of = queries[i].as_of_position
        future = [c.memory_id for c in candidates[i]
                  if c.position > as_of or any(t > as_of for t in c.evidence_turn_ids)]
        if future:
            raise AssertionError(f"retriever returned {what} after as_of for query {queries[i].query_id}: {future}")


def answer_queries(
    llm: LLMBackend, queries: Sequence[Query], todo: Sequence[int], notes: Callable[[int], str], *,
    system: str, schema: dict, max_tokens: int, request_suffix: str, kind: str,
    account: Callable[[int, ChatResult], None],
) -> dict[int, str | None]:
    """One batched answer call per query in ``todo`` over ``notes(i)`` (the qumem response step Psi
    and AdaMem's working answer); unusable output twice gives None."""
    results = generate_with_retry(llm, [
        ChatRequest(f"{queries[i].query_id}/{request_suffix}",
                    [{"role": "system", "content": system},
                     {"role": "user", "content": user_message(queries[i], notes(i) + '\n\nReturn {"answer": "..."}.')}],
                    schema, max_tokens, kind, metadata=call_tags(queries[i].user_id, QA, queries[i].query_id))
        for i in todo
    ])
    out: dict[int, str | None] = {}
    for i, r in zip(todo, results):
        account(i, r)
        out[i] = (r.parsed or {}).get("answer") if r.ok else None
    return out


class TokenCounts:
    """Prompt/completion tokens per query, summed over every stage that served it."""

    def __init__(self, n: int):
        self.per_query = [[0, 0] for _ in range(n)]

    def account(self, i: int, r: ChatResult) -> None:
        self.per_query[i][0] += r.prompt_tokens
        self.per_query[i][1] += r.completion_tokens

    def add(self, i: int, prompt: int, completion: int) -> None:
        self.per_query[i][0] += prompt
        self.per_query[i][1] += completion

    def totals(self) -> dict[str, int]:
        return {"prompt_tokens": sum(t[0] for t in self.per_query),
                "completion_tokens": sum(t[1] for t in self.per_query)}


def candidate_structs(cands: list[RetrievedMemory]) -> list[dict]:
    return [{"memory_id": c.memory_id, "type": c.type, "score": float(c.score), "position": int(c.position)} for c in cands]


def candidate_index(candidates: Sequence[list[RetrievedMemory]]) -> dict[str, RetrievedMemory]:
    return {c.memory_id: c for cs in candidates for c in cs}


def cited_turns(cited: list[str], by_id: dict[str, RetrievedMemory]) -> list[int]:
    """The turns the cited memories rest on, sorted (``by_id``: ``candidate_index`` of the run)."""
    return sorted({t for m in cited for t in by_id[m].evidence_turn_ids})


def output_frames(rows: list[dict], quarantine: list[dict]) -> tuple[pl.DataFrame, pl.DataFrame]:
    states = pl.DataFrame(rows, schema=STATE_SCHEMA) if rows else STATE_SCHEMA.to_frame()
    q = pl.DataFrame(quarantine, schema=QUERY_QUARANTINE_SCHEMA) if quarantine else QUERY_QUARANTINE_SCHEMA.to_frame()
    return states, q.with_columns(code_version=pl.lit(stage_version("query_states"), pl.String))


def quarantine_row(q: Query, stage: str, r: ChatResult, prompt_version: str, created_at: datetime) -> dict:
    return {"query_id": q.query_id, "user_id": q.user_id, "stage": stage, "reason": r.error or "no output",
            "raw": r.raw_text[:4096], "prompt_version": prompt_version, "created_at": created_at}
