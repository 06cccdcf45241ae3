"""QUMem's agents (§3.4): the prompts and output schemas of A1 (information needs), A2 (retrieval
plan), A3 (user state Z_q) and the response step Psi, and the version that names them.

Shared by the ``qumem`` strategy (A1 -> A2 -> retrieval -> A3) and the ``topk`` baseline (retrieval
-> A3), which record the same ``QUERY_PROMPT_VERSION``: one fingerprint over all four prompts, so a
change to any of them marks every query state stale. Data only; the steps live in ``qumem``
(planning) and ``user_state`` (A3, Psi).
"""

import hashlib
import json

from qumem_pipeline.memories.decompose import MEMORY_TYPES
from qumem_pipeline.query.strategies.base import USER_STATE_SCHEMA

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
A3_SCHEMA = USER_STATE_SCHEMA
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
