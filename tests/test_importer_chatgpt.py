"""ChatGPT conversations.json importer, on a realistic export fixture written by the test."""

import json

import pytest

from qumem_pipeline.ingest.importers import detect_format, import_archive
from qumem_pipeline.ingest.importers.base import RAW_COLUMNS
from qumem_pipeline.ingest.importers.chatgpt import import_chatgpt, import_chatgpt_with_stats


def _msg(mid, role, parts=None, *, t=None, ctype="text", name=None, hidden=False, recipient="all", **content):
    c = {"content_type": ctype}
    if parts is not None:
        c["parts"] = parts
    c.update(content)
    meta = {"is_visually_hidden_from_conversation": True} if hidden else {}
    return {
        "id": mid,
        "author": {"role": role, "name": name, "metadata": {}},
        "create_time": t,
        "update_time": None,
        "content": c,
        "status": "finished_successfully",
        "end_turn": True if role == "assistant" else None,
        "weight": 1.0,
        "metadata": meta,
        "recipient": recipient,
    }


def _tree(nodes: list[tuple[str, dict | None, str | None]]) -> dict:
    """nodes: (node_id, message, parent) -> mapping with children filled in."""
    mapping = {nid: {"id": nid, "message": msg, "parent": parent, "children": []} for nid, msg, parent in nodes}
    for nid, _, parent in nodes:
        if parent is not None and parent in mapping:
            mapping[parent]["children"].append(nid)
    return mapping


def _kyoto() -> dict:
    T = 1_700_000_000
    mapping = _tree(
        [
            ("root", None, None),
            ("sys", _msg("sys", "system", [""], hidden=True), "root"),
            ("ctx", _msg("ctx", "user", None, ctype="user_editable_context", hidden=True,
                         user_profile="I live in Osaka.", user_instructions="Be brief."), "sys"),
            ("u1", _msg("u1", "user", ["Plan 3 days in Kyoto for me."], t=T + 10.5), "ctx"),
            # regeneration: a1_old is the discarded answer, with a follow-up on its side branch
            ("a1_old", _msg("a1_old", "assistant", ["OLD ANSWER (regenerated away)"], t=T + 20), "u1"),
            ("u_side", _msg("u_side", "user", ["SIDE BRANCH question"], t=T + 30), "a1_old"),
            ("a1", _msg("a1", "assistant", ["Day 1: Fushimi Inari early.", "Day 2: Arashiyama."], t=T + 40), "u1"),
            # edit: u2_old was edited into u2
            ("u2_old", _msg("u2_old", "user", ["ORIGINAL WORDING (edited away)"], t=T + 50), "a1"),
            ("a2_old", _msg("a2_old", "assistant", ["answer to the edited-away message"], t=T + 55), "u2_old"),
            ("u2", _msg("u2", "user", [
                {"content_type": "image_asset_pointer", "asset_pointer": "file-service://file-abc123",
                 "size_bytes": 123456, "width": 1024, "height": 768},
                "What temple is this?",
            ], t=T + 60, ctype="multimodal_text"), "a1"),
            ("a2pre", _msg("a2pre", "assistant", [""], t=T + 61), "u2"),
            ("a2call", _msg("a2call", "assistant", None, t=T + 62, ctype="code", language="unknown",
                            text='search("golden temple kyoto")', recipient="browser"), "a2pre"),
            ("tdisp", _msg("tdisp", "tool", None, t=T + 63, ctype="tether_browsing_display", name="browser",
                           result="...", summary=None), "a2call"),
            ("t1", _msg("t1", "tool", ["Kinkaku-ji (the Golden Pavilion), Kita-ku, Kyoto."], t=T + 64, name="browser"), "tdisp"),
            ("a2", _msg("a2", "assistant", ["That is Kinkaku-ji, the Golden Pavilion."], t=T + 70), "t1"),
        ]
    )
    return {
        "title": "Kyoto trip",
        "create_time": T,
        "update_time": T + 70,
        "mapping": mapping,
        "moderation_results": [],
        "current_node": "a2",
        "plugin_ids": None,
        "conversation_id": "conv-kyoto",
        "id": "conv-kyoto",
        "default_model_slug": "gpt-4o",
    }


def _sourdough() -> dict:
    # older conversation, only "id" (no conversation_id); a message with no create_time
    T = 1_690_000_000
    mapping = _tree(
        [
            ("r", None, None),
            ("s1", _msg("s1", "user", ["My sourdough starter smells like nail polish."], t=T + 5), "r"),
            ("s2", _msg("s2", "assistant", ["It is hungry: feed it twice a day for a few days."], t=None), "s1"),
            ("s3", _msg("s3", "critic", ["an unknown role"], t=T + 9), "s2"),
        ]
    )
    return {"title": "Sourdough", "create_time": T, "update_time": T + 9, "mapping": mapping,
            "current_node": "s3", "id": "conv-sourdough"}


def _broken_chain() -> dict:
    mapping = _tree([("x1", _msg("x1", "user", ["hello"], t=1_695_000_000), "missing-parent")])
    return {"title": "Broken chain", "create_time": 1_695_000_000, "mapping": mapping,
            "current_node": "x1", "conversation_id": "conv-broken"}


def _cycle() -> dict:
    mapping = {
        "n1": {"id": "n1", "message": _msg("n1", "user", ["a"], t=1), "parent": "n2", "children": ["n2"]},
        "n2": {"id": "n2", "message": _msg("n2", "assistant", ["b"], t=2), "parent": "n1", "children": ["n1"]},
    }
    return {"title": "Cycle", "create_time": 1_696_000_000, "mapping": mapping, "current_node": "n1",
            "conversation_id": "conv-cycle"}


def _no_mapping() -> dict:
    return {"title": "No mapping", "create_time": 1_697_000_000, "current_node": "z", "conversation_id": "conv-nomap"}


@pytest.fixture()
def export(tmp_path):
    d = tmp_path / "dana"
    d.mkdir()
    p = d / "conversations.json"
    # the export lists newest first
    p.write_text(json.dumps([_kyoto(), _broken_chain(), _sourdough(), _cycle(), _no_mapping()]), encoding="utf-8")
    return p


def test_current_node_branch_only_in_order(export):
    res = import_chatgpt(str(export), user_id="alice")
    raw = res.raw
    assert dict(raw.schema) == RAW_COLUMNS
    kyoto = raw.filter(raw["conversation_id"] == "conv-kyoto")
    assert kyoto["source_ref"].to_list() == ["u1", "a1", "u2", "t1", "a2"]
    assert kyoto["role"].to_list() == ["user", "assistant", "user", "other", "assistant"]
    texts = kyoto["text"].to_list()
    assert texts[1] == "Day 1: Fushimi Inari early.\nDay 2: Arashiyama."
    assert texts[2] == "[image]\nWhat temple is this?"
    joined = "\n".join(raw["text"].to_list())
    for gone in ("OLD ANSWER", "SIDE BRANCH", "ORIGINAL WORDING", "edited-away", "Osaka", "golden temple"):
        assert gone not in joined
    assert kyoto["speaker"].to_list() == ["user", "assistant", "user", "browser", "assistant"]
    assert set(kyoto["session_id"].to_list()) == {"conv-kyoto"}
    assert kyoto["timestamp"].to_list()[0] == "1700000010.5"
    assert kyoto["timestamp"].to_list()[-1] == "1700000070"


def test_history_order_user_id_and_passthrough(export):
    res = import_chatgpt(str(export), user_id="alice")
    raw = res.raw
    assert set(raw["user_id"].to_list()) == {"alice"}
    # conversations in create_time order: sourdough (older) first, though listed later
    assert raw["conversation_id"].to_list() == ["conv-sourdough"] * 3 + ["conv-kyoto"] * 5
    assert raw["turn_index"].to_list() == list(range(8))
    sour = raw.filter(raw["conversation_id"] == "conv-sourdough")
    assert sour["timestamp"].to_list() == ["1690000005", None, "1690000009"]
    # unknown roles pass through unchanged: validation quarantines them
    assert sour["role"].to_list() == ["user", "assistant", "critic"]
    assert set(raw["source_row"].to_list()) == {1, 3}
    # without an explicit user id: the export's parent directory name
    assert set(import_chatgpt(str(export)).raw["user_id"].to_list()) == {"dana"}


def test_malformed_conversations_fail_alone(export):
    res, stats = import_chatgpt_with_stats(str(export), user_id="alice")
    assert len(res.failures) == 3
    by_row = {f.source_row: f for f in res.failures}
    assert set(by_row) == {2, 4, 5}
    assert "conv-broken" in by_row[2].reason and "broken parent chain" in by_row[2].reason
    assert "conv-cycle" in by_row[4].reason and "cycle" in by_row[4].reason
    assert "conv-nomap" in by_row[5].reason and "mapping" in by_row[5].reason
    assert all(f.user_id == "alice" and f.source_file == str(export) and f.raw for f in res.failures)
    assert stats.conversations == 5
    assert stats.imported_conversations == 2
    assert stats.failed_conversations == 3
    assert stats.messages_imported == 8
    assert stats.off_branch_nodes == 4  # a1_old, u_side, u2_old, a2_old
    assert stats.skipped == {
        "no_message": 2,
        "system": 1,
        "hidden": 1,
        "empty": 1,
        "content_type:code": 1,
        "content_type:tether_browsing_display": 1,
    }


def test_detect_and_dispatch(export):
    assert detect_format(str(export)) == "chatgpt"
    assert import_archive(str(export), user_id="bob").raw["user_id"].unique().to_list() == ["bob"]


def test_unreadable_files(tmp_path):
    p = tmp_path / "u1" / "conversations.json"
    p.parent.mkdir()
    p.write_bytes(b'[{"title": "caf\xe9"}]')
    res = import_chatgpt(str(p))
    assert res.raw.height == 0 and len(res.failures) == 1 and "UTF-8" in res.failures[0].reason
    p.write_text('[{"title": "x", "mapping": ', encoding="utf-8")
    res = import_chatgpt(str(p))
    assert res.raw.height == 0 and res.failures[0].reason.startswith("invalid JSON")
    p.write_text('{"not": "an export"}', encoding="utf-8")
    assert len(import_chatgpt(str(p)).failures) == 1
