"""The decomposer through the `openai` backend against a real scripted HTTP server process."""

import json
from datetime import datetime, timedelta, timezone

import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.memories.decompose import (
    LEDGER_SCHEMA,
    MEMORY_SCHEMA,
    MEMORY_TYPES,
    PROMPT_VERSION,
    SYSTEM_PROMPT,
    TYPE_INSTRUCTIONS,
    build_messages,
    build_requests,
    coerce_episode,
    decompose_episodes,
    memory_id,
    memory_schema,
    summarize_ledger,
)
from qumem_pipeline.llm import LLMEndpointError, make_backend
from qumem_pipeline.runtime.processes import free_port

T0 = datetime(2024, 3, 1, 9, 0, tzinfo=timezone.utc)
CREATED = datetime(2024, 6, 1, tzinfo=timezone.utc)


def episode(user, eid, start, texts):
    return {
        "user_id": user,
        "episode_id": eid,
        "turns": [
            {
                "turn_index": start + i,
                "role": "user" if i % 2 == 0 else "assistant",
                "speaker": None,
                "text": t,
                "timestamp": T0 + timedelta(minutes=start + i),
            }
            for i, t in enumerate(texts)
        ],
    }


EP1 = episode("alice", "alice-e0", 10, ["I joined a swimming club.", "Nice!", "I like calm, supportive coaches."])
EP2 = episode("bob", "bob-e0", 0, ["I moved to Lisbon in May.", "How is it?"])


def key(ep, mem_type):
    """A substring that only the given episode's given-type prompt contains."""
    last = ep["turns"][-1]["text"]
    return f"{last}\n\n{TYPE_INSTRUCTIONS[mem_type]}"


def mems(*items):
    return {"json": {"memories": [{"content": c, "evidence_turn_ids": ids} for c, ids in items]}}


SCRIPT = {
    "model": "fake-qwen",
    "rules": [
        # alice/fact: good, with an out-of-episode id (99), a duplicate (collapses), and a memory
        # whose only evidence is outside the episode (dropped).
        {
            "match": key(EP1, "fact"),
            "responses": [
                mems(
                    ("The user joined a swimming club.", [10, 99]),
                    ("the user joined a swimming club", [11]),
                    ("The user lives on Mars.", [3]),
                )
            ],
        },
        # alice/preference: malformed JSON first, then good (the retry recovers it).
        {
            "match": key(EP1, "preference"),
            "responses": [{"content": '{"memories": [{"content": "calm'}, mems(("The user prefers calm coaches.", [12]))],
        },
        # alice/insight: schema-violating twice -> quarantined.
        {"match": key(EP1, "insight"), "responses": [{"json": {"memories": [{"content": "x"}]}}]},
        # bob/fact: a 500 first (transport retry), then good.
        {"match": key(EP2, "fact"), "responses": [{"status": 500}, mems(("The user moved to Lisbon in May.", [0]))]},
    ],
    "default": [{"json": {"memories": []}}],
}


@pytest.fixture
def server(tmp_path):
    with RunningFakeServer(SCRIPT, tmp_path / "srv") as srv:
        yield srv


def run(server, episodes=(EP1, EP2)):
    with make_backend("openai", base_url=server.base_url, backoff_base_s=0.05, max_retries=3) as be:
        return decompose_episodes(list(episodes), be, created_at=CREATED)


def test_prompts_are_prefix_shared():
    ep = coerce_episode(EP1)
    msgs = {t: build_messages(ep, t) for t in MEMORY_TYPES}
    assert all(m[0]["content"] == SYSTEM_PROMPT for m in msgs.values())
    users = [m[1]["content"] for m in msgs.values()]
    prefix = users[0][: users[0].index(TYPE_INSTRUCTIONS["fact"])]
    assert all(u.startswith(prefix) for u in users)
    assert "[10] user: I joined a swimming club." in prefix and "[12] user:" in prefix
    for t, u in zip(MEMORY_TYPES, users):
        assert u[len(prefix):].startswith(TYPE_INSTRUCTIONS[t])  # type-specific text comes last
    reqs = build_requests([EP1, EP2])
    assert [r.metadata["type"] for r in reqs] == list(MEMORY_TYPES) * 2
    assert all(r.json_schema == memory_schema() for r in reqs)


def test_decompose_end_to_end(server):
    out = run(server)
    m, q, led = out.memories, out.quarantine, out.ledger
    assert m.schema == MEMORY_SCHEMA and led.schema == LEDGER_SCHEMA

    # one batch for all users' episodes: 6 first calls, then 2 retries (alice preference + insight)
    assert out.stats.calls == 8 and out.stats.retries == 2 and out.stats.quarantined == 1
    assert led.height == 8 and (led["attempt"] == 2).sum() == 2
    assert sorted(led.filter(pl.col("status") == "quarantined")["type"].to_list()) == ["insight"]
    assert len(server.requests()) == 9  # + one transport retry after the scripted 500

    facts = m.filter(pl.col("type") == "fact").sort("user_id")
    assert facts["content"].to_list() == ["The user joined a swimming club.", "The user moved to Lisbon in May."]
    alice = facts.row(0, named=True)
    assert alice["evidence_turn_ids"] == [10, 11]  # duplicate collapsed, evidence merged, 99 dropped
    assert alice["position"] == 11 and alice["valid_from"] == T0 + timedelta(minutes=11)
    assert alice["model"] == "fake-qwen" and alice["prompt_version"] == PROMPT_VERSION
    assert alice["created_at"] == CREATED
    assert out.stats.duplicates_collapsed == 1
    assert out.stats.evidence_ids_dropped == 2  # 99 and 3
    assert out.stats.memories_dropped_no_evidence == 1
    assert "lives on Mars" not in " ".join(m["content"].to_list())

    pref = m.filter(pl.col("type") == "preference").row(0, named=True)  # recovered by the retry
    assert pref["content"] == "The user prefers calm coaches." and pref["position"] == 12

    assert q.height == 1
    qrow = q.row(0, named=True)
    assert qrow["episode_id"] == "alice-e0" and qrow["type"] == "insight"
    assert qrow["reason"].startswith("schema_violation") and '"content": "x"' in qrow["raw"]

    # every type-prompt carried the schema both ways
    bodies = [r["body"] for r in server.requests()]
    # decoding is constrained per episode (evidence ids limited to the episode's own turns)
    assert all(b["structured_outputs"]["json"] in (memory_schema([10, 11, 12]), memory_schema([0, 1])) for b in bodies)
    assert all(b["response_format"]["json_schema"]["strict"] is True for b in bodies)

    s = out.summary
    assert s["turns"] == 5 and s["llm_calls"] == 8
    assert s["calls_per_100_turns"] == pytest.approx(160.0)
    assert s["tokens_per_turn"] == pytest.approx((s["prompt_tokens"] + s["completion_tokens"]) / 5)
    assert 0 < s["computed_prefill_tokens"] < s["prompt_tokens"]
    assert s["n_quarantined"] == 1 and s["n_evidence_ids_dropped"] == 2


def test_memory_ids_stable_across_reruns(tmp_path):
    with RunningFakeServer(SCRIPT, tmp_path / "a") as s1:
        a = run(s1).memories
    with RunningFakeServer(SCRIPT, tmp_path / "b") as s2:
        b = run(s2).memories
    assert a.height == 3
    assert a["memory_id"].to_list() == b["memory_id"].to_list()
    assert a.equals(b)
    assert memory_id("alice", "alice-e0", "fact", "The user joined a swimming club.") == memory_id(
        "alice", "alice-e0", "fact", "  the USER joined a swimming club  "
    )
    assert memory_id("alice", "alice-e0", "fact", "x") != memory_id("alice", "alice-e0", "preference", "x")


def test_unreachable_endpoint_fails_run_clearly():
    port = free_port()
    be = make_backend("openai", base_url=f"http://127.0.0.1:{port}", model="m", max_retries=1, backoff_base_s=0.01)
    with pytest.raises(LLMEndpointError, match=f"127.0.0.1:{port}/v1/chat/completions"):
        decompose_episodes([EP1], be, created_at=CREATED)


def test_summary_prefix_accounting():
    rows = []
    for t in MEMORY_TYPES:
        rows.append(
            {"request_id": t, "user_id": "u", "episode_id": "e", "type": t, "attempt": 1, "status": "ok",
             "episode_turns": 10, "prompt_tokens": 1000, "completion_tokens": 50, "cached_tokens": None,
             "shared_prefix_tokens": 900, "latency_s": 0.1, "transport_attempts": 1, "backend": "b",
             "model": "m", "prompt_version": "p", "created_at": CREATED}
        )
    s = summarize_ledger(pl.DataFrame(rows, schema=LEDGER_SCHEMA), n_turns=10)
    assert s["calls_per_100_turns"] == 30.0
    assert s["computed_prefill_tokens"] == 1000 + 100 + 100
    assert s["prefill_saved_tokens"] == 1800
    assert s["tokens_per_turn"] == pytest.approx(315.0)


def test_empty_input():
    class Never:
        model_name, backend_name = "m", "none"

        def generate(self, reqs):
            assert reqs == []
            return []

    out = decompose_episodes([], Never(), created_at=CREATED)
    assert out.memories.height == 0 and out.memories.schema == MEMORY_SCHEMA
    assert out.summary["llm_calls"] == 0
    json.dumps(out.summary)
