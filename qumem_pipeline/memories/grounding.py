"""A small model's memory rests on the turns of its episode that hold its words, or it is not kept.

Why: on the example archive half of SmolLM2-135M's memories were grounded in the turns they cite, 71 % in their
episode as a whole (`bench/embedded_models.py`; grounded: at least half the memory's content words found in the
turns, `readability.is_grounded`). The gap is citations: the model writes a true memory and cites the wrong turn.
The rest are invented from the prompt's own words ("The user chose to use a specific object"). So, for a model
whose profile gates its memories (`model_profiles.ModelProfile.memory_gate`): a memory whose words are mostly
absent from its episode is dropped and counted; the others cite the turns that hold their words (the cited ones
that hold any, then, while a turn adds one of its words, the turn adding most of them).
"""

from collections.abc import Sequence
from typing import Any

from qumem_pipeline.memories.readability import content_words, evidence_vocabulary, is_grounded


def supporting_turns(content: str, cited: Sequence[int], turns: Sequence[Any], max_ids: int) -> list[int] | None:
    """The turn ids ``content`` rests on among ``turns`` (objects with turn_index, text, speaker, role), or None
    when the episode as a whole does not ground it."""
    words = set(content_words(content))
    vocab = {t.turn_index: evidence_vocabulary([{"text": t.text, "speaker": t.speaker, "role": t.role}]) for t in turns}
    if not words or not is_grounded(content, set().union(*vocab.values()) if vocab else set()):
        return None
    chosen = [t for t in dict.fromkeys(cited) if t in vocab and vocab[t] & words][:max_ids]
    have = set().union(*(vocab[t] for t in chosen)) if chosen else set()
    while len(chosen) < max_ids:
        gain, best = max(((len((vocab[t] & words) - have), -t) for t in vocab if t not in chosen), default=(0, 0))
        if gain == 0:
            break
        chosen.append(-best)
        have |= vocab[-best]
    return sorted(chosen) if chosen else None
