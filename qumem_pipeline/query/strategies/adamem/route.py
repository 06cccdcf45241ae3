"""Deterministic cue detection and the question-conditioned route plan (AdaMem §3.3).

Cues come from fixed word patterns; each cue widens the plan within hard bounds, and a question
with no cue stays single-hop on plain semantic retrieval (no graph expansion), so simple
questions stay cheap and semantic retrieval stays dominant. Several cues merge by taking the
widest hop count / seed count and the larger prior per edge type.
"""

import re
from dataclasses import asdict, dataclass, field

TEMPORAL, RELATIONAL, ATTRIBUTE, SINGLE_HOP = "temporal", "relational", "attribute", "single-hop"
MAX_HOPS, MAX_SEEDS = 2, 6
HOP_DECAY = 0.6

_CUES = {
    TEMPORAL: r"\b(when|before|after|first|last|ago|dates?|years?|months?|weeks?|days?|since|how long|during|"
              r"recent(ly)?|earlier|later|yesterday|today|tomorrow|until|time|weekend|monday|tuesday|wednesday|"
              r"thursday|friday|saturday|sunday|january|february|march|april|may|june|july|august|september|"
              r"october|november|december|\d{4})\b",
    RELATIONAL: r"\b(why|because|cause[sd]?|reason|led to|lead to|result|affect(ed)?|both|together|in common|"
                r"relationship|related|between|friends?|family|partner|kids?|children|husband|wife|mother|father|"
                r"how did .* (feel|react|help)|what might|would .* likely)\b",
    ATTRIBUTE: r"\b(likes?|enjoys?|prefers?|preferences?|favou?rite|hobb(y|ies)|personality|identity|values?|"
               r"interest(s|ed)?|passion(ate)?|career|job|traits?|kind of person|what .* (is|are) .* into|"
               r"would .* (want|pursue|consider|be))\b",
}
_COMPILED = {k: re.compile(v, re.IGNORECASE) for k, v in _CUES.items()}

# Edge-type priors per cue: which relations are worth following for that kind of question.
_PRIORS = {
    TEMPORAL: {"supports": 0.9, "in-episode": 0.8, "next-episode": 0.7, "same-topic": 0.5},
    RELATIONAL: {"mentions-entity": 0.9, "same-topic": 0.8, "supports": 0.8, "in-episode": 0.6, "summarises": 0.6,
                 "next-episode": 0.4},
    ATTRIBUTE: {"summarises": 1.0, "supports": 0.8, "same-topic": 0.6, "mentions-entity": 0.4},
}
# (hops, seeds). Topic, entity and episode nodes are hubs between units, so reaching a neighbouring
# turn or memory through one takes two hops; one hop only reaches supports/summarises neighbours.
_SHAPE = {TEMPORAL: (2, 4), RELATIONAL: (2, 5), ATTRIBUTE: (2, 3)}


@dataclass(frozen=True)
class RoutePlan:
    cues: tuple[str, ...]
    expand: bool
    hops: int
    seeds: int
    edge_priors: dict = field(default_factory=dict)
    hop_decay: float = HOP_DECAY
    # fusion: baseline rank score, graph rank score, linear recency prior, fact-support bonus
    w_baseline: float = 1.0
    w_graph: float = 0.5
    w_recency: float = 0.1
    fact_bonus: float = 0.1

    def as_dict(self) -> dict:
        return asdict(self)


def detect_cues(question: str) -> tuple[str, ...]:
    """The cues present, in a fixed order; ``("single-hop",)`` when none is."""
    found = tuple(c for c in (TEMPORAL, RELATIONAL, ATTRIBUTE) if _COMPILED[c].search(question or ""))
    return found or (SINGLE_HOP,)


def plan_route(question: str) -> RoutePlan:
    cues = detect_cues(question)
    if cues == (SINGLE_HOP,):
        return RoutePlan(cues, expand=False, hops=0, seeds=0)
    priors: dict[str, float] = {}
    for c in cues:
        for t, p in _PRIORS[c].items():
            priors[t] = max(priors.get(t, 0.0), p)
    hops = min(MAX_HOPS, max(_SHAPE[c][0] for c in cues))
    seeds = min(MAX_SEEDS, max(_SHAPE[c][1] for c in cues) + len(cues) - 1)
    return RoutePlan(cues, expand=True, hops=hops, seeds=seeds, edge_priors=dict(sorted(priors.items())))
