"""The readability rules on hand-made rows: each case is built so that a wrong rule (a missed bracket form,
a stop word counted, speaker names not looked up, labels counted as content) flips its answer."""

import json

import polars as pl
import pytest

from qumem_pipeline.memories import readability as rd


def test_content_words_drop_short_and_stop_words():
    assert rd.content_words("The user would like to swim 1.5 km at Salford Quays") == ["user", "swim", "salford", "quays"]
    assert rd.content_words(None) == []


@pytest.mark.parametrize("text,slot", [
    ("The user [user_name] likes tea", True),
    ("Hello {name}, your order shipped", True),
    ("The user <user> asked about flights", True),
    ("The user [depth_depth_depth_depth", True),  # cut before the bracket closed
    ("The user signed up (age group 30-39) for a swim", False),
    ("The user prefers aisle seats [2024]", False),  # a bracketed number is not a placeholder
    ("The user said 3 < 5 and 7 > 2", False),
])
def test_template_slots(text, slot):
    assert rd.has_template_slot(text) is slot


def test_near_empty_counts_content_words_not_tokens():
    assert rd.is_near_empty("The user is the one who")  # one content word ("user") among six tokens
    assert rd.is_near_empty("The user likes it")  # two: user, likes
    assert not rd.is_near_empty("The user likes green tea")  # three: user, likes, green


def test_repeated_phrase_needs_two_words_three_times():
    assert rd.has_repeated_phrase("which is a one-shot, which is a one-shot, which is a one-shot")
    assert rd.has_repeated_phrase("The user depth_depth_depth_depth")  # underscores split words
    assert not rd.has_repeated_phrase("which is a one-shot, which is a one-shot")  # twice only
    assert not rd.has_repeated_phrase("tea tea coffee, tea and tea")  # one word repeated, no pair three times


def test_grounded_uses_evidence_words_and_speaker_names():
    turns = [{"text": "I signed up for the open water swim at Salford Quays!", "speaker": "Caroline", "role": "user"}]
    vocab = rd.evidence_vocabulary(turns)
    assert rd.is_grounded("Caroline signed up for an open water swim", vocab)
    assert rd.is_grounded("Caroline likes swim", vocab)  # 2 of 3 only with the speaker's name looked up
    assert not rd.is_grounded("Caroline likes swim", rd.evidence_vocabulary([{"text": turns[0]["text"]}]))
    assert rd.is_grounded("The user likes swim", vocab)  # "user" from the role
    assert not rd.is_grounded("Caroline enjoys cycling through mountain villages", vocab)  # 1 of 5
    assert not rd.is_grounded("It is", vocab)  # no content word at all
    # exactly half counts as grounded, under half does not
    assert rd.is_grounded("Caroline likes cycling swim", vocab)
    assert not rd.is_grounded("Caroline likes cycling hiking", vocab)


def _state(facts=(), prefs=(), insights=()):
    return json.dumps({
        "facts": [{"statement": s, "memory_ids": ["M1"]} for s in facts],
        "preference_trajectory": [{"aspect": a, "earlier": e, "current": c, "applies_now_because": b, "memory_ids": ["M1"]}
                                  for a, e, c, b in prefs],
        "insights": [{"insight": s, "memory_ids": ["M2"]} for s in insights],
    })


def test_states_made_of_labels():
    assert rd.state_made_of_labels(_state(prefs=[("M1", "M1", "M1", "M1")]))
    assert rd.state_made_of_labels(_state(facts=["M1 -> M2", "fact M3"]))
    # memory ids as the tables write them count as labels too
    assert rd.state_made_of_labels(_state(facts=["mem_ab12 mem_cd34 fact"]), memory_ids={"mem_ab12", "mem_cd34"})
    readable = _state(prefs=[("diet", "vegetarian since school", "vegan since April", "high cholesterol result")])
    assert not rd.state_made_of_labels(readable)
    assert not rd.state_is_empty(readable)
    assert rd.state_is_empty(_state()) and not rd.state_made_of_labels(_state())
    assert not rd.state_made_of_labels(_state(facts=["The user (M1) flies long-haul to Tokyo every spring"]))


def _tables():
    turns = pl.DataFrame({
        "user_id": ["u1", "u1", "u2"],
        "turn_index": [0, 1, 0],
        "role": ["user", "assistant", "user"],
        "speaker": ["Alice", None, "Bob"],
        "text": ["I went vegan in April after my cholesterol test.", "Great, here are vegan recipes.",
                 "Booked a window seat for the Tokyo flight."],
    })
    memories = pl.DataFrame({
        "memory_id": ["m1", "m2", "m3", "m4"],
        "user_id": ["u1", "u1", "u2", "u2"],
        "content": ["Alice went vegan in April after a cholesterol test",  # good
                    "The user [user_name]",  # slot; three content words (user, user, name), so not near-empty
                    "Bob booked a window seat, a window seat, a window seat",  # repeat, grounded
                    "Bob loves jazz concerts downtown"],  # ungrounded
        "evidence_turn_ids": [[0], [0, 1], [0], [0]],
    })
    ledger = pl.DataFrame({"request_id": ["a", "a", "b", "c", "d", "x"],
                           "stage": ["decompose", "decompose", "decompose", "decompose", None, "a3"]})
    quarantine = pl.DataFrame({"request_id": ["b"]})
    states = pl.DataFrame({"user_id": ["u1", "u2"], "cited_memory_ids": [["m1"], []],
                           "state": [_state(prefs=[("m1", "m1", "m1", "")]), _state(facts=["Bob books window seats for long flights"])]})
    return memories, turns, states, ledger, quarantine


def test_rates_on_tables():
    memories, turns, states, ledger, quarantine = _tables()
    got = rd.rates(memories, turns, states, ledger, quarantine)
    assert got["decompose_calls"] == 4 and got["quarantined_calls"] == 1 and got["schema_valid_rate"] == 0.75
    assert got["memories"] == 4
    assert got["template_slot_rate"] == 0.25
    assert got["repeated_phrase_rate"] == 0.25
    # m1 and m3 grounded; m2's words user, user, name: "user" from the role, "name" nowhere -> 2 of 3 grounded
    assert got["grounded_rate"] == 0.75
    assert got["near_empty_rate"] == 0.0
    assert got["label_state_rate"] == 0.5 and got["empty_state_rate"] == 0.0
    assert got["citing_state_rate"] == 0.5  # u1 cites m1; u2 cites nothing
    assert got["examples"]["ungrounded"].startswith("Bob loves jazz")
    assert rd.misses(got)["template_slot_rate"] == pytest.approx(0.23)
    assert rd.misses(got)["label_state_rate"] == pytest.approx(0.4)
    assert "grounded_rate" not in rd.misses(got) and "near_empty_rate" not in rd.misses(got)  # 0.75 >= 0.70


def test_evidence_is_looked_up_per_user():
    memories, turns, *_ = _tables()
    # u2's turn 0 is Bob's; the same memory cited against u1's turn 0 is not grounded
    moved = memories.with_columns(pl.lit("u1").alias("user_id")).filter(pl.col("memory_id") == "m3")
    assert rd.memory_rates(moved, turns)["grounded_rate"] == 0.0
    missing = memories.with_columns(pl.lit([9]).alias("evidence_turn_ids"))
    assert rd.memory_rates(missing, turns)["evidence_ids_not_found"] == 4


def test_checkpoint_outputs_become_memory_rows():
    ck = pl.DataFrame({
        "key": ["k" * 64, "q" * 64], "user_id": ["u1", "u1"], "episode_id": ["e1", "e1"], "type": ["fact", "insight"],
        "status": ["ok", "quarantined"],
        "output": [json.dumps({"memories": [{"content": "Alice went vegan in April", "evidence_turn_ids": [0]},
                                            {"content": "The user [user_name]", "evidence_turn_ids": [0, 1]}]}), None],
    })
    got = rd.checkpoint_memories(ck)
    assert got["content"].to_list() == ["Alice went vegan in April", "The user [user_name]"]  # the quarantined call adds none
    assert got["evidence_turn_ids"].to_list() == [[0], [0, 1]] and got["memory_id"].n_unique() == 2
    _, turns, *_ = _tables()
    assert rd.memory_rates(got, turns)["template_slot_rate"] == 0.5


def test_the_small_models_gate_drops_and_counts_unreadable_memories_and_keeps_the_rest():
    """SmolLM2's profile gates its memories by these rules; the 1.5B evaluation model's are kept as written."""
    from datetime import datetime, timezone

    from qumem_pipeline.llm.model_profiles import profile_for
    from qumem_pipeline.memories.parsing import DecomposeStats, memories_from_output
    from qumem_pipeline.memories.prompts import Episode, Turn

    ep = Episode("u1", "e1", [Turn(1, "user", "I swim 1.5 km at Salford Quays every Sunday", "Ana")])
    out = {"memories": [{"content": c, "evidence_turn_ids": [1]} for c in (
        "Ana swims 1.5 km at Salford Quays every Sunday",
        "The user [user_name] swims",
        "Family is everything",
        "Ana swims, Ana swims, Ana swims at the quays",
    )]}
    kw = dict(model="m", prompt_version="p", code_version="c", created_at=datetime.now(timezone.utc))
    assert profile_for("SmolLM2-135M-Instruct-Q4_1").memory_gate and not profile_for("Qwen2.5-Coder-1.5B-Instruct").memory_gate
    stats = DecomposeStats()
    kept = memories_from_output(ep, "fact", out, stats, gate=True, **kw)
    assert [m["content"] for m in kept] == ["Ana swims 1.5 km at Salford Quays every Sunday"]
    assert (stats.memories_dropped_slot, stats.memories_dropped_near_empty, stats.memories_dropped_repeat) == (1, 1, 1)
    assert len(memories_from_output(ep, "fact", out, DecomposeStats(), gate=False, **kw)) == 4
