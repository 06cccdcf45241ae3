"""The small model's memories rest on the turns of their episode that hold their words (memories/grounding.py)."""

from datetime import datetime, timezone

from qumem_pipeline.memories.grounding import supporting_turns
from qumem_pipeline.memories.parsing import DecomposeStats, memories_from_output
from qumem_pipeline.memories.prompts import Episode, Turn

TURNS = [
    Turn(4, "user", "I signed up for the open water swim at Salford Quays", "Bob"),
    Turn(5, "assistant", "Great! When is it?"),
    Turn(6, "user", "On 15 September, 1.5 km, so I train three mornings a week", "Bob"),
]


def test_a_true_memory_citing_the_wrong_turn_cites_the_turns_that_hold_its_words():
    # cited the assistant's turn; its words are in turns 4 and 6
    assert supporting_turns("Bob signed up for the Salford Quays swim on 15 September, training three mornings",
                            [5], TURNS, 8) == [4, 6]
    # a cited turn that holds its words stays cited, and is enough
    assert supporting_turns("Bob trains three mornings a week", [6], TURNS, 8) == [6]


def test_a_memory_its_episode_does_not_hold_is_not_kept():
    assert supporting_turns("The user chose to use a specific object", [4], TURNS, 8) is None
    assert supporting_turns("The user is a professional swimmer at the Olympics", [4], TURNS, 8) is None
    assert supporting_turns("", [4], TURNS, 8) is None


def test_the_gate_counts_what_it_drops_and_only_the_gated_model_is_repaired():
    ep = Episode("bob", "e1", TURNS)
    out = {"memories": [{"content": "Bob signed up for the open water swim at Salford Quays", "evidence_turn_ids": [5]},
                        {"content": "The user chose to use a specific object", "evidence_turn_ids": [4]}]}
    kw = dict(model="m", prompt_version="p", code_version="c", created_at=datetime.now(timezone.utc))
    stats = DecomposeStats()
    kept = memories_from_output(ep, "fact", out, stats, gate=True, **kw)
    assert [(m["evidence_turn_ids"], m["position"]) for m in kept] == [([4], 4)] and stats.memories_dropped_ungrounded == 1
    plain = memories_from_output(ep, "fact", out, DecomposeStats(), gate=False, **kw)
    assert [m["evidence_turn_ids"] for m in plain] == [[5], [4]]  # as the model cited them
