"""Shared tokenisation for the lexical index and the graph's topic/entity keys."""

import re

_TOKEN = re.compile(r"[a-z0-9]+")
_CAPITALISED = re.compile(r"\b([A-Z][a-z]{2,})\b")
STOPWORDS = frozenset(
    "a about above after again against all also am an and any are as at be because been before being below "
    "between both but by can could did do does doing down during each few for from further had has have having "
    "he her here hers herself him himself his how i if in into is it its itself just me more most my myself no "
    "nor not now of off on once only or other our ours ourselves out over own same she should so some such than "
    "that the their theirs them themselves then there these they this those through to too under until up very "
    "was we were what when where which while who whom why will with would you your yours yourself yourselves "
    "get got like really yeah yes oh okay ok thanks thank know think going go one lot much way things thing "
    "it's i'm that's don't can't didn't time well good great sure".split()
)


def tokens(text: str | None) -> list[str]:
    """Lower-case alphanumeric tokens, stopwords dropped (kept in order, duplicates kept)."""
    return [t for t in _TOKEN.findall((text or "").lower()) if t not in STOPWORDS and len(t) > 1]


def entities(text: str | None) -> list[str]:
    """Capitalised words not at a sentence start: a cheap, deterministic named-entity cue."""
    out = []
    for m in _CAPITALISED.finditer(text or ""):
        before = (text or "")[: m.start()].rstrip()
        if before and before[-1] not in ".!?:\"'(" and m.group(1).lower() not in STOPWORDS:
            out.append(m.group(1).lower())
    return list(dict.fromkeys(out))
