"""The QA run's strategies, defaults and the one answer prompt every strategy shares; ANSWER_PROMPT_VERSION fingerprints it."""

import hashlib
import json

QA_STRATEGIES = ("none", "full_history", "topk_turns", "topk_memories", "qumem", "adamem", "qumem_hybrid",
                 "qumem_evidence", "adamem_turns")
MEMORY_STRATEGIES = ("topk_memories", "qumem", "qumem_hybrid", "qumem_evidence")  # nothing to show without memories
ADAMEM_STRATEGIES = ("adamem", "adamem_turns")  # AdaMem's state: uses memories when there are, turns alone otherwise
STATE_STRATEGIES = ("qumem", "adamem", "qumem_hybrid", "qumem_evidence", "adamem_turns")  # answered from a user state
HEADLINE = (1, 2, 3, 4)
DEFAULT_WORDS = 512
DEFAULT_CHUNK = 32
DEFAULT_CONTEXT_TOKENS = 8192  # when the model's own window is unknown
ANSWER_MAX_TOKENS = 64
QUMEM_K = 5
ABSTAIN_ANSWER = "Not mentioned in the conversation"

ANSWER_SYSTEM = (
    "You answer questions about a long conversation between two people, using only the context given "
    "with the question. Answer with JSON only."
)
# LoCoMo's QA prompt (snap-research/locomo task_eval/evaluate_gpts.py, QA_PROMPT), plus how to abstain.
ANSWER_INSTRUCTION = (
    "Based on the above context, write an answer in the form of a short phrase for the following question. "
    "Answer with exact words from the context whenever possible. Where lines carry the date they were said, "
    "resolve relative dates such as 'yesterday' or 'last week' against it. "
    f"Answer \"{ABSTAIN_ANSWER}\" only when the context says nothing about the question."
)
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 200}},
                 "required": ["answer"], "additionalProperties": False}
# How contexts are rendered is part of what an answer depends on, so it is in the version (a checkpoint
# row answered from an older rendering is answered again; the ledger still replays identical calls).
CONTEXT_FORMAT = ("v4: state items carry the dates of what they cite; candidates and turns carry session dates; "
                  "a state's facts are the memories they cite, verbatim; then the other retrieved candidates, "
                  "within the word budget")
ANSWER_PROMPT_VERSION = "locomo-qa-v2-" + hashlib.sha256(
    json.dumps([ANSWER_SYSTEM, ANSWER_INSTRUCTION, ANSWER_SCHEMA, ANSWER_MAX_TOKENS, CONTEXT_FORMAT],
               sort_keys=True).encode()).hexdigest()[:10]


def answer_messages(context: str, question: str) -> list[dict]:
    """Context first, question last: a long shared context stays a cacheable prefix."""
    return [{"role": "system", "content": ANSWER_SYSTEM},
            {"role": "user", "content": f"{context}\n\n{ANSWER_INSTRUCTION}\n\nQuestion: {question}\n"
                                        'Return {"answer": "..."}.'}]
