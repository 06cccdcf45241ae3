"""A user state's text never points at a memory by alias (qumem_pipeline/query/strategies/state_labels.py)."""

from qumem_pipeline.query.strategies.base import RetrievedMemory, resolve_citations
from qumem_pipeline.query.strategies.state_labels import expand_aliases, raw_state_labels
from qumem_pipeline.memories.readability import state_made_of_labels

import json

import pytest

CANDS = [RetrievedMemory(f"mem-{i}", "preference", f"Kai likes genre {i} music.", i, 1.0) for i in range(1, 12)]
# the 1.5B model's state for PersonaMem question e8e32fa7, in shape: a preference trajectory of aliases
STATE = {
    "facts": [{"statement": "Kai prefers M3 over M4 now", "memory_ids": ["M3"]}],
    "preference_trajectory": [{"aspect": "music", "earlier": "M10", "current": "M11, M99",
                               "applies_now_because": "M11 is the latest", "memory_ids": ["M10"]}],
    "insights": [],
}


def test_aliases_in_text_become_the_memories_they_name_and_are_cited():
    state, cited, dropped = resolve_citations(STATE, CANDS)
    fact, pref = state["facts"][0], state["preference_trajectory"][0]
    assert fact["statement"] == 'Kai prefers "Kai likes genre 3 music." over "Kai likes genre 4 music." now'
    assert fact["memory_ids"] == ["mem-3", "mem-4"]  # the text now rests on M4 too
    assert pref["earlier"] == "Kai likes genre 10 music." and pref["current"] == "Kai likes genre 11 music."
    assert pref["applies_now_because"] == '"Kai likes genre 11 music." is the latest'
    assert pref["memory_ids"] == ["mem-10", "mem-11"]
    assert cited == ["mem-3", "mem-4", "mem-10", "mem-11"]
    assert dropped == 1  # M99 was never retrieved: removed from the text, counted
    assert "M1" not in json.dumps(state) and not state_made_of_labels(json.dumps(state))


def test_raw_mode_keeps_the_text_as_written_for_replays_of_older_tables():
    with raw_state_labels():
        state, cited, dropped = resolve_citations(STATE, CANDS)
    assert state["preference_trajectory"][0]["earlier"] == "M10" and cited == ["mem-3", "mem-10"] and dropped == 0
    # and the rule is back on outside the block
    assert resolve_citations(STATE, CANDS)[0]["preference_trajectory"][0]["earlier"] != "M10"


def test_text_without_aliases_and_words_like_m_sizes_stay():
    mem = {"M1": ("mem-1", "x")}
    assert expand_aliases("Prefers size M and the M25 motorway", mem) == ("Prefers size M and the M25 motorway", [], 0)
    assert expand_aliases("M1 beside the M25", mem) == ('"x" beside the M25', ["mem-1"], 0)
    assert expand_aliases("no alias here", mem) == ("no alias here", [], 0)
    assert expand_aliases("M1 -> M1", mem) == ("x", ["mem-1"], 0)
    # the embedded model's "[m1]" (README's state before this rule: "The user is a chemist at a [m1]")
    assert expand_aliases("The user is a chemist at a [m1]", mem) == ('The user is a chemist at a ["x"]', ["mem-1"], 0)


def test_a_wrapped_or_lowercase_citation_names_the_memory_it_wraps():
    """The embedded model cites "[m1]": it names M1, while "1" or "memory 1" name nothing."""
    state = {"facts": [{"statement": "Bob swims now.", "memory_ids": ["[m1]", "(M2)", " m3 ", "1", "mem"]}],
             "preference_trajectory": [], "insights": []}
    out, cited, dropped = resolve_citations(state, CANDS)
    assert cited == ["mem-1", "mem-2", "mem-3"] and dropped == 2
    assert out["facts"][0]["memory_ids"] == ["mem-1", "mem-2", "mem-3"]


def test_the_embedded_profile_decodes_citations_as_the_shown_aliases_only():
    """A plain-text profile's state calls cite one of M1..Mn; other backends decode against the schema."""
    import jsonschema

    from qumem_pipeline.query.strategies.base import USER_STATE_SCHEMA, alias_constraint

    class Embedded:
        output_bounds = "items/3,chars/2,plain"

    class Served:
        output_bounds = None

    assert alias_constraint(Served(), USER_STATE_SCHEMA, 3) is None
    tight = alias_constraint(Embedded(), USER_STATE_SCHEMA, 2)
    state = {"facts": [{"statement": "Bob swims.", "memory_ids": ["M1", "M2"]}], "preference_trajectory": [],
             "insights": []}
    jsonschema.validate(state, tight)
    for bad in (["M1_2"], ["M3"], ["[m1]"]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**state, "facts": [{"statement": "Bob swims.", "memory_ids": bad}]}, tight)
    none_shown = alias_constraint(Embedded(), USER_STATE_SCHEMA, 0)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(state, none_shown)
    jsonschema.validate(state, USER_STATE_SCHEMA)  # what it allows, the schema the output is read by allows
