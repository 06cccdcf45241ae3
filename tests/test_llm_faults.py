"""LLM endpoint faults against a real local HTTP server process (tests/fake_openai_server.py).

The memories asset runs for real (Dagster `materialize`, temporary instance) over per-user
`turns`/`episodes` tables written here, so what is checked is what an operator sees: rows in
`memories` / `memory_quarantine`, a run that fails with an actionable message, and a rerun that
sends only the calls the dead endpoint never answered (counted on the server side).
"""

import threading
import time
from datetime import datetime, timedelta, timezone

import dagster as dg
import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.memories.decompose import decompose_episodes
from qumem_pipeline.memories.checkpoints import CheckpointStore
from qumem_pipeline.llm import LLMEndpointError, make_backend
from qumem_pipeline.runtime.processes import free_port
from qumem_pipeline.storage.layout import DataLayout

USERS = ("ana", "ben")
EPISODES_PER_USER = 3
T0 = datetime(2024, 5, 1, 9, 0, tzinfo=timezone.utc)
VOLATILE = {"created_at", "latency_s"}  # when a row was made / how long a call took


def ep_text(user: str, i: int) -> str:
    return f"EP-{user}-{i}: I went hiking on trail {i} with my sister"


def write_inputs(root) -> list[dict]:
    """Per-user turns + episodes tables (two turns per episode), as the upstream assets write them."""
    layout = DataLayout(root)
    episodes = []
    for u in USERS:
        turns, eps = [], []
        for i in range(EPISODES_PER_USER):
            for j, (role, text) in enumerate((("user", ep_text(u, i)), ("assistant", "Sounds lovely."))):
                k = 2 * i + j
                turns.append({"user_id": u, "conversation_id": "c", "session_id": "c", "turn_index": k, "role": role,
                              "speaker": u if role == "user" else None, "text": text,
                              "timestamp": T0 + timedelta(minutes=k)})
            eps.append({"user_id": u, "episode_id": f"{u}-e{i}", "turn_ids": [2 * i, 2 * i + 1]})
            episodes.append({"user_id": u, "episode_id": f"{u}-e{i}",
                             "turns": [t for t in turns if t["turn_index"] in (2 * i, 2 * i + 1)]})
        layout.write_user_table("turns", u, pl.DataFrame(turns))
        layout.write_user_table("episodes", u, pl.DataFrame(eps))
    return episodes


def materialize_memories(root, base_url: str, raise_on_error: bool = True):
    from assets.memories import memories
    from resources import PipelineConfig
    from resources.models import LLMResource

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("users", list(USERS))
    return dg.materialize(
        [memories],
        resources={"pipeline": PipelineConfig(data_root=str(root), archive_path=str(root)),
                   "llm": LLMResource(kind="openai", base_url=base_url, timeout_s=5.0, max_concurrency=4)},
        instance=instance,
        tags={"dagster/asset_partition_range_start": USERS[0], "dagster/asset_partition_range_end": USERS[-1]},
        raise_on_error=raise_on_error,
    )


def stable(df: pl.DataFrame) -> pl.DataFrame:
    return df.drop([c for c in df.columns if c in VOLATILE])


def table(root, name: str) -> pl.DataFrame:
    df = DataLayout(root).read_table(name)
    return stable(df) if df is not None else pl.DataFrame()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted run against a healthy server: the tables every recovered run must equal."""
    tmp = tmp_path_factory.mktemp("baseline")
    write_inputs(tmp / "data")
    with RunningFakeServer({"default": [{"echo_memory": True}]}, tmp / "srv") as srv:
        assert materialize_memories(tmp / "data", srv.base_url).success
        n_requests = len(srv.requests())
    mem = table(tmp / "data", "memories")
    assert mem.height == len(USERS) * EPISODES_PER_USER * 3  # one memory per (episode, type)
    return {"memories": mem, "ledger": table(tmp / "data", "llm_ledger"), "requests": n_requests}


def backend(srv_url: str, **kw):
    cfg = dict(base_url=srv_url, model="fake-model", max_retries=4, backoff_base_s=0.05, backoff_max_s=0.2,
               timeout_s=1.0, max_concurrency=4)
    cfg.update(kw)
    return make_backend("openai", **cfg)


@pytest.mark.parametrize(
    "faults",
    [
        [{"status": 500}, {"status": 502}, {"status": 503}],  # a 5xx burst
        [{"hang": 3}],  # a hung connection: the 1 s client timeout fires
        [{"drop": True}],  # connection closed before any answer
        [{"truncate": True}],  # headers and half a body, then the connection is cut
        [{"garbage": "<html>502 Bad Gateway</html>"}],  # a proxy's error page with status 200
    ],
    ids=["5xx-burst", "hung", "drop", "mid-response-disconnect", "non-json-body"],
)
def test_transient_faults_recover_with_identical_memories(tmp_path, baseline, faults):
    episodes = write_inputs(tmp_path / "data")
    target = ep_text("ana", 1)  # only this episode's calls see the faults, then succeed
    script = {"rules": [{"match": target, "responses": faults * 3 + [{"echo_memory": True}]}],
              "default": [{"echo_memory": True}]}
    with RunningFakeServer(script, tmp_path / "srv") as srv, backend(srv.base_url) as be:
        out = decompose_episodes(episodes, be, created_at=T0)
        hit = [r for r in srv.requests() if target in str(r["body"]["messages"])]
    assert out.quarantine.height == 0
    assert stable(out.memories).equals(baseline["memories"])
    assert len(hit) == 3 * (len(faults) + 1)  # every retry really went over the wire
    # the rule's faults are shared by the episode's three calls, in whatever order they arrive
    assert out.ledger.filter(pl.col("episode_id") == "ana-e1")["transport_attempts"].sum() == len(hit)


def test_429_retry_after_is_capped(tmp_path):
    # the server asks for an hour; the client waits max_retry_after_s (0.3 s) instead. Checked on the
    # server's clock with a lower bound (it did wait) and the test finishing at all (not an hour):
    # no upper wall-clock bound that a loaded box could break.
    script = {"rules": [{"match": "wait-long", "responses": [{"status": 429, "retry_after": 3600}, {"json": {"memories": []}}]}]}
    from qumem_pipeline.llm import ChatRequest

    with RunningFakeServer(script, tmp_path) as srv, backend(srv.base_url, max_retry_after_s=0.3) as be:
        assert be._backoff(0, 3600.0) == 0.3  # what the wait is: the cap, not the server's hour
        (res,) = be.generate([ChatRequest(request_id="r0", messages=[{"role": "user", "content": "wait-long"}],
                                          json_schema={"type": "object"})])
        times = [r["t"] for r in srv.requests()]
    assert res.ok and res.attempts == 2 and len(times) == 2
    assert times[1] - times[0] >= 0.25


def test_malformed_and_schema_violating_output_is_quarantined_with_reason(tmp_path, baseline):
    write_inputs(tmp_path / "data")
    script = {"rules": [
        {"match": ep_text("ana", 0), "responses": [{"content": '{"memories": [{"content": "unterminated'}]},
        {"match": ep_text("ben", 2), "responses": [{"json": {"memories": [{"content": 7, "evidence_turn_ids": "x"}]}}]},
    ], "default": [{"echo_memory": True}]}
    with RunningFakeServer(script, tmp_path / "srv") as srv:
        result = materialize_memories(tmp_path / "data", srv.base_url)
        n = len(srv.requests())
    assert result.success
    q = table(tmp_path / "data", "memory_quarantine").sort(["user_id", "episode_id", "type"])
    assert q.select("user_id", "episode_id").unique().sort("user_id").rows() == [("ana", "ana-e0"), ("ben", "ben-e2")]
    assert q.height == 6 and (q["attempts"] == 2).all()  # each type retried once, then quarantined
    assert q.filter(pl.col("user_id") == "ana")["reason"].str.starts_with("invalid_json").all()
    assert q.filter(pl.col("user_id") == "ben")["reason"].str.starts_with("schema_violation").all()
    assert q["raw"].str.len_chars().min() > 0  # the bad output is kept for inspection
    assert n == baseline["requests"] + 6  # the 6 bad calls were each sent twice
    good = baseline["memories"].filter(~pl.col("episode_id").is_in(["ana-e0", "ben-e2"]))
    assert table(tmp_path / "data", "memories").equals(good)


def test_server_that_dies_and_comes_back_within_the_retries(tmp_path, baseline):
    episodes = write_inputs(tmp_path / "data")
    port = free_port()
    script = {"rules": [{"match": ep_text("ben", 0), "responses": [{"exit": True}]}],
              "default": [{"echo_memory": True}]}
    srv = RunningFakeServer(script, tmp_path / "srv1", port=port)
    revived = {}

    def revive():
        srv.proc.wait(timeout=60)  # the scripted crash
        time.sleep(0.3)
        revived["srv"] = RunningFakeServer({"default": [{"echo_memory": True}]}, tmp_path / "srv2", port=port)

    th = threading.Thread(target=revive)
    th.start()
    try:
        with backend(srv.base_url, max_retries=8, backoff_base_s=0.2, backoff_max_s=1.0) as be:
            out = decompose_episodes(episodes, be, created_at=T0, checkpoint=CheckpointStore(tmp_path / "data"))
        th.join(timeout=60)
    finally:
        srv.stop()
        if "srv" in revived:
            revived["srv"].stop()
    assert srv.proc.returncode == 3, "the server must really have died"
    assert out.quarantine.height == 0 and stable(out.memories).equals(baseline["memories"])
    assert out.ledger["transport_attempts"].max() >= 2


def test_endpoint_gone_for_good_fails_clearly_and_rerun_repeats_no_finished_call(tmp_path, baseline):
    data = tmp_path / "data"
    write_inputs(data)
    port = free_port()
    # the server crashes on ben's second episode and does not come back for this run
    script = {"rules": [{"match": ep_text("ben", 1), "responses": [{"exit": True}]}], "default": [{"echo_memory": True}]}
    with RunningFakeServer(script, tmp_path / "srv1", port=port) as srv1:
        result = materialize_memories(data, srv1.base_url, raise_on_error=False)
        answered_before = len(srv1.answered())
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    msg = failure.event_specific_data.error.to_string()
    assert f"127.0.0.1:{port}" in msg and "rerun" in msg.lower() and "memory_checkpoints" in msg
    assert "after 5 attempt(s)" in msg  # bounded retries: the first try and max_retries=4
    assert DataLayout(data).read_table("memories") is None  # nothing half-written
    assert 0 < answered_before < 3 * len(USERS) * EPISODES_PER_USER

    with RunningFakeServer({"default": [{"echo_memory": True}]}, tmp_path / "srv2", port=port) as srv2:
        assert materialize_memories(data, srv2.base_url).success
        rerun_requests = len(srv2.requests())
    assert rerun_requests == 3 * len(USERS) * EPISODES_PER_USER - answered_before  # no finished call repeated
    assert table(data, "memories").equals(baseline["memories"])
    ledger = table(data, "llm_ledger").drop("transport_attempts")
    assert ledger.equals(baseline["ledger"].drop("transport_attempts"))
    # checkpoints compacted to exactly the calls in use, one row per call
    ck = DataLayout(data).read_table("memory_checkpoints")
    assert ck["key"].n_unique() == ck.height == 3 * len(USERS) * EPISODES_PER_USER
    assert sorted(ck["user_id"].unique()) == sorted(USERS)
    # a third run repeats nothing at all
    with RunningFakeServer({"default": [{"echo_memory": True}]}, tmp_path / "srv3", port=port) as srv3:
        assert materialize_memories(data, srv3.base_url).success
        assert srv3.requests() == []
    assert table(data, "memories").equals(baseline["memories"])


def test_changed_episode_is_recomputed_not_served_from_checkpoint(tmp_path):
    episodes = write_inputs(tmp_path / "data")
    store = CheckpointStore(tmp_path / "data")
    seen, again = [], []
    with RunningFakeServer({"default": [{"echo_memory": True}]}, tmp_path / "srv") as srv, backend(srv.base_url) as be:
        decompose_episodes(episodes, be, created_at=T0, checkpoint=store,
                           progress=lambda done, total: seen.append((done, total)))
        before = len(srv.requests())
        episodes[0]["turns"][0] = {**episodes[0]["turns"][0], "text": "EP-ana-0: I went sailing instead"}
        out = decompose_episodes(episodes, be, created_at=T0, checkpoint=store,
                                 progress=lambda done, total: again.append((done, total)))
        after = len(srv.requests())
    assert before == 18 and after - before == 3  # only the edited episode's three calls
    # progress after every finished call (a (0, total) line first announces the work for the heartbeat)
    assert [x for x in seen if x[0]] == [(i, 18) for i in range(1, 19)]
    assert [x for x in again if x[0]] == [(1, 3), (2, 3), (3, 3)]  # restored calls are not counted as work
    assert {t for _, t in seen} == {18} and {t for _, t in again} == {3}
    assert out.stats.reused_calls == 15
    assert out.memories.filter(pl.col("episode_id") == "ana-e0")["content"].str.contains("sailing").all()


def test_wrong_url_fails_at_once_naming_the_fix(tmp_path):
    script = {"default": [{"status": 404}]}
    with RunningFakeServer(script, tmp_path) as srv, backend(srv.base_url) as be:
        with pytest.raises(LLMEndpointError) as ei:
            decompose_episodes(write_inputs(tmp_path / "data"), be, created_at=T0)
        n = len(srv.requests())
    assert "HTTP 404" in str(ei.value) and "base_url" in str(ei.value) and srv.base_url in str(ei.value)
    assert n <= 4  # no retry storm: each in-flight request stops at its first 404


def test_served_model_id_is_recorded_when_no_model_is_configured(tmp_path, monkeypatch):
    # `openai` backend, QUMEM_LLM_MODEL unset: the model id on every output and ledger row is the
    # one the server serves (GET /v1/models), not a default name.
    monkeypatch.delenv("QUMEM_LLM_MODEL", raising=False)
    data = tmp_path / "data"
    write_inputs(data)
    with RunningFakeServer({"model": "served/Qwen2.5-Coder-1.5B", "default": [{"echo_memory": True}]},
                           tmp_path / "srv") as srv:
        result = materialize_memories(data, srv.base_url)
        asked = [r for r in srv.requests() if r["path"].endswith("/chat/completions")]
    assert result.success
    mat = result.asset_materializations_for_node("memories")[0]
    assert mat.metadata["model"].value == "served/Qwen2.5-Coder-1.5B"
    mem, ledger = table(data, "memories"), table(data, "llm_ledger")
    assert mem.height == len(USERS) * EPISODES_PER_USER * 3
    assert set(mem["model"]) == set(ledger["model"]) == {"served/Qwen2.5-Coder-1.5B"}
    assert {r["body"]["model"] for r in asked} == {"served/Qwen2.5-Coder-1.5B"}  # and it is what was asked for
