"""Readers for the TIAGE annotation format and the segments format, on inline fixtures."""

import json

import pytest

from qumem_pipeline.episodes.dialogues import (
    boundaries_to_masses,
    detect_format,
    masses_to_boundaries,
    parse_dialogues,
    read_dialogues,
)

TIAGE_FIX = {
    "a": [["hi there", "-1"], ["hello", "0"], ["i like cats", "1"], ["me too", "0"], ["what about jobs", "1"]],
    "b": [["only one", "-1"]],
    "c": [],
}
SEG_FIX = [
    {"dial_id": "x", "utterances": ["u1", "u2", "u3", "u4", "u5"], "segments": [2, 3]},
    {"dial_id": "y", "utterances": ["solo"], "segments": [1]},
    {"dial_id": "z", "utterances": ["", "", "q"], "segments": [1, 1, 1]},
    {"utterances": ["a", "b"], "segments": [5]},  # inconsistent; no dial_id
]


def test_detect():
    assert detect_format(TIAGE_FIX) == "tiage"
    assert detect_format(SEG_FIX) == "segments"
    assert detect_format({"dialogues": SEG_FIX}) == "segments"
    with pytest.raises(ValueError):
        detect_format({"a": 3})


def test_tiage_reader():
    rr = parse_dialogues(TIAGE_FIX)
    assert rr.fmt == "tiage"
    a, b, c = rr.dialogues
    assert a.utterances[2] == "i like cats"
    assert a.boundaries == [0, 1, 0, 1]
    assert a.segment_lengths() == [2, 2, 1]
    assert b.boundaries == [] and b.n_segments == 1
    assert c.utterances == [] and c.n_segments == 0


def test_segments_reader(tmp_path):
    p = tmp_path / "seg.json"
    p.write_text(json.dumps(SEG_FIX))
    rr = read_dialogues(p)
    assert rr.fmt == "segments"
    x, y, z, w = rr.dialogues
    assert x.boundaries == [0, 1, 0, 0]
    assert y.boundaries == []
    assert z.boundaries == [1, 1] and z.utterances[0] == ""
    assert w.dial_id == "3" and w.boundaries == [0]
    assert len(rr.warnings) == 1


def test_explicit_format_and_roundtrip():
    rr = parse_dialogues(SEG_FIX[:1], fmt="segments")
    assert rr.dialogues[0].segment_lengths() == [2, 3]
    b, ok = masses_to_boundaries([3, 1, 2], 6)
    assert ok and b == [0, 0, 1, 1, 0]
    assert boundaries_to_masses(b) == [3, 1, 2]
    with pytest.raises(ValueError):
        parse_dialogues(SEG_FIX, fmt="nope")
