"""Every LLM call of persona merges and of the query agents (A1/A2/A3, the answer) checkpointed per user
and in the ledger with its stage and tokens (issue 27, item 7): a rerun sends no finished call and
writes the same ledger rows; a run that failed midway is resumed with only the missing calls; the
warehouse's `llm_ledger` gives the cost per stage, decomposition's rows included.

The assets run through Dagster on real Delta tables with the fake OpenAI-compatible server (a real
local HTTP server that logs every request it receives)."""

import json

import dagster as dg
import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.llm.base import ChatRequest, ChatResult, LLMEndpointError, parse_structured
from qumem_pipeline.llm.retry import generate_with_retry
from qumem_pipeline.memories.call_ledger import CheckpointedLLM, call_tags
from qumem_pipeline.memories.checkpoints import CheckpointStore
from qumem_pipeline.storage.layout import DataLayout
from tests import adamem_data as data
from tests.conftest import write_jsonl

U = data.USER
SCHEMA = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}


# -- the wrapper, on a scripted backend ---------------------------------------------------------
class Scripted:
    """A backend answering from `answers` (prompt -> raw text or an exception), counting what it is sent."""

    model_name, backend_name, temperature = "m", "scripted", 0.0

    def __init__(self, answers):
        self.answers, self.sent = answers, []

    def generate(self, requests):
        out = []
        for r in requests:
            self.sent.append(r.messages[-1]["content"])
            raw = self.answers[r.messages[-1]["content"]]
            if isinstance(raw, Exception):
                err = LLMEndpointError("fake://", "down", 1)
                err.partial_results = out + [None] * (len(requests) - len(out))
                raise err
            if raw.startswith("HTTP"):
                out.append(ChatResult(r.request_id, None, raw, f"http_error: {raw}", attempts=1))
                continue
            parsed, err = parse_structured(raw, r.json_schema)
            out.append(ChatResult(r.request_id, parsed, raw, err, prompt_tokens=len(r.messages[-1]["content"]),
                                  completion_tokens=len(raw), latency_s=0.01, finish_reason="stop"))
        return out


def req(user, prompt, stage="a1", max_tokens=64):
    return ChatRequest(f"{user}-{prompt}/{stage}", [{"role": "user", "content": prompt}], SCHEMA, max_tokens, "out",
                       metadata=call_tags(user, stage, f"{user}-{prompt}"))


def run(root, backend, requests, created_at=None):
    llm = CheckpointedLLM(backend, CheckpointStore(root, table="query_checkpoints"), code_version="cv",
                          prompt_version="pv", created_at=created_at)
    return llm, generate_with_retry(llm, requests)


def test_finished_calls_replay_and_only_unanswered_ones_are_sent_again(tmp_path):
    answers = {"a": '{"x": "A"}', "b": "not json", "c": "HTTP 400", "d": '{"x": "D"}'}
    reqs = [req("u1", "a"), req("u1", "b", "a2"), req("u2", "c", "a3"), req("u2", "d", "qa")]
    first_backend = Scripted(answers)
    first, res1 = run(tmp_path, first_backend, reqs)
    # b: unusable output twice (the retry is a call of its own); c: an HTTP error answer, also retried
    assert first_backend.sent == ["a", "b", "c", "d", "b", "c"]
    ledger = first.ledger()
    assert ledger.select("request_id", "stage", "attempt", "status").rows() == [
        ("u1-a/a1", "a1", 1, "ok"), ("u1-b/a2", "a2", 1, "error"), ("u2-c/a3", "a3", 1, "error"),
        ("u2-d/qa", "qa", 1, "ok"), ("u1-b/a2", "a2", 2, "error"), ("u2-c/a3", "a3", 2, "error")]
    assert ledger["prompt_tokens"].to_list() == [1, 1, 0, 1, 1, 0] and set(ledger["code_version"]) == {"cv"}
    first.compact(["u1", "u2"])
    # the rerun: every finished call (answers and the model's own bad output) replayed, the HTTP error sent again
    again_backend = Scripted(answers)
    again, res2 = run(tmp_path, again_backend, reqs)
    assert again_backend.sent == ["c", "c"] and again.replayed == 4 and again.sent == 2
    assert [(r.parsed, r.error, r.prompt_tokens, r.completion_tokens) for r in res2] == \
        [(r.parsed, r.error, r.prompt_tokens, r.completion_tokens) for r in res1]
    assert again.ledger().drop("latency_s", "created_at").equals(ledger.drop("latency_s", "created_at"))
    assert again.ledger().filter(pl.col("request_id") != "u2-c/a3").equals(ledger.filter(pl.col("request_id") != "u2-c/a3"))
    # checkpoints are rows of user-keyed tables
    layout = DataLayout(tmp_path)
    assert layout.users_in("query_checkpoints") == ["u1", "u2"]
    assert layout.read_user_table("query_checkpoints", "u1")["type"].to_list() == ["a1", "a2", "a2"]


def test_key_names_model_decoding_schema_and_prompt(tmp_path):
    backend = Scripted({"a": '{"x": "A"}'})
    first, _ = run(tmp_path, backend, [req("u1", "a")])
    first.compact(["u1"])
    for change in (dict(model_name="m2"), dict(temperature=0.7)):
        other = Scripted({"a": '{"x": "A"}'})
        for k, v in change.items():
            setattr(other, k, v)
        run(tmp_path, other, [req("u1", "a")])
        assert other.sent == ["a"], change
    for changed in (req("u1", "a", max_tokens=65), req("u1", "a", stage="a2"), req("u2", "a"),
                    ChatRequest("r", [{"role": "user", "content": "a"}], {**SCHEMA, "title": "t"}, 64, "out",
                                metadata=call_tags("u1", "a1"))):
        other = Scripted({"a": '{"x": "A"}'})
        run(tmp_path, other, [changed])
        assert other.sent == ["a"], changed
    same = Scripted({"a": '{"x": "A"}'})
    run(tmp_path, same, [req("u1", "a")])
    assert same.sent == []
    with pytest.raises(ValueError, match="user_id and stage"):
        run(tmp_path, same, [ChatRequest("r", [{"role": "user", "content": "a"}], SCHEMA)])


def test_an_endpoint_failure_keeps_what_finished(tmp_path):
    answers = {"a": '{"x": "A"}', "b": RuntimeError("down")}
    with pytest.raises(LLMEndpointError):
        run(tmp_path, Scripted(answers), [req("u1", "a"), req("u1", "b")])
    resumed = Scripted({"a": '{"x": "A"}', "b": '{"x": "B"}'})
    llm, res = run(tmp_path, resumed, [req("u1", "a"), req("u1", "b")])
    assert resumed.sent == ["b"] and [r.parsed for r in res] == [{"x": "A"}, {"x": "B"}]


# -- the assets, through Dagster, with the fake server --------------------------------------------
A3_STATE = {"facts": [{"statement": "Caroline met the adoption agency.", "memory_ids": ["M1"]}],
            "preference_trajectory": [], "insights": []}
QUERY_RULES = {
    "a1": {"match": "information-need agent", "responses": [{"json": {"needs": [{"need": "adoption", "why": "asked"}]}}]},
    "a2": {"match": "retrieval-planning agent", "responses": [{"json": {"queries": [{"query": "adoption", "stores": ["fact"]}]}}]},
    "a3": {"match": "user-state inference agent", "responses": [{"json": A3_STATE}]},
    "qa": {"match": "Answer the user's query", "responses": [{"json": {"answer": "Monday."}}]},
}
STAGE_OF = {r["match"]: s for s, r in QUERY_RULES.items()}
MERGE_RULE = {"match": "persona profile", "responses": [{"json": {"aspect": "hobby", "summary": "Likes it."}}]}


def script(rules, fail_after=None):
    """The fake server's script; `fail_after=(rule, n)`: that rule answers n requests, then 401 (the endpoint gone)."""
    rules = {k: dict(v) for k, v in rules.items()}
    if fail_after:
        name, n = fail_after
        rules[name]["responses"] = rules[name]["responses"] * n + [{"status": 401}]
    return {"model": "fake-model", "rules": list(rules.values())}


def stages_sent(srv) -> list[str]:
    out = []
    for r in srv.requests():
        text = "\n".join(m["content"] for m in r["body"]["messages"])
        out += [s for m, s in STAGE_OF.items() if m in text] or (["persona_merge"] if "persona profile" in text else ["?"])
    return sorted(out)


@pytest.fixture(scope="module")
def resources():
    from resources import PipelineConfig
    from resources.models import EmbedderResource, LLMResource

    def make(root, srv, **pipeline):
        # qumem unless a test says otherwise: these scripts answer QUMem's three agents
        return {"pipeline": PipelineConfig(data_root=str(root), archive_path=str(root),
                                           **{"query_strategy": "qumem", **pipeline}),
                "llm": LLMResource(kind="openai", base_url=srv.base_url, model="fake-model"),
                "embedder": EmbedderResource(device="cpu")}
    return make


def materialize(assets, root, tmp, name, rules, resources, fail_after=None, **pipeline):
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("users", [U])
    with RunningFakeServer(script(rules, fail_after), tmp / name) as srv:
        res = dg.materialize(assets, instance=instance, partition_key=U, resources=resources(root, srv, **pipeline),
                             raise_on_error=False)
        return res, stages_sent(srv)


def ledger(root, table):
    return DataLayout(root).read_user_table(table, U)


def test_query_states_ledgers_every_agent_call_and_a_rerun_pays_for_none(tmp_path, resources):
    from assets.query_states import query_states
    from assets.retrieval import memory_embeddings, memory_indexes
    from qumem_pipeline.storage.warehouse import Warehouse

    root = tmp_path / "data"
    layout = DataLayout(root)
    layout.write_user_table("turns", U, data.turns())
    layout.write_user_table("episodes", U, data.episodes())
    layout.write_user_table("memories", U, data.memories())
    # a decomposition ledger row written before ledger rows named their stage
    layout.write_user_table("llm_ledger", U, pl.DataFrame({"request_id": ["e0/fact/1"], "user_id": [U], "type": ["fact"],
                                                           "prompt_tokens": [100], "completion_tokens": [10]}))
    queries = write_jsonl(tmp_path / "q.jsonl", [
        {"query_id": "q1", "user_id": U, "query": "When did Caroline meet the adoption agency?", "as_of_turn": 11},
        {"query_id": "q2", "user_id": U, "query": "What does Caroline want?", "as_of_turn": 11},
    ])
    cfg = dict(queries_path=str(queries), respond=True)
    # 1. the endpoint goes away after one A3 answer: the run fails, its finished calls are checkpointed
    res, sent = materialize([memory_embeddings, memory_indexes, query_states], root, tmp_path, "s1", QUERY_RULES,
                            resources, fail_after=("a3", 1), **cfg)
    assert not res.success and layout.read_user_table("query_states", U) is None
    assert sent == ["a1", "a1", "a2", "a2", "a3", "a3"]  # the second A3 got the 401
    # 2. rerun: only the missing calls (one A3, both answers) are sent
    res, sent = materialize([query_states], root, tmp_path, "s2", QUERY_RULES, resources, **cfg)
    assert res.success and sent == ["a3", "qa", "qa"]
    first = ledger(root, "query_llm_ledger")
    assert first.group_by("stage").len().sort("stage").rows() == [("a1", 2), ("a2", 2), ("a3", 2), ("qa", 2)]
    assert (first["prompt_tokens"] > 0).all() and (first["completion_tokens"] > 0).all()
    assert first.filter(pl.col("stage") == "a1")["request_id"].to_list() == ["q1/a1", "q2/a1"]
    assert set(first["attempt"]) == {1} and set(first["status"]) == {"ok"} and set(first["model"]) == {"fake-model"}
    states = layout.read_user_table("query_states", U).sort("query_id")
    assert states["response"].to_list() == ["Monday.", "Monday."]
    # per-query totals are the ledger's, replayed calls included
    assert states["prompt_tokens"].sum() == first["prompt_tokens"].sum()
    mat = res.asset_materializations_for_node("query_states")[0].metadata
    assert mat["llm_calls"].value == 8 and mat["llm_calls_sent"].value == 3 and mat["llm_calls_reused_from_checkpoint"].value == 5
    # 3. rerun of the same partition: no request at all, the same ledger rows and states
    res, sent = materialize([query_states], root, tmp_path, "s3", QUERY_RULES, resources, **cfg)
    assert res.success and sent == []
    assert ledger(root, "query_llm_ledger").equals(first)
    again = layout.read_user_table("query_states", U).sort("query_id")
    assert again.drop("created_at").equals(states.drop("created_at"))
    assert layout.read_user_table("query_checkpoints", U).height == 8  # compacted to the calls in use
    # the warehouse: cost per stage in one query, decomposition included
    wh = Warehouse(root / "wh.duckdb")
    wh.load_users(layout, [U])
    with wh.connect(read_only=True) as con:
        cost = con.execute("SELECT stage, sum(prompt_tokens), sum(completion_tokens), count(*) FROM llm_ledger "
                           "GROUP BY stage ORDER BY stage").fetchall()
    want = [(s, int(p), int(c), int(n)) for s, p, c, n in first.group_by("stage").agg(
        pl.col("prompt_tokens").sum(), pl.col("completion_tokens").sum(), pl.len()).rows()]
    assert [tuple(r) for r in cost] == sorted([*want, ("decompose", 100, 10, 1)])


def test_persona_merges_are_checkpointed_and_ledgered(tmp_path, resources):
    from assets.adamem import persona_profiles
    from qumem_pipeline.storage.forget import forget_user
    from test_adamem_profiles import memories

    root = tmp_path / "data"
    layout = DataLayout(root)
    mems = memories()
    dup = mems.filter(pl.col("memory_id") == "m-dream").with_columns(
        memory_id=pl.lit("m-dream-2"), content=pl.lit("Caroline really wants to adopt a child and give a kid a loving home."))
    layout.write_user_table("memories", U, pl.concat([mems, dup]))
    rules = {"merge": MERGE_RULE}
    # two near-duplicate groups (painting, adoption): the endpoint goes after one merge
    res, sent = materialize([persona_profiles], root, tmp_path, "s1", rules, resources, fail_after=("merge", 1))
    assert not res.success and sent == ["persona_merge", "persona_merge"]
    assert layout.read_user_table("persona_checkpoints", U).height == 1
    res, sent = materialize([persona_profiles], root, tmp_path, "s2", rules, resources)
    assert res.success and sent == ["persona_merge"]
    first = ledger(root, "persona_llm_ledger")
    assert first.height == 2 and set(first["stage"]) == {"persona_merge"} and (first["completion_tokens"] > 0).all()
    assert first["request_id"].str.ends_with("/merge").all()
    profiles = layout.read_user_table("persona_profiles", U)
    assert profiles.filter(pl.col("merged_by") == "llm").height == 2
    # rerun: the merges come back from the checkpoints (not from the profiles table), so they stay in the ledger
    res, sent = materialize([persona_profiles], root, tmp_path, "s3", rules, resources)
    assert res.success and sent == [] and ledger(root, "persona_llm_ledger").equals(first)
    assert layout.read_user_table("persona_profiles", U).drop("created_at").equals(profiles.drop("created_at"))
    # per user: forgetting the user removes the checkpoints and the ledger
    forget_user(root, root / "wh.duckdb", U)
    assert layout.read_user_table("persona_checkpoints", U) is None and ledger(root, "persona_llm_ledger") is None
