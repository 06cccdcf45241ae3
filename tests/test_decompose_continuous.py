"""Continuous submission and per-call checkpoints of the decomposition, against the fake server
process (tests/fake_openai_server.py). Every assertion is on events and counts the server logged
(which generation started and ended when, how many requests it saw), never on wall-clock time.
"""

import hashlib
import time
from datetime import datetime, timedelta, timezone

import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.llm import LLMEndpointError, make_backend
from qumem_pipeline.memories.checkpoints import CallOutcome, CheckpointStore, call_key
from qumem_pipeline.memories.decompose import TYPE_INSTRUCTIONS, decompose_episodes

T0 = datetime(2024, 5, 1, 9, 0, tzinfo=timezone.utc)
N_EPISODES = 4
CALLS = 3 * N_EPISODES


def ep_text(i: int) -> str:
    return f"EP-{i}: I started learning the cello in week {i}"


def episodes() -> list[dict]:
    out = []
    for i in range(N_EPISODES):
        turns = [{"turn_index": 2 * i + j, "role": role, "speaker": None, "text": text,
                  "timestamp": T0 + timedelta(minutes=2 * i + j)}
                 for j, (role, text) in enumerate((("user", ep_text(i)), ("assistant", "Lovely.")))]
        out.append({"user_id": "ana", "episode_id": f"ana-e{i}", "turns": turns})
    return out


def backend(url: str, **kw):
    cfg = dict(base_url=url, model="fake-model", max_retries=1, backoff_base_s=0.05, backoff_max_s=0.1,
               stall_timeout_s=30.0, max_concurrency=2)
    cfg.update(kw)
    return make_backend("openai", **cfg)


def stable(df: pl.DataFrame) -> pl.DataFrame:
    return df.drop([c for c in ("created_at", "latency_s") if c in df.columns])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """One call at a time, no delays: the tables every other run must equal."""
    tmp = tmp_path_factory.mktemp("baseline")
    with RunningFakeServer({"default": [{"echo_memory": True}]}, tmp) as srv, backend(srv.base_url, max_concurrency=1) as be:
        out = decompose_episodes(episodes(), be, created_at=T0)
    assert out.memories.height == CALLS and out.quarantine.height == 0
    return out


def test_a_slow_call_does_not_hold_back_the_others(tmp_path, baseline):
    # episode 0's fact call streams slowly; with 2 slots, the other slot keeps taking new calls
    # while it runs (a batch would have waited for it before sending the next batch).
    slow = f"{ep_text(0)}\n[1] assistant: Lovely.\n\n{TYPE_INSTRUCTIONS['fact']}"
    script = {"rules": [{"match": slow, "responses": [{"token_delay": 0.1, "echo_memory": True}]}],
              "default": [{"echo_memory": True}]}
    with RunningFakeServer(script, tmp_path / "srv") as srv, backend(srv.base_url) as be:
        out = decompose_episodes(episodes(), be, created_at=T0, checkpoint=CheckpointStore(tmp_path / "data"))
        gens, reqs = srv.generations(), srv.requests()
    assert len(reqs) == CALLS
    (slow_req,) = [r for r in reqs if "token_delay" in r["response"]]
    slow_key = hashlib.sha256("\n".join(m["content"] for m in slow_req["body"]["messages"]).encode()).hexdigest()[:16]
    slow_end = next(i for i, g in enumerate(gens) if g["key"] == slow_key and g["event"] == "end")
    others_ended = [i for i, g in enumerate(gens) if g["event"] == "end" and g["key"] != slow_key]
    assert len(others_ended) == CALLS - 1 and max(others_ended) < slow_end  # all 11 done while it streamed
    # results come out in (episode, type) order, not completion order: same tables as one at a time
    assert stable(out.memories).equals(stable(baseline.memories))
    assert stable(out.ledger).equals(stable(baseline.ledger))


def test_endpoint_failure_mid_stage_loses_no_answered_call_and_rerun_repeats_none(tmp_path, baseline):
    # episode 0's calls keep failing (HTTP 500 past the retries) while the others stream slowly:
    # when the endpoint is given up, nothing new is sent, the calls in flight run to their end and
    # every answered call is checkpointed before the error reaches the caller.
    script = {"rules": [{"match": ep_text(0), "responses": [{"status": 500}]}],
              "default": [{"token_delay": 0.05, "echo_memory": True}]}
    store = CheckpointStore(tmp_path / "data").set_flush_policy(every_s=60.0, every_n=1000)  # only the failure flush
    with RunningFakeServer(script, tmp_path / "srv1") as srv, backend(srv.base_url, max_concurrency=4) as be:
        with pytest.raises(LLMEndpointError) as ei:
            decompose_episodes(episodes(), be, created_at=T0, checkpoint=store)
        gens = srv.generations()
    answered = [g for g in gens if g["event"] == "end"]
    assert answered and all(g["how"] == "finished" for g in answered)  # in-flight calls were not cut
    assert len(answered) < CALLS - 3  # some calls were never sent
    assert len(ei.value.finished_outcomes) == len(answered)
    saved = CheckpointStore(tmp_path / "data").load(["ana"])
    assert len(saved) == len(answered) and store.pending == 0  # every answered call is on disk

    with RunningFakeServer({"default": [{"echo_memory": True}]}, tmp_path / "srv2") as srv2, backend(srv2.base_url) as be:
        out = decompose_episodes(episodes(), be, created_at=T0, checkpoint=CheckpointStore(tmp_path / "data"))
        rerun = len(srv2.requests())
    assert rerun == CALLS - len(answered)  # no answered call paid twice
    assert out.stats.reused_calls == len(answered)
    assert stable(out.memories).equals(stable(baseline.memories))


def outcome(i: int) -> CallOutcome:
    key = call_key("u1", f"e{i}", "fact", [{"role": "user", "content": str(i)}], "pv", "m", 64)
    return CallOutcome(key=key, user_id="u1", episode_id=f"e{i}", type="fact", status="ok", output={"memories": []},
                       quarantine=None, ledger=[{"attempt": 1, "status": "ok"}], created_at=T0)


def on_disk(root) -> int:
    return len(CheckpointStore(root).load(["u1"]))


def test_record_flushes_by_count_by_time_and_on_demand(tmp_path):
    store = CheckpointStore(tmp_path / "n").set_flush_policy(every_s=3600.0, every_n=3)
    store.record(outcome(0))
    store.record(outcome(1))
    assert on_disk(tmp_path / "n") == 0 and store.pending == 2
    store.record(outcome(2))  # the third fills the group
    assert on_disk(tmp_path / "n") == 3 and store.pending == 0 and store.flushes == 1
    store.record(outcome(3))
    assert store.flush() == 1 and on_disk(tmp_path / "n") == 4 and store.flush() == 0

    quiet = CheckpointStore(tmp_path / "t").set_flush_policy(every_s=0.2, every_n=1000)
    quiet.record(outcome(0))  # nothing else arrives: the timer writes it
    for _ in range(200):
        if quiet.flushes:
            break
        time.sleep(0.05)
    assert quiet.flushes == 1 and on_disk(tmp_path / "t") == 1 and quiet.pending == 0


def test_a_failed_write_keeps_the_calls_for_the_next_flush(tmp_path):
    store = CheckpointStore(tmp_path).set_flush_policy(every_s=3600.0, every_n=1000)
    real_append, calls = store.append, []

    def failing_once(outcomes):
        calls.append(len(outcomes))
        if len(calls) == 1:
            raise OSError("disk full")
        return real_append(outcomes)

    store.append = failing_once
    store.record(outcome(0))
    with pytest.raises(OSError, match="disk full"):
        store.flush()
    assert store.pending == 1 and on_disk(tmp_path) == 0
    store.record(outcome(1))
    assert store.flush() == 2 and calls == [1, 2] and on_disk(tmp_path) == 2


def test_each_call_gets_twice_the_budget_once_and_a_cut_is_final(tmp_path, baseline):
    # Greedy decoding makes "cut at max_tokens, retry at twice" the same output as one request at
    # twice the budget: each call goes out once with it; one cut even there is quarantined, not sent
    # again (a retry would write the same tokens), and the checkpoint key stays the configured
    # budget's, so checkpoints of the old cut-then-retry policy are still served.
    cut = ep_text(1)
    script = {"rules": [{"match": cut, "responses": [{"content": '{"memories": [{"content": "The user',
                                                      "finish_reason": "length"}]}],
              "default": [{"echo_memory": True}]}
    with RunningFakeServer(script, tmp_path / "srv") as srv, backend(srv.base_url) as be:
        store = CheckpointStore(tmp_path / "ck")
        out = decompose_episodes(episodes(), be, created_at=T0, max_tokens=48, checkpoint=store)
        sent = srv.requests()
    assert len(sent) == CALLS and {r["body"]["max_tokens"] for r in sent} == {96}
    assert out.stats.retries == 0 and out.quarantine.height == 3  # episode 1's three calls
    assert set(out.quarantine["episode_id"]) == {"ana-e1"}
    assert all(r.startswith("length: output cut at max_tokens=96") for r in out.quarantine["reason"])
    ok = out.memories.filter(pl.col("episode_id") != "ana-e1")
    assert stable(ok).equals(stable(baseline.memories.filter(pl.col("episode_id") != "ana-e1")))
    req0 = next(r for r in sent if ep_text(0) in str(r["body"]["messages"]))
    msgs = req0["body"]["messages"]
    mem_type = next(t for t, text in TYPE_INSTRUCTIONS.items() if text in msgs[-1]["content"])
    assert call_key("ana", "ana-e0", mem_type, msgs, out.ledger["prompt_version"][0], "fake-model", 48) \
        in CheckpointStore(tmp_path / "ck").load(["ana"])
