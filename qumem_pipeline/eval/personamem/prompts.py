"""The two ways a PersonaMem answer is chosen, and their versions.

- ``choice``: the model sees the strategy's context, the user's new message and the four candidate
  responses, and returns one letter under a JSON schema (as the benchmark's generative setting);
- ``likelihood``: the model sees the context and the user's message, and each candidate response
  is scored by its length-normalised log-likelihood as the assistant's reply (prefill only; steadier
  than a generated letter for small models, lm-evaluation-harness style).

Context first, the user's message and options last: a context shared by many questions (the
truncated full history) stays a cacheable prefix.
"""

import hashlib
import json

from qumem_pipeline.eval.personamem.data import LETTERS

CHOICE_SYSTEM = (
    "You are a personal assistant who has talked with this user before. What you know about the user is in "
    "the context. Pick the response that best fits this user: what they told you, and what they prefer now "
    "(their latest preferences win over older ones). Answer with JSON only."
)
CHOICE_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": list(LETTERS)}},
                 "required": ["answer"], "additionalProperties": False}
CHOICE_MAX_TOKENS = 12
LIKELIHOOD_SYSTEM = (
    "You are a personal assistant who has talked with this user before. What you know about the user is in "
    "the context. Reply to the user's message in a way that fits them: what they told you, and what they "
    "prefer now."
)
CONTEXT_FORMAT = "v1: context, then the user's message; options lettered (a)-(d) for choice"
PROMPT_VERSION = "personamem-mc-v1-" + hashlib.sha256(json.dumps(
    [CHOICE_SYSTEM, CHOICE_SCHEMA, CHOICE_MAX_TOKENS, LIKELIHOOD_SYSTEM, CONTEXT_FORMAT], sort_keys=True).encode()
).hexdigest()[:10]


def choice_messages(context: str, message: str, options: tuple[str, ...]) -> list[dict]:
    lettered = "\n".join(f"({LETTERS[i]}) {o}" for i, o in enumerate(options))
    return [{"role": "system", "content": CHOICE_SYSTEM},
            {"role": "user", "content": f"{context}\n\nThe user's new message: {message}\n\nCandidate responses:\n"
                                        f"{lettered}\n\nWhich response fits this user best? "
                                        'Return {"answer": "<a, b, c or d>"}.'}]


def likelihood_messages(context: str, message: str) -> list[dict]:
    """The prefix every option is scored after (the option is the assistant's reply)."""
    return [{"role": "system", "content": LIKELIHOOD_SYSTEM},
            {"role": "user", "content": f"{context}\n\nThe user's new message: {message}"}]
