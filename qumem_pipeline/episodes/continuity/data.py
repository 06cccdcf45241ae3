"""Training/evaluation pairs from TIAGE (or any :class:`~qumem_pipeline.episodes.dialogues.Dialogue`).

Each adjacent pair (utterance t-1, utterance t) of a dialogue is one example. TIAGE label "1" on
utterance t (new topic) -> ``same = 0``; "0" -> ``same = 1``; the first utterance ("-1") has no pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from qumem_pipeline.runtime.datasets import tiage_path
from qumem_pipeline.episodes.dialogues import Dialogue, read_dialogues


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    same: int
    dial_id: str
    gap: int  # index of the gap: pair (utterances[gap], utterances[gap + 1])


def dialogue_pairs(dialogues: list[Dialogue]) -> list[Pair]:
    out = []
    for d in dialogues:
        for i, bnd in enumerate(d.boundaries):
            out.append(Pair(d.utterances[i], d.utterances[i + 1], 0 if bnd else 1, d.dial_id, i))
    return out


def load_tiage(split: str) -> list[Dialogue]:
    path = tiage_path(split)
    if not path.is_file():
        raise FileNotFoundError(f"TIAGE {split} split not found at {path}")
    return read_dialogues(path, "tiage").dialogues
