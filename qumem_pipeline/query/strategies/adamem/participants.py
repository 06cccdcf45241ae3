"""Participant resolution (AdaMem §3.2): which participant a question is about, from explicit mentions.

A user's history holds two participants: the user (role ``user``) and the other side (role
``assistant`` or ``other``, e.g. the second LoCoMo speaker). A question resolves to ``user``,
``other``, ``both`` or ``ambiguous``; ambiguous questions are answered from both bundles and fused,
so uncertainty about the referent reaches retrieval instead of being hidden in generation.

Rules, in order: a name (or first name) of each participant as a whole word; first-person words
("I", "my", ...) point at the user, second-person words ("you", "your") at the other side - the
question is asked *by* the user *to* the assistant. Both sides mentioned -> ``both``; none -> ``ambiguous``.
"""

import re
from dataclasses import dataclass

import polars as pl

USER, OTHER, BOTH, AMBIGUOUS = "user", "other", "both", "ambiguous"
TARGETS = (USER, OTHER, BOTH, AMBIGUOUS)
FIRST_PERSON = {"i", "me", "my", "mine", "myself", "i'm", "i've", "i'd", "i'll"}
SECOND_PERSON = {"you", "your", "yours", "yourself", "you're", "you've", "you'd", "you'll"}
_WORD = re.compile(r"[a-z0-9']+")


@dataclass(frozen=True)
class Participants:
    """The names each side goes by in this user's history (lower-case, first names included)."""

    user_names: frozenset
    other_names: frozenset

    @classmethod
    def from_turns(cls, turns: pl.DataFrame, user_id: str | None = None) -> "Participants":
        """Speaker names by role; the user id's last dash-part (conv-26-caroline -> caroline) counts too."""
        def names(df: pl.DataFrame) -> set[str]:
            out: set[str] = set()
            for sp in df["speaker"].drop_nulls().unique().to_list() if df.height else []:
                full = sp.strip().lower()
                if full and full not in ("assistant", "user"):
                    out.add(full)
                    out.add(full.split()[0])
            return out

        user = names(turns.filter(pl.col("role") == "user"))
        other = names(turns.filter(pl.col("role") != "user"))
        if user_id:
            user.add(user_id.rsplit("-", 1)[-1].lower())
        return cls(frozenset(user - other), frozenset(other - user))


def _words(question: str) -> list[str]:
    """Lower-case words with possessives stripped (Caroline's -> caroline)."""
    return [w[:-2] if w.endswith("'s") else w.rstrip("'") for w in _WORD.findall(question.lower())]


def _mentions(question: str, names: frozenset) -> bool:
    q = " " + " ".join(_words(question)) + " "
    return any(f" {n} " in q for n in names)


def resolve(question: str, participants: Participants) -> str:
    """``user`` | ``other`` | ``both`` | ``ambiguous`` from explicit mentions in the question."""
    if not isinstance(question, str):
        raise TypeError(f"question must be text, got {type(question).__name__}")
    words = set(_words(question))
    user = _mentions(question, participants.user_names) or bool(words & FIRST_PERSON)
    other = _mentions(question, participants.other_names) or bool(words & SECOND_PERSON)
    if user and other:
        return BOTH
    return USER if user else OTHER if other else AMBIGUOUS


def owners_for(target: str) -> set[str]:
    """Which bundles to search: ambiguous and both search both, then fuse."""
    if target not in TARGETS:
        raise ValueError(f"unknown participant target {target!r}; expected one of {TARGETS}")
    return {USER} if target == USER else {OTHER} if target == OTHER else {USER, OTHER}


def turn_owner(role: str) -> str:
    """Who said a turn: the user, or the other side (assistant / other speaker)."""
    return USER if role == "user" else OTHER
