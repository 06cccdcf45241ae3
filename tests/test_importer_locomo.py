"""LoCoMo importer: on the shared dataset (skipped with a reason when absent) and on inline fixtures."""

import json
import os
from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from qumem_pipeline.contracts.ids import is_valid_user_id
from qumem_pipeline.ingest.importers import detect_format, import_archive
from qumem_pipeline.ingest.importers.base import RAW_COLUMNS
from qumem_pipeline.ingest.importers.locomo import (
    import_locomo,
    load_locomo_qa,
    load_locomo_qa_with_stats,
    parse_locomo_datetime,
    user_id_for,
)


def _shared_datasets() -> Path:
    env = os.environ.get("QUMEM_SHARED_DATASETS")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parent.parent.parent / "shared" / "datasets"


LOCOMO = _shared_datasets() / "locomo" / "locomo_dev5.json"
needs_locomo = pytest.mark.skipif(
    not LOCOMO.is_file(),
    reason=f"LoCoMo file {LOCOMO} not found; set QUMEM_SHARED_DATASETS to the shared datasets directory",
)


# --------------------------------------------------------------------------- real file


@pytest.fixture(scope="module")
def real():
    samples = json.loads(LOCOMO.read_text(encoding="utf-8"))
    return samples, import_locomo(str(LOCOMO))


@needs_locomo
def test_real_file_two_users_per_conversation(real):
    samples, res = real
    assert res.failures == []
    assert dict(res.raw.schema) == RAW_COLUMNS
    users = res.raw["user_id"].unique().to_list()
    assert len(samples) == 5
    assert len(users) == 2 * len(samples) == 10
    assert all(is_valid_user_id(u) for u in users)
    assert "conv-26-caroline" in users and "conv-26-melanie" in users
    per_conv = res.raw.group_by("conversation_id").agg(pl.col("user_id").n_unique())
    assert per_conv["user_id"].to_list() == [2] * len(samples)
    assert detect_format(str(LOCOMO)) == "locomo"
    assert import_archive(str(LOCOMO)).raw.height == res.raw.height


@needs_locomo
def test_real_file_every_dia_id_one_turn_per_user(real):
    samples, res = real
    for sample in samples:
        conv = sample["conversation"]
        dia = [
            t["dia_id"]
            for k, v in conv.items()
            if k.startswith("session_") and isinstance(v, list)
            for t in v
        ]
        rows = res.raw.filter(pl.col("conversation_id") == sample["sample_id"])
        for speaker in (conv["speaker_a"], conv["speaker_b"]):
            uid = user_id_for(sample["sample_id"], speaker)
            mine = rows.filter(pl.col("user_id") == uid)
            counts = Counter(mine["source_ref"].to_list())
            assert set(counts) == set(dia)
            assert set(counts.values()) == {1}
            # turn_index dense 0..N-1 in session then turn order
            assert mine["turn_index"].to_list() == list(range(len(dia)))
            # roles: own turns user, the other speaker's turns other
            own = mine.filter(pl.col("role") == "user")
            assert set(own["speaker"].to_list()) == {speaker}
            assert set(mine.filter(pl.col("role") == "other")["speaker"].to_list()) == {
                conv["speaker_a"] if speaker == conv["speaker_b"] else conv["speaker_b"]
            }
            assert set(mine["role"].to_list()) == {"user", "other"}


@needs_locomo
def test_real_file_session_timestamps_parsed(real):
    samples, res = real
    raw = res.raw
    assert raw["timestamp"].null_count() == 0
    assert raw["timestamp"].str.contains(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:00Z$").all()
    first = raw.filter((pl.col("user_id") == "conv-26-caroline") & (pl.col("source_ref") == "D1:1")).row(0, named=True)
    assert first["timestamp"] == "2023-05-08T13:56:00Z"  # "1:56 pm on 8 May, 2023"
    assert first["session_id"] == "session_1"
    # all turns of a session share the session time
    per_session = raw.group_by("conversation_id", "session_id").agg(pl.col("timestamp").n_unique())
    assert per_session["timestamp"].max() == 1
    # dangling session_N_date_time keys of conv-26 (no session_N list) add no sessions
    conv26 = samples[0]["conversation"]
    lists = {k for k, v in conv26.items() if k.startswith("session_") and isinstance(v, list)}
    got = set(raw.filter(pl.col("conversation_id") == "conv-26")["session_id"].unique().to_list())
    assert got == lists


@needs_locomo
def test_real_file_photo_captions_appended(real):
    samples, res = real
    turn = next(
        t
        for t in samples[0]["conversation"]["session_2"]
        if t.get("blip_caption")
    )
    row = res.raw.filter(
        (pl.col("user_id") == "conv-26-caroline") & (pl.col("source_ref") == turn["dia_id"])
    ).row(0, named=True)
    assert row["text"] == f"{turn['text']} [shares a photo: {turn['blip_caption']}]"


@needs_locomo
def test_real_file_qa_parsing():
    items, stats = load_locomo_qa_with_stats(str(LOCOMO))
    assert len(items) == stats.items == 999
    assert all(isinstance(i["answer"], str) and i["answer"] for i in items)
    cat5 = [i for i in items if i["category"] == 5]
    assert cat5 and all(i["adversarial"] for i in cat5)
    assert stats.answers_converted >= 1  # integer answers such as 2022
    assert any(i["answer"] == "2022" for i in items)
    # malformed evidence in this subset: "D8:6; D9:17" (split), "D:11:26" (read as D11:26),
    # "D" (no id) and "D10:19" (names no turn of conv-42)
    assert stats.evidence_repaired == 3
    assert stats.evidence_malformed == 1
    assert stats.evidence_unknown == 1
    assert {(s["sample_id"], s["value"]) for s in stats.skipped} == {("conv-42", "D"), ("conv-42", "D10:19")}
    split = next(i for i in items if i["evidence_raw"] == ["D8:6; D9:17"])
    assert split["evidence"] == ["D8:6", "D9:17"]
    # every kept evidence id names a turn of its conversation
    res = import_locomo(str(LOCOMO))
    refs = {
        cid: set(g["source_ref"].to_list())
        for (cid,), g in res.raw.group_by("conversation_id")
    }
    for i in items:
        assert set(i["evidence"]) <= refs[i["sample_id"]]
        assert len(i["user_ids"]) == 2


# --------------------------------------------------------------------------- inline fixtures


def _fixture() -> list[dict]:
    return [
        {
            "sample_id": "conv-x1",
            "qa": [
                {"question": "When did Ana start pottery?", "answer": "June 2023", "evidence": ["D1:1"], "category": 2},
                {"question": "How many pots?", "answer": 3, "evidence": ["D1:3 D2:1"], "category": 4},
                {"question": "Where?", "answer": "Lisbon", "evidence": ["D1:2; D9:9", "D"], "category": 1},
                {"question": "What is Ben's dog called?", "adversarial_answer": "Not mentioned", "evidence": [], "category": 5},
                "not an item",
            ],
            "conversation": {
                "speaker_a": "Ana Sofía",
                "speaker_b": "Ben",
                "session_1_date_time": "1:56 pm on 8 May, 2023",
                "session_1": [
                    {"speaker": "Ana Sofía", "dia_id": "D1:1", "text": "I started pottery!"},
                    {"speaker": "Ben", "dia_id": "D1:2", "text": "Nice, where?",
                     "img_url": ["http://example.invalid/x.jpg"], "blip_caption": "a photo of a kiln"},
                    {"speaker": "Ana Sofía", "dia_id": "D1:3", "text": "A studio downtown."},
                ],
                "session_2_date_time": "10:04 am on 19 June, 2023",
                "session_2": [
                    {"speaker": "Ben", "dia_id": "D2:1", "text": "How are the pots?"},
                    "garbage turn",
                    {"speaker": "Ana Sofía", "dia_id": "D2:2", "text": "Three done."},
                ],
                # dangling: a date-time with no session_3 list
                "session_3_date_time": "9:00 am on 1 July, 2023",
                "session_4_date_time": "sometime in July",
                "session_4": [{"speaker": "Ben", "dia_id": "D4:1", "text": "Hi again"}],
            },
        },
        {"sample_id": "conv-x2", "conversation": "not an object"},
    ]


@pytest.fixture()
def fixture_path(tmp_path):
    p = tmp_path / "tiny_locomo.json"
    p.write_text(json.dumps(_fixture()), encoding="utf-8")
    return p


def test_fixture_users_roles_and_sessions(fixture_path):
    res = import_locomo(str(fixture_path))
    raw = res.raw
    assert sorted(raw["user_id"].unique().to_list()) == ["conv-x1-ana-sofia", "conv-x1-ben"]
    ana = raw.filter(pl.col("user_id") == "conv-x1-ana-sofia")
    assert ana["source_ref"].to_list() == ["D1:1", "D1:2", "D1:3", "D2:1", "D2:2", "D4:1"]
    assert ana["role"].to_list() == ["user", "other", "user", "other", "user", "other"]
    assert ana["turn_index"].to_list() == list(range(6))
    ben = raw.filter(pl.col("user_id") == "conv-x1-ben")
    assert ben["role"].to_list() == ["other", "user", "other", "user", "other", "user"]
    # the dangling session_3_date_time adds no session
    assert ana["session_id"].unique(maintain_order=True).to_list() == ["session_1", "session_2", "session_4"]
    assert ana["timestamp"].to_list()[:5] == ["2023-05-08T13:56:00Z"] * 3 + ["2023-06-19T10:04:00Z"] * 2
    # an unparseable session date-time is passed through for validation to quarantine
    assert ana["timestamp"].to_list()[5] == "sometime in July"
    assert ana["text"][1] == "Nice, where? [shares a photo: a photo of a kiln]"
    assert set(raw["conversation_id"].to_list()) == {"conv-x1"}
    assert set(raw["source_row"].to_list()) == {1}


def test_fixture_failures_are_recorded_not_dropped(fixture_path):
    res = import_locomo(str(fixture_path))
    # the garbage turn: once per user; the sample with a non-object conversation: once
    turn_failures = [f for f in res.failures if f.field == "(turn)"]
    assert sorted(f.user_id for f in turn_failures) == ["conv-x1-ana-sofia", "conv-x1-ben"]
    assert all(f.source_row == 1 and "garbage turn" in f.raw for f in turn_failures)
    conv_failures = [f for f in res.failures if f.source_row == 2]
    assert len(conv_failures) == 1 and "conv-x2" in conv_failures[0].reason
    assert len(res.failures) == 3


def test_fixture_qa(fixture_path):
    items, stats = load_locomo_qa_with_stats(str(fixture_path))
    assert load_locomo_qa(str(fixture_path)) == items
    assert [i["evidence"] for i in items] == [["D1:1"], ["D1:3", "D2:1"], ["D1:2"], []]
    assert items[1]["answer"] == "3"
    assert items[3]["answer"] == "Not mentioned" and items[3]["adversarial"]
    assert items[0]["user_ids"] == ["conv-x1-ana-sofia", "conv-x1-ben"]
    assert stats.items_skipped == 1
    assert stats.evidence_repaired == 3  # D1:3, D2:1 from one string; D1:2 from another
    assert stats.evidence_unknown == 1  # D9:9
    assert stats.evidence_malformed == 1  # "D"
    assert stats.items_without_evidence == 1
    assert stats.answers_converted == 1


def test_broken_files_become_failures(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"sample_id": "x", ', encoding="utf-8")
    res = import_locomo(str(bad))
    assert res.raw.height == 0 and len(res.failures) == 1 and res.failures[0].reason.startswith("invalid JSON")
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"hello": 1}', encoding="utf-8")
    res = import_locomo(str(wrong))
    assert res.raw.height == 0 and len(res.failures) == 1


@pytest.mark.parametrize(
    "text, iso",
    [
        ("1:56 pm on 8 May, 2023", "2023-05-08T13:56:00Z"),
        ("12:09 am on 13 September, 2023", "2023-09-13T00:09:00Z"),
        ("12:30 pm on 1 Jan, 2024", "2024-01-01T12:30:00Z"),
        ("  7:31 PM on 21 January, 2022 ", "2022-01-21T19:31:00Z"),
        ("yesterday", None),
    ],
)
def test_parse_locomo_datetime(text, iso):
    assert parse_locomo_datetime(text) == iso


def test_user_id_for_is_always_pattern_safe():
    assert user_id_for("conv-26", "Caroline") == "conv-26-caroline"
    assert is_valid_user_id(user_id_for("../conv 1", "José María"))
    assert is_valid_user_id(user_id_for("conv-1", "!!!"))
