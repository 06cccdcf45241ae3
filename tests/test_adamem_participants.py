"""Participant resolution: explicit names and person words decide the target bundle."""

import polars as pl
import pytest

from qumem_pipeline.query.strategies.adamem.participants import (
    AMBIGUOUS, BOTH, OTHER, USER, Participants, owners_for, resolve, turn_owner,
)

LOCOMO = Participants.from_turns(
    pl.DataFrame({"role": ["user", "other", "user"], "speaker": ["Caroline", "Melanie Smith", "Caroline"]}),
    user_id="conv-26-caroline",
)
ASSISTANT = Participants.from_turns(pl.DataFrame({"role": ["user", "assistant"], "speaker": ["alice", None]}), "alice")


def test_names_come_from_roles_and_user_id():
    assert LOCOMO.user_names == {"caroline"}
    assert LOCOMO.other_names == {"melanie smith", "melanie"}
    assert ASSISTANT.user_names == {"alice"} and ASSISTANT.other_names == frozenset()


@pytest.mark.parametrize(
    "question,parts,target",
    [
        ("What did Caroline research?", LOCOMO, USER),
        ("When did Melanie paint a sunrise?", LOCOMO, OTHER),
        ("What did Melanie Smith's kids make?", LOCOMO, OTHER),
        ("What do Caroline and Melanie both enjoy?", LOCOMO, BOTH),
        ("When is the pottery class?", LOCOMO, AMBIGUOUS),
        ("caroline's plans?", LOCOMO, USER),  # case and possessive
        ("What did Carolineville announce?", LOCOMO, AMBIGUOUS),  # whole words only
        ("Where should I eat tonight?", ASSISTANT, USER),
        ("What did you recommend last time?", ASSISTANT, OTHER),
        ("What did I tell you about my diet?", ASSISTANT, BOTH),
        ("Is Lisbon nice in May?", ASSISTANT, AMBIGUOUS),
    ],
)
def test_resolution_cases(question, parts, target):
    assert resolve(question, parts) == target


def test_ambiguous_and_both_search_both_bundles():
    assert owners_for(AMBIGUOUS) == owners_for(BOTH) == {USER, OTHER}
    assert owners_for(USER) == {USER} and owners_for(OTHER) == {OTHER}
    assert turn_owner("user") == USER and turn_owner("other") == turn_owner("assistant") == OTHER
    with pytest.raises(ValueError, match="unknown participant target"):
        owners_for("someone")
    with pytest.raises(TypeError):
        resolve(None, LOCOMO)
