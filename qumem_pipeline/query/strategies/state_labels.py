"""A user state's text never points at a memory by its alias: "M10" in a state's text becomes what M10 says.

Why: A3 sees candidates as aliases (M1, M2, ...) and small models write them where text belongs. On
PersonaMem the 1.5B evaluation model's state for a recommendation question read
``"earlier": "M10", "current": "M11"`` (docs/evaluation.md#personamem), so the answer step never saw
the preference; 51 of the record's 2,058 states of that model hold aliases in their text, and the
embedded 135M model's states are mostly labels ("preference: M1: M1 -> M1"). Aliases mean nothing
outside the call that showed them: a state stored with them is unreadable and unusable.

A text that is only aliases (and joining words: "M1, M3", "M1 -> M2") becomes the memories' texts
joined by "; "; an alias inside a sentence is replaced by the memory's text in quotes. In a text that
is only aliases, one of a memory that was not shown is removed and counted as a dropped citation; in a
sentence, a token that names no shown memory is left as written ("the M25 motorway"). Every alias that
resolves is added to the item's ``memory_ids``, since the text now rests on it.

Evaluation tables measured before this rule replay with it off (``raw_state_labels``), as they were
measured: a recorded answer call is keyed by the exact state text it was shown.
"""

import contextvars
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

ALIAS = re.compile(r"\b[Mm](\d{1,3})\b")  # the embedded model also writes "[m1]"
# what may stand between aliases in a text that is only aliases: punctuation, arrows, joining words
_JOINERS = re.compile(r"(?i)^(?:[\s,;:/&+\-–—>→|.()\[\]]|\b(?:and|or|then|to|vs|from|now|later)\b)*$")

STATE_LABEL_MODES = ("expanded", "raw")
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("qumem_state_labels", default="expanded")


@contextmanager
def raw_state_labels(raw: bool = True) -> Iterator[None]:
    """Within the block, states keep aliases in their text (only evaluation replays of older tables ask)."""
    token = _MODE.set("raw" if raw else "expanded")
    try:
        yield
    finally:
        _MODE.reset(token)


def state_label_mode() -> str:
    return _MODE.get()


def expanding() -> bool:
    return _MODE.get() == "expanded"


def expand_aliases(text: str, memories: Mapping[str, tuple[str, str]]) -> tuple[str, list[str], int]:
    """(text with aliases replaced, memory ids of the aliases that resolved, aliases that did not).

    ``memories``: alias ("M3") -> (memory id, memory text)."""
    found = ALIAS.findall(text)
    if not found or not any(f"M{n}" in memories for n in found):
        return text, [], 0  # no alias that names a shown memory: "the M25 motorway" stays as written
    resolved = [memories[f"M{n}"] for n in found if f"M{n}" in memories]
    ids = list(dict.fromkeys(mid for mid, _ in resolved))
    if _JOINERS.match(ALIAS.sub(" ", text)):
        missing = sum(1 for n in found if f"M{n}" not in memories)
        return "; ".join(dict.fromkeys(t.strip() for _, t in resolved)), ids, missing

    def one(m: re.Match) -> str:
        hit = memories.get(m.group(0).upper())
        return f'"{hit[1].strip()}"' if hit else m.group(0)
    return " ".join(ALIAS.sub(one, text).split()), ids, 0
