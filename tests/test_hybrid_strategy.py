"""The qumem_hybrid strategy: QUMem's plans (the same A1/A2 calls as qumem, so a record of qumem's
plans answers them) added to AdaMem's hybrid retrieval of the query itself, QUMem's A3 on the union.
Real all-MiniLM embeddings, FAISS indexes and AdaMem bundles; the LLM (a system edge) is scripted."""

import json
import re

import pytest

from qumem_pipeline.index.embeddings import embed_memories
from qumem_pipeline.index.vector_store import VectorStore, build_user_indexes
from qumem_pipeline.query.retrieval import TypedMemoryRetriever
from qumem_pipeline.query.strategies.adamem.retriever import AdaMemRetriever, UserBundle
from qumem_pipeline.query.strategies.base import Query
from qumem_pipeline.query.strategies.registry import infer_user_states
from test_query_state import ScriptedLLM
from tests import adamem_data as data

TYPES = ["fact", "preference", "insight"]
QUERIES = [Query("q-dog", data.USER, "How is Snorlaxia?", 11),
           Query("q-paint", data.USER, "What did Melanie paint?", 11),
           Query("q-early", data.USER, "How is Snorlaxia?", 5)]  # before the dog's turn was said


def _cite_all(r):
    aliases = list(dict.fromkeys(re.findall(r"\bM\d+\b", r.messages[1]["content"])))
    facts = [{"statement": "s", "memory_ids": aliases[i:i + 3]} for i in range(0, min(len(aliases), 9), 3)]
    return json.dumps({"facts": facts, "preference_trajectory": [], "insights": []})


SCRIPT = {
    "a1": lambda r: json.dumps({"needs": [{"need": "the dog's health", "why": "asked"}]}),
    # a rewrite over facts, and the query itself over every store (the anchor A2 often repeats)
    "a2": lambda r: json.dumps({"queries": [{"query": "pottery class", "stores": ["fact"]},
                                            {"query": r.messages[1]["content"].split("\n")[0].split(": ", 1)[-1],
                                             "stores": TYPES}]}),
    "a3": _cite_all, "psi": lambda r: json.dumps({"answer": "a"}),
}


class RecordingLLM(ScriptedLLM):
    def __init__(self, script):
        super().__init__(script)
        self.requests = []

    def generate(self, requests):
        self.requests += requests
        return super().generate(requests)

    def messages(self, stage):
        return [r.messages for r in self.requests if r.request_id.endswith("/" + stage)]


@pytest.fixture(scope="module")
def retrievers():
    from qumem_pipeline.index.embeddings import Embedder
    from qumem_pipeline.query.strategies.hybrid import HybridRetriever

    emb = Embedder.load(device="cpu")
    turns, mems = data.turns(), data.memories()
    typed = TypedMemoryRetriever(VectorStore.in_memory([build_user_indexes(embed_memories(mems, emb), data.USER)]), emb, mems)
    bundles = AdaMemRetriever({data.USER: UserBundle.build(data.USER, turns, mems, emb, episodes=data.episodes())}, emb)
    return typed, HybridRetriever(typed, bundles)


def test_the_plans_add_to_the_querys_hybrid_top_k(retrievers):
    typed, hybrid = retrievers
    llm_h, llm_q = RecordingLLM(SCRIPT), RecordingLLM(SCRIPT)
    out = infer_user_states(QUERIES, llm_h, hybrid, strategy="qumem_hybrid", k=2, respond=True)
    plain = infer_user_states(QUERIES, llm_q, typed, strategy="qumem", k=2, respond=True)
    # the same planning calls as qumem: whatever answered qumem's A1/A2 answers these
    assert llm_h.messages("a1") == llm_q.messages("a1") and llm_h.messages("a2") == llm_q.messages("a2")
    assert [set(b) for b in llm_h.batches] == [{"a1"}, {"a2"}, {"a3"}, {"psi"}]  # one batch per stage
    rows = {r["query_id"]: r for r in out.states.iter_rows(named=True)}
    qumem_rows = {r["query_id"]: r for r in plain.states.iter_rows(named=True)}
    dog = {c["memory_id"] for c in rows["q-dog"]["candidates"]}
    assert "turn:7" in dog  # the dog's turn: no memory holds it, only the hybrid search reaches it
    assert "m-pottery" in dog  # the plan's rewrite over the fact store
    assert not any(c["memory_id"].startswith("turn:") for c in qumem_rows["q-dog"]["candidates"])
    assert 7 in rows["q-dog"]["cited_turn_ids"]
    assert json.loads(rows["q-dog"]["plan"]) == [{"query": "pottery class", "stores": ["fact"]},
                                                 {"query": "How is Snorlaxia?", "stores": ["hybrid"]}]
    assert all(c["position"] <= 5 for c in rows["q-early"]["candidates"])  # nothing said after the query
    assert rows["q-dog"]["strategy"] == "qumem_hybrid" and rows["q-dog"]["response"] == "a"


def test_a_plain_typed_retriever_is_refused(retrievers):
    typed, _ = retrievers
    with pytest.raises(TypeError, match="HybridRetriever"):
        infer_user_states(QUERIES, ScriptedLLM(SCRIPT), typed, strategy="qumem_hybrid", k=2)
