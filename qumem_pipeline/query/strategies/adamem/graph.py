"""The per-user memory graph (AdaMem's graph memory), built from the tables the pipeline already has.

Nodes: turns, episodes, memories, topics, entities, persona-profile entries. Typed edges:

- ``supports``        memory -> each evidence turn (fact hits reactivate their discourse turns);
- ``in-episode``      turn / memory -> its episode;
- ``same-topic``      episode / turn / memory -> topic keyword (items sharing a topic meet there);
- ``mentions-entity`` turn / memory -> entity (a capitalised name);
- ``next-episode``    episode -> the following episode;
- ``summarises``      profile entry -> each memory it cites.

Every node carries ``position``: the earliest turn at which it exists (turns: their index; memories:
their position; episodes: their last turn; topics/entities: their first linked item; profile entries:
their latest cited memory). Expansion never visits a node after the query's as_of, so the graph
cannot leak future evidence. Topics are deterministic: per episode, the words with the highest
tf-idf among words shared with at least one other episode (and not with most of them).
"""

import math
from collections import Counter, defaultdict

import polars as pl

from qumem_pipeline.query.strategies.adamem.participants import OTHER, USER, turn_owner
from qumem_pipeline.query.strategies.adamem.text import entities, tokens
from qumem_pipeline.query.version import stage_version

EDGE_TYPES = ("supports", "in-episode", "same-topic", "mentions-entity", "next-episode", "summarises")
NODE_TYPES = ("turn", "episode", "memory", "topic", "entity", "profile")
TOPICS_PER_EPISODE = 3
MAX_TOPIC_SHARE = 0.3  # a word in more than this share of episodes is background, not a topic

NODE_SCHEMA = pl.Schema({"user_id": pl.String, "node_id": pl.String, "node_type": pl.String, "ref": pl.String,
                         "text": pl.String, "position": pl.Int64, "owner": pl.String})
EDGE_SCHEMA = pl.Schema({"user_id": pl.String, "src": pl.String, "dst": pl.String, "edge_type": pl.String})


def turn_node(i: int) -> str:
    return f"turn:{i}"


def memory_node(mid: str) -> str:
    return f"memory:{mid}"


def episode_topics(episodes: pl.DataFrame, turn_text: dict[int, str]) -> dict[str, list[str]]:
    """episode_id -> its topic words (see the module docstring)."""
    bags = {eid: Counter(w for t in tids for w in tokens(turn_text.get(t)))
            for eid, tids in zip(episodes["episode_id"].to_list(), episodes["turn_ids"].to_list())}
    n = len(bags)
    df = Counter(w for bag in bags.values() for w in bag)
    out = {}
    for eid, bag in bags.items():
        scored = [(-c * math.log(n / df[w]), w) for w, c in bag.items() if 2 <= df[w] <= max(2, MAX_TOPIC_SHARE * n)]
        out[eid] = [w for _, w in sorted(scored)[:TOPICS_PER_EPISODE]]
    return out


class _GraphBuilder:
    """Nodes and edges of one user's graph, added table by table (turns first: the others link to them)."""

    def __init__(self, user_id: str):
        self.user_id = user_id
        self.nodes: dict[str, dict] = {}
        self.edges: set[tuple[str, str, str]] = set()
        self.linked: dict[str, list[int]] = defaultdict(list)  # topic/entity node -> positions of linked items
        self.turn_text: dict[int, str] = {}
        self.ep_topics: dict[str, list[str]] = {}

    def node(self, nid, ntype, ref, text, position, owner=None) -> None:
        self.nodes[nid] = {"user_id": self.user_id, "node_id": nid, "node_type": ntype, "ref": str(ref), "text": text,
                           "position": position, "owner": owner}

    def hub(self, kind: str, key: str, src: str, etype: str, position: int) -> None:
        nid = f"{kind}:{key}"
        if nid not in self.nodes:
            self.node(nid, kind, key, key, None)
        self.linked[nid].append(position)
        self.edges.add((src, nid, etype))

    def add_turns(self, turns: pl.DataFrame) -> None:
        self.turn_text = dict(zip(turns["turn_index"].to_list(), turns["text"].to_list()))
        for ti, role, text in zip(turns["turn_index"].to_list(), turns["role"].to_list(), turns["text"].to_list()):
            self.node(turn_node(ti), "turn", ti, text, ti, turn_owner(role))
            for e in entities(text):
                self.hub("entity", e, turn_node(ti), "mentions-entity", ti)

    def add_episodes(self, episodes: pl.DataFrame) -> None:
        topics = episode_topics(episodes, self.turn_text) if episodes.height else {}
        self.ep_topics = {f"episode:{e}": ws for e, ws in topics.items()}
        ordered = episodes.sort("episode_index")
        prev = None
        for eid, tids, last in zip(ordered["episode_id"].to_list(), ordered["turn_ids"].to_list(),
                                   ordered["last_turn_index"].to_list()):
            en = f"episode:{eid}"
            self.node(en, "episode", eid, " ".join(topics.get(eid, [])), last)
            if prev:
                self.edges.add((prev, en, "next-episode"))
            prev = en
            for t in tids:
                if turn_node(t) not in self.nodes:
                    raise ValueError(f"episodes row {eid!r}: turn {t} is not in the turns table")
                self.edges.add((turn_node(t), en, "in-episode"))
                words = set(tokens(self.turn_text[t]))
                for w in topics.get(eid, []):
                    if w in words:
                        self.hub("topic", w, turn_node(t), "same-topic", t)
            for w in topics.get(eid, []):
                self.hub("topic", w, en, "same-topic", last)

    def add_memories(self, memories: pl.DataFrame) -> None:
        for row in memories.iter_rows(named=True):
            mn = memory_node(row["memory_id"])
            ev = list(row["evidence_turn_ids"] or [])
            roles = Counter(self.nodes[turn_node(t)]["owner"] for t in ev if turn_node(t) in self.nodes)
            owner = USER if roles.get(USER, 0) >= roles.get(OTHER, 0) else OTHER
            self.node(mn, "memory", row["memory_id"], row["content"], row["position"], owner)
            for t in ev:
                if turn_node(t) not in self.nodes:
                    raise ValueError(f"memories row {row['memory_id']!r}: evidence turn {t} is not in the turns table")
                self.edges.add((mn, turn_node(t), "supports"))
            en = f"episode:{row['episode_id']}"
            if en in self.nodes:
                self.edges.add((mn, en, "in-episode"))
            words = set(tokens(row["content"]))
            for w in self.ep_topics.get(en, []):
                if w in words:
                    self.hub("topic", w, mn, "same-topic", row["position"])
            for e in entities(row["content"]):
                self.hub("entity", e, mn, "mentions-entity", row["position"])

    def add_profiles(self, profiles: pl.DataFrame) -> None:
        for row in profiles.iter_rows(named=True):
            cited = [memory_node(m) for m in row["memory_ids"] or []]
            missing = [c for c in cited if c not in self.nodes]
            if missing:
                raise ValueError(f"persona_profiles row {row['profile_id']!r}: cites unknown memories {missing[:3]}")
            pn = f"profile:{row['profile_id']}"
            self.node(pn, "profile", row["profile_id"], f"{row['aspect']}: {row['summary']}",
                      max((self.nodes[c]["position"] for c in cited), default=None), USER)
            for c in cited:
                self.edges.add((pn, c, "summarises"))

    def frames(self) -> tuple[pl.DataFrame, pl.DataFrame]:
        """A hub's position is the earliest item linked to it: it is not reachable before that."""
        for nid, pos in self.linked.items():
            self.nodes[nid]["position"] = min(pos)
        node_df = pl.DataFrame(list(self.nodes.values()), schema=NODE_SCHEMA).sort("node_id")
        edge_df = pl.DataFrame([{"user_id": self.user_id, "src": s, "dst": d, "edge_type": t}
                                for s, d, t in sorted(self.edges)], schema=EDGE_SCHEMA)
        version = pl.lit(stage_version("memory_graph"), pl.String)  # which code built the graph, on every row
        return node_df.with_columns(code_version=version), edge_df.with_columns(code_version=version)


def build_memory_graph(user_id: str, turns: pl.DataFrame, episodes: pl.DataFrame, memories: pl.DataFrame,
                       profiles: pl.DataFrame | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(nodes, edges) for one user. Raises ValueError naming the row when an input references nothing."""
    g = _GraphBuilder(user_id)
    g.add_turns(turns)
    g.add_episodes(episodes)
    g.add_memories(memories)
    if profiles is not None:
        g.add_profiles(profiles)
    return g.frames()


def dangling_edges(nodes: pl.DataFrame, edges: pl.DataFrame) -> pl.DataFrame:
    """Edges whose source or destination is not a node of the same user (should be none)."""
    keys = nodes.select("user_id", "node_id")
    src_ok = edges.join(keys, left_on=["user_id", "src"], right_on=["user_id", "node_id"], how="anti")
    dst_ok = edges.join(keys, left_on=["user_id", "dst"], right_on=["user_id", "node_id"], how="anti")
    return pl.concat([src_ok, dst_ok]).unique()


class MemoryGraph:
    """Adjacency over one user's graph for bounded expansion (edges traversed both ways)."""

    def __init__(self, nodes: pl.DataFrame, edges: pl.DataFrame):
        self.nodes = {r["node_id"]: r for r in nodes.iter_rows(named=True)}
        self.adj: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for s, d, t in zip(edges["src"].to_list(), edges["dst"].to_list(), edges["edge_type"].to_list()):
            self.adj[s].append((d, t))
            self.adj[d].append((s, t))

    def visible(self, node_id: str, as_of: int | None) -> bool:
        n = self.nodes.get(node_id)
        return n is not None and (as_of is None or n["position"] is None or n["position"] <= as_of)

    def expand(self, seeds: dict[str, float], hops: int, priors: dict[str, float], decay: float,
               as_of: int | None, max_nodes: int = 200) -> dict[str, tuple[float, int]]:
        """Bounded multi-hop propagation: score(v) = max over paths of seed * prod(prior(edge) * decay).

        Returns node_id -> (score, hop) for nodes reached within ``hops`` (seeds at hop 0), never a
        node after as_of, at most ``max_nodes`` nodes. Edge types without a prior are not followed.
        """
        best: dict[str, tuple[float, int]] = {s: (sc, 0) for s, sc in seeds.items() if self.visible(s, as_of)}
        frontier = dict((s, v[0]) for s, v in best.items())
        for hop in range(1, hops + 1):
            nxt: dict[str, float] = {}
            for u, su in sorted(frontier.items(), key=lambda kv: -kv[1]):
                for v, t in self.adj.get(u, ()):
                    p = priors.get(t, 0.0)
                    if p <= 0 or not self.visible(v, as_of):
                        continue
                    sv = su * p * decay
                    if sv > max(best.get(v, (0.0, 0))[0], nxt.get(v, 0.0)):
                        nxt[v] = sv
            for v, sv in sorted(nxt.items(), key=lambda kv: -kv[1]):
                if len(best) >= max_nodes and v not in best:
                    break
                best[v] = (sv, hop)
            frontier = {v: sv for v, sv in nxt.items() if v in best}
            if not frontier:
                break
        return best
