"""AdaMem's route-planned hybrid retrieval over one user's turns, memories, profile entries and graph.

Per query (each user's queries of a batch embedded in one encode call of their own; each user's units embedded once):

1. baseline semantic candidates from three channels - persona profile entries, memories of the
   target participant's bundle (facts first), and turns (dense, plus turns linked to a topic the
   question names);
2. score-drop reactivation: the fact hits before the first large score drop bring back the turns
   that support them;
3. keyword backoff: BM25 on the question's rarest words over turns and memories;
4. when the route plan says so, bounded multi-hop expansion from the top baseline seeds over the
   memory graph (edge-type prior x hop decay; owner-filtered when the participant is unambiguous);
5. fusion: w_b * baseline rank score + w_g * graph rank score + w_r * linear recency prior + a bonus
   for items backed by fact retrieval; top-k.

Every channel sees only units at or before the query's as_of (positions are masked before ranking),
so no future evidence can enter by any route.
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import polars as pl

from qumem_pipeline.index.per_user_encode import encode_per_user
from qumem_pipeline.query.strategies.adamem.graph import MemoryGraph, build_memory_graph, memory_node, turn_node
from qumem_pipeline.query.strategies.adamem.lexical import BM25Index
from qumem_pipeline.query.strategies.adamem.participants import AMBIGUOUS, BOTH, Participants, owners_for, resolve
from qumem_pipeline.query.strategies.adamem.route import RoutePlan
from qumem_pipeline.query.strategies.adamem.text import tokens
from qumem_pipeline.query.strategies.base import RetrievedMemory

CHANNEL_DEPTH = 10  # candidates per baseline channel
SCORE_DROP = 0.08  # a fact-hit score gap larger than this ends reactivation
MAX_REACTIVATED_FACTS = 3
DEFAULT_K = 10


@dataclass
class Unit:
    """A retrievable unit: a turn, a memory or a profile entry."""

    unit_id: str  # memory_id, "turn:<i>" or "profile:<id>"
    node_id: str
    kind: str  # "turn", "profile", or the memory type
    content: str
    position: int
    owner: str | None
    evidence: list[int]
    valid_from: datetime | None = None


@dataclass
class Hit:
    unit: Unit
    score: float
    channels: list[str] = field(default_factory=list)

    def as_retrieved(self) -> RetrievedMemory:
        """The hit as a strategy candidate (a turn's id is ``turn:<i>``, its type ``turn``)."""
        u = self.unit
        return RetrievedMemory(u.unit_id, u.kind, u.content, u.position, float(self.score), list(u.evidence), u.valid_from)


class UserBundle:
    """One user's units with vectors, a BM25 index and the memory graph."""

    def __init__(self, user_id: str, units: list[Unit], vectors: np.ndarray, graph: MemoryGraph, participants: Participants):
        self.user_id, self.units, self.vectors, self.graph, self.participants = user_id, units, vectors, graph, participants
        self.positions = np.asarray([u.position for u in units], dtype=np.int64)
        self.kinds = np.asarray([u.kind for u in units])
        self.by_node = {u.node_id: i for i, u in enumerate(units)}
        self.lexical = BM25Index.build([u.node_id for u in units if u.kind != "profile"],
                                       [u.content for u in units if u.kind != "profile"],
                                       [u.position for u in units if u.kind != "profile"])
        self.topic_turns: dict[str, list[int]] = defaultdict(list)
        for nid, links in graph.adj.items():
            if nid.startswith("topic:"):
                self.topic_turns[nid[6:]] = sorted(self.by_node[v] for v, t in links if t == "same-topic" and v.startswith("turn:"))

    @classmethod
    def build(cls, user_id: str, turns: pl.DataFrame, memories: pl.DataFrame, embedder, *,
              episodes: pl.DataFrame | None = None, nodes: pl.DataFrame | None = None, edges: pl.DataFrame | None = None,
              profiles: pl.DataFrame | None = None, memory_vectors: dict[str, np.ndarray] | None = None) -> "UserBundle":
        """From the pipeline's tables; the graph is read (nodes/edges) or built from ``episodes``."""
        if nodes is None or edges is None:
            if episodes is None:
                raise ValueError(f"user {user_id}: need the memory graph tables or the episodes to build it")
            nodes, edges = build_memory_graph(user_id, turns, episodes, memories, profiles)
        graph = MemoryGraph(nodes, edges)
        units: list[Unit] = []
        stamps = turns["timestamp"].to_list() if "timestamp" in turns.columns else [None] * turns.height
        for ti, sp, text, ts in zip(turns["turn_index"].to_list(), turns["speaker"].to_list(), turns["text"].to_list(), stamps):
            n = graph.nodes[turn_node(ti)]  # a turn carries its date, so relative dates in it can be resolved
            units.append(Unit(turn_node(ti), turn_node(ti), "turn", f"{sp}: {text}" if sp else text, ti, n["owner"], [ti], ts))
        for r in memories.iter_rows(named=True):
            n = graph.nodes[memory_node(r["memory_id"])]
            units.append(Unit(r["memory_id"], n["node_id"], r["type"], r["content"], r["position"], n["owner"],
                              list(r["evidence_turn_ids"] or []), r.get("valid_from")))
        if profiles is not None:
            mem_ev = {u.unit_id: u.evidence for u in units}
            for r in profiles.iter_rows(named=True):
                nid = f"profile:{r['profile_id']}"
                ev = sorted({t for m in r["memory_ids"] for t in mem_ev.get(m, [])})
                units.append(Unit(nid, nid, "profile", f"{r['aspect']}: {r['summary']}", graph.nodes[nid]["position"],
                                  "user", ev))
        todo = [i for i, u in enumerate(units) if not (memory_vectors and u.unit_id in memory_vectors)]
        enc = embedder.encode([units[i].content for i in todo])
        vecs = np.zeros((len(units), enc.shape[1] if len(todo) else embedder.dim), dtype=np.float32)
        vecs[todo] = enc
        for i, u in enumerate(units):
            if memory_vectors and u.unit_id in memory_vectors:
                vecs[i] = memory_vectors[u.unit_id]
        return cls(user_id, units, vecs, graph, Participants.from_turns(turns, user_id))

    # ------------------------------------------------------------------------------------
    def retrieve(self, question: str, qvec: np.ndarray, as_of: int, plan: RoutePlan, k: int = DEFAULT_K,
                 target: str | None = None, trace: dict | None = None) -> list[Hit]:
        """Top-k fused hits; ``trace`` (optional dict) receives the seeds and the expansion for inspection."""
        target = target or resolve(question, self.participants)
        owners = owners_for(target)
        visible = self.positions <= as_of
        sims = np.where(visible, self.vectors @ qvec, -np.inf)
        ranked: dict[str, list[int]] = {}

        def top(mask: np.ndarray, depth: int = CHANNEL_DEPTH) -> list[int]:
            s = np.where(mask, sims, -np.inf)
            order = np.argsort(-s, kind="stable")[:depth]
            return [int(i) for i in order if np.isfinite(s[i])]

        is_mem = ~np.isin(self.kinds, ["turn", "profile"])
        in_bundle = np.asarray([u.owner in owners for u in self.units])
        ranked["profile"] = top(self.kinds == "profile")
        ranked["memory"] = top(is_mem & in_bundle)
        ranked["turn"] = top(self.kinds == "turn")
        words = set(tokens(question))
        linked = sorted({i for w in words for i in self.topic_turns.get(w, ()) if visible[i]}, key=lambda i: -sims[i])
        ranked["topic"] = linked[:CHANNEL_DEPTH]
        # score-drop reactivation of the turns supporting the best fact hits
        facts = [i for i in ranked["memory"] if self.kinds[i] == "fact"]
        keep: list[int] = []
        for j, i in enumerate(facts[:MAX_REACTIVATED_FACTS]):
            if j and sims[facts[j - 1]] - sims[i] > SCORE_DROP:
                break
            keep.append(i)
        react = []
        for i in keep:
            for t in self.units[i].evidence:
                ti = self.by_node.get(turn_node(t))
                if ti is not None and visible[ti] and ti not in react:
                    react.append(ti)
        ranked["reactivated"] = react
        ranked["lexical"] = [self.by_node[d] for d, _, _ in self.lexical.backoff(question, CHANNEL_DEPTH, as_of)]

        baseline: dict[int, float] = defaultdict(float)
        channels: dict[int, list[str]] = defaultdict(list)
        for ch, idx in ranked.items():
            for r, i in enumerate(idx):
                baseline[i] += 1.0 / (1 + r)
                channels[i].append(ch)
        fact_backed = set(keep) | set(react)

        graph_rs: dict[int, float] = {}
        if plan.expand and baseline:
            seeds_idx = sorted(baseline, key=lambda i: (-baseline[i], i))[: plan.seeds]
            top_score = baseline[seeds_idx[0]]
            seeds = {self.units[i].node_id: baseline[i] / top_score for i in seeds_idx}
            reached = self.graph.expand(seeds, plan.hops, plan.edge_priors, plan.hop_decay, as_of)
            if trace is not None:
                trace.update(seeds=list(seeds), reached=reached)
            unambiguous = target not in (AMBIGUOUS, BOTH)
            found = []
            for nid, (score, hop) in reached.items():
                i = self.by_node.get(nid)
                if hop == 0 or i is None or not visible[i]:
                    continue
                if unambiguous and self.units[i].owner not in owners and self.kinds[i] != "turn":
                    continue
                found.append((score, i))
            for r, (_, i) in enumerate(sorted(found, key=lambda x: (-x[0], x[1]))):
                graph_rs[i] = 1.0 / (1 + r)
                channels[i].append("graph")

        merged = set(baseline) | set(graph_rs)
        if not merged:
            return []
        pos = {i: int(self.positions[i]) for i in merged}
        lo, hi = min(pos.values()), max(pos.values())
        hits = []
        for i in merged:
            recency = (pos[i] - lo) / (hi - lo) if hi > lo else 0.0
            score = (plan.w_baseline * baseline.get(i, 0.0) + plan.w_graph * graph_rs.get(i, 0.0)
                     + plan.w_recency * recency + (plan.fact_bonus if i in fact_backed else 0.0))
            hits.append(Hit(self.units[i], score, channels[i]))
        hits.sort(key=lambda h: (-h.score, h.unit.position, h.unit.unit_id))
        return hits[:k]


class AdaMemRetriever:
    """Route-planned hybrid retrieval for many queries at once, one bundle per user (built once)."""

    def __init__(self, bundles: dict[str, UserBundle], embedder):
        self.bundles, self.embedder = bundles, embedder

    def retrieve_routed(self, requests: Sequence[tuple[str, str, int, RoutePlan, str]], k: int) -> list[list[Hit]]:
        """(user_id, text, as_of, plan, target) per query -> hits; each user's texts embedded in one call of
        its own (``index.per_user_encode.encode_per_user``: a user's hits never depend on the other users' queries)."""
        vecs = encode_per_user(self.embedder, [(r[0], r[1]) for r in requests])
        out = []
        for user_id, text, as_of, plan, target in requests:
            bundle = self.bundles.get(user_id)
            if bundle is None:
                raise KeyError(f"no AdaMem bundle for user {user_id!r} (materialize memories and memory_graph)")
            out.append(bundle.retrieve(text, vecs[(user_id, text)], as_of, plan, k, target))
        return out
