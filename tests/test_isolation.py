"""No user's data reaches another user's outputs, even when their histories are near-duplicates.

Two users with the same sentences, the same conversation ids and the same source refs, differing
only in names and facts (Lake Geneva vs Lake Como), go through the whole main job: the real
continuity classifier, the real embedder and FAISS, and an OpenAI-compatible LLM that is a real
local HTTP server (the system edge) answering with identical structures for both users plus
out-of-episode evidence ids and made-up citation labels. Every memory, index id, retrieval
candidate, query-state citation and every prompt built from memories must stay within one user.
"""

import importlib

import dagster as dg
import faiss
import numpy as np
import polars as pl
import pytest

from fake_openai_server import RunningFakeServer
from qumem_pipeline.storage.layout import DataLayout
from tests.conftest import write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
USERS = {"ann": ("Ann", "Lake Geneva", "peanuts", "Clara"), "ben": ("Ben", "Lake Como", "shellfish", "Marco")}
PLACE = {"ann": "Geneva", "ben": "Como"}


def history(user: str) -> list[dict]:
    name, lake, allergy, sibling = USERS[user]
    texts = [f"Hi, I'm {name}. I swim every morning at {lake}.", "Lovely! How cold is it?",
             f"Cold, but I love it. I am allergic to {allergy}, so I pack my own snacks.", "Good idea.",
             f"My sibling {sibling} swims with me at {lake} on weekends.", "Sounds fun."]
    return [{"user_id": user, "conversation_id": "c1", "session_id": "s1", "role": "user" if i % 2 == 0 else "assistant",
             "speaker": name if i % 2 == 0 else "assistant", "text": t, "timestamp": f"2024-05-0{i + 1}T08:00:00Z",
             "source_ref": f"c1-{i}"} for i, t in enumerate(texts)]


def memory_reply(user: str) -> dict:
    name, lake, allergy, _ = USERS[user]
    return {"json": {"memories": [
        {"content": f"{name} swims every morning at {lake}.", "evidence_turn_ids": [0, 1, 2, 3, 4, 5, 999]},
        {"content": f"{name} is allergic to {allergy}.", "evidence_turn_ids": [2, 5000]},
        {"content": "The user likes cold water.", "evidence_turn_ids": [2]},  # identical text for both users
    ]}}


SCRIPT = {
    "model": "fake-isolation",
    "rules": [  # first match wins: the agents' system prompts first, then the two users' transcripts
        {"match": "information-need agent", "responses": [{"json": {"needs": [{"need": "where the user swims", "why": "plan"}]}}]},
        {"match": "retrieval-planning agent",
         "responses": [{"json": {"queries": [{"query": "where does the user swim", "stores": ["fact", "preference", "insight"]}]}}]},
        {"match": "user-state inference agent", "responses": [{"json": {
            "facts": [{"statement": "swims in a lake", "memory_ids": ["M1", "M2", "M99"]}],
            "preference_trajectory": [], "insights": [{"insight": "keeps a routine", "memory_ids": ["M3"]}]}}]},
        {"match": "Answer the user's query", "responses": [{"json": {"answer": "Go for your usual swim."}}]},
        {"match": "Lake Geneva", "responses": [memory_reply("ann")]},
        {"match": "Lake Como", "responses": [memory_reply("ben")]},
    ],
    "default": [{"json": {"memories": []}}],
}


@pytest.fixture(scope="module")
def isolated_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isolation")
    write_jsonl(tmp / "archive" / "a.jsonl", history("ann") + history("ben"))
    queries = write_jsonl(tmp / "queries.jsonl", [
        {"query_id": f"q-{u}", "user_id": u, "query": "Where should I swim tomorrow?", "as_of": "2024-12-01T00:00:00Z"}
        for u in USERS])
    with RunningFakeServer(SCRIPT, tmp / "llm") as srv, pytest.MonkeyPatch.context() as mp:
        for k, v in {"QUMEM_DATA_ROOT": tmp / "data", "QUMEM_ARCHIVE": tmp / "archive", "QUMEM_QUERIES": queries,
                     "QUMEM_LLM_KIND": "openai", "QUMEM_LLM_BASE_URL": srv.base_url,
                     "QUMEM_QUERY_STRATEGY": "qumem"}.items():  # SCRIPT answers QUMem's three agents
            mp.setenv(k, str(v))
        mp.delenv("QUMEM_WAREHOUSE", raising=False)
        import assets.definitions as d

        importlib.reload(d)
        defs = d.build_definitions()
        instance = dg.DagsterInstance.ephemeral()
        instance.add_dynamic_partitions("users", list(USERS))
        result = defs.resolve_job_def("main_job").execute_in_process(
            instance=instance, tags={RANGE_START: "ann", RANGE_END: "ben"})
        requests = srv.requests()
    assert result.success
    root = tmp / "data"
    tables = {}
    for t in ("turns", "episodes", "memories", "memory_embeddings", "index_ids", "query_states"):
        tables[t] = {u: DataLayout(root).read_user_table(t, u) for u in USERS}
    return {"root": root, "tables": tables, "requests": requests}


def _other(u: str) -> str:
    return next(x for x in USERS if x != u)


def test_memories_cite_only_their_own_users_turns(isolated_run):
    mems, turns = isolated_run["tables"]["memories"], isolated_run["tables"]["turns"]
    for u in USERS:
        m = mems[u]
        assert m.height >= 3, "each user must have memories, or isolation is proven on nothing"
        assert set(m["user_id"]) == {u}
        own_turns = set(turns[u]["turn_index"])
        assert all(set(ev) <= own_turns for ev in m["evidence_turn_ids"].to_list())
        assert not m["content"].str.contains(PLACE[_other(u)]).any()
        assert m["content"].str.contains(PLACE[u]).any()
        eps = isolated_run["tables"]["episodes"][u]
        assert set(eps["user_id"]) == {u} and set(m["episode_id"]) <= set(eps["episode_id"])
    # identical content and identical episode structure still yield distinct ids per user
    assert not set(mems["ann"]["memory_id"]) & set(mems["ben"]["memory_id"])
    assert not set(isolated_run["tables"]["episodes"]["ann"]["episode_id"]) & set(isolated_run["tables"]["episodes"]["ben"]["episode_id"])
    shared_text = "The user likes cold water."
    assert all(shared_text in mems[u]["content"].to_list() for u in USERS)


def test_embeddings_and_index_ids_belong_to_one_user(isolated_run):
    t, root = isolated_run["tables"], isolated_run["root"]
    faiss_ids = {}
    for u in USERS:
        own = set(t["memories"][u]["memory_id"])
        assert set(t["memory_embeddings"][u]["memory_id"]) <= own
        idmap = t["index_ids"][u]
        assert set(idmap["memory_id"]) == own
        ids_in_files = set()
        for blob in DataLayout(root).read_user_table("indexes", u)["faiss"].to_list():
            index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
            ids_in_files |= set(faiss.vector_to_array(index.id_map).tolist())
        assert ids_in_files == set(idmap["id"]), u
        faiss_ids[u] = ids_in_files
    assert not faiss_ids["ann"] & faiss_ids["ben"]


def test_retrieval_candidates_and_citations_stay_within_the_user(isolated_run):
    t = isolated_run["tables"]
    for u in USERS:
        [qs] = t["query_states"][u].rows(named=True)
        own_mems = set(t["memories"][u]["memory_id"])
        cands = [c["memory_id"] for c in qs["candidates"]]
        assert cands and set(cands) <= own_mems
        assert qs["cited_memory_ids"] and set(qs["cited_memory_ids"]) <= own_mems
        assert set(qs["cited_turn_ids"]) <= set(t["turns"][u]["turn_index"])
        assert qs["dropped_citations"] >= 1  # the made-up label M99 is dropped, not resolved elsewhere
        assert PLACE[_other(u)] not in (qs["state"] or "") + (qs["response"] or "")


def test_prompts_built_from_memories_hold_one_users_memories(isolated_run):
    """What the LLM saw: every state-inference prompt lists one user's memories, never both."""
    def text(req):
        return " ".join(m["content"] for m in req["body"]["messages"])

    a3 = [text(r) for r in isolated_run["requests"] if "user-state inference agent" in text(r)]
    assert len(a3) == 2
    assert sorted(("Geneva" in p, "Como" in p) for p in a3) == [(False, True), (True, False)]
    for r in isolated_run["requests"]:
        p = text(r)
        assert not ("Geneva" in p and "Como" in p), p[:500]
