"""Reading a structured output that a whitespace run cut at its token budget.

Why: under a grammar that lets free whitespace into JSON, a string that hits its `maxLength` is
closed for the model mid-sentence, and a model that still wants to write fills the only thing the
grammar then allows, whitespace, until `max_tokens` (issue 18: Qwen2.5-Coder-1.5B's A1 calls on
LoCoMo, a `"why"` closed by its `maxLength`). Everything before the run
is finished JSON; greedy decoding would write the same run again on a retry. So the prefix is closed
(open strings left alone: a cut inside a string is not salvaged) and kept when it parses and validates
against the request's schema.
"""

import json
from typing import Any

import jsonschema

# Trailing whitespace at least this long counts as a run (the hint in the backends' errors uses it too).
WHITESPACE_RUN_CHARS = 32


def ends_in_whitespace_run(text: str) -> bool:
    """Whether `text` ends in a run of free whitespace long enough to be degenerate, not layout."""
    return len(text) >= WHITESPACE_RUN_CHARS and not text[-WHITESPACE_RUN_CHARS:].strip()


def _closers(prefix: str) -> str | None:
    """The brackets that close `prefix`, innermost first; None when it ends inside a string."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in prefix:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    return None if in_string else "".join(reversed(stack))


def salvage_whitespace_cut(text: str, schema: dict[str, Any] | None) -> dict | None:
    """The object a whitespace-run cut output says, closed after its last finished value, or None.

    None unless the text ends in a whitespace run, the prefix ends after a value (a trailing comma
    is dropped), and the closed text parses to an object that validates against `schema`."""
    if not ends_in_whitespace_run(text):
        return None
    prefix = text.rstrip()
    if prefix.endswith(","):
        prefix = prefix[:-1].rstrip()
    closers = _closers(prefix)
    if closers is None:
        return None
    try:
        value = json.loads(prefix + closers)
    except json.JSONDecodeError:
        return None  # e.g. cut after a key, before its value
    if not isinstance(value, dict):
        return None
    if schema is not None:
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError:
            return None
    return value
