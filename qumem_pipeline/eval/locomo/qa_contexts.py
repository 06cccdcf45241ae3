"""The questions and every strategy's answer-step context (turns, memories, Z_q, AdaMem notes), built per conversation."""

import json
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from qumem_pipeline.eval.locomo.qa_prompt import QUMEM_K


@dataclass
class QAQuestion:
    key: str  # "<sample_id>#<index in the file's qa list>", stable across runs of the same file
    sample_id: str
    category: int | None
    question: str
    gold: str | None


def load_questions(path: str, *, conversations: Sequence[str] | None = None, max_sessions: int | None = None,
                   limit_conversations: int | None = None):
    """(conversations, questions, info) through the harness's loaders (same slicing, same users)."""
    from qumem_pipeline.eval.locomo.data import load_dataset

    data = load_dataset(path, conversations=conversations, max_sessions=max_sessions,
                        limit_conversations=limit_conversations)
    convs, qa_all, qa_stats, slice_info, load_info = (data.conversations, data.qa, data.qa_stats, data.slice_info,
                                                       data.load_info)
    keep = {c.sample_id for c in convs}
    seen: dict[str, int] = defaultdict(int)
    questions = []
    for q in qa_all:
        i = seen[q["sample_id"]]
        seen[q["sample_id"]] += 1
        if q["sample_id"] in keep:
            questions.append(QAQuestion(f"{q['sample_id']}#{i}", q["sample_id"], q["category"], q["question"], q["answer"]))
    return convs, questions, {"slice": slice_info, "load": load_info,
                              "qa_loader": {k: v for k, v in qa_stats.as_dict().items() if k != "skipped"}}


def sample_questions(questions: Sequence[QAQuestion], per_category: int | None, seed: int = 0) -> list[QAQuestion]:
    """N per category (seeded, independent of the order categories appear), kept in file order."""
    if per_category is None:
        return list(questions)
    rng = random.Random(seed)
    by_cat: dict = defaultdict(list)
    for q in questions:
        by_cat[q.category].append(q.key)
    chosen = set()
    for cat in sorted(by_cat, key=lambda c: (c is None, c)):
        keys = by_cat[cat]
        chosen.update(rng.sample(keys, min(per_category, len(keys))))
    return [q for q in questions if q.key in chosen]


def _date(ts) -> str:
    return f"{ts.day} {ts:%B %Y}" if ts is not None else "unknown date"


class ConversationContext:
    """One conversation's turns, memories, vectors and strategy state, built once, used by every strategy."""

    def __init__(self, conv, embedder, memories: pl.DataFrame | None, episodes: pl.DataFrame | None = None) -> None:
        self.conv = conv
        self.emb = embedder
        t = conv.turns
        self.turn_index = t["turn_index"].to_list()
        self.ts = t["timestamp"].to_list()
        self.sessions = t["session_id"].to_list()
        self.lines = [f"{sp}: {tx}" if sp else tx for sp, tx in zip(t["speaker"].to_list(), t["text"].to_list())]
        self.as_of = int(max(self.turn_index))
        self.episodes = episodes
        self._turn_vecs = None
        self.memories = self._memories(memories) if memories is not None else None
        self._mem_vecs = None
        self._qumem = None
        self._adamem = None

    def _memories(self, memories: pl.DataFrame) -> pl.DataFrame | None:
        """Both speakers' memories on the primary user's turn indices, content prefixed with the owner's name
        (the decomposer writes 'The user ...', which is ambiguous in a two-person conversation)."""
        conv = self.conv
        to_primary = {d: t for t, d in conv.dia_by_user_turn[conv.user_id].items()}
        owner_name = {}
        for u, g in (conv.turns_by_user or {}).items():
            # the name of the user's first turn: a history whose user speaks under several names (PersonaMem's
            # "Patient" and "User") gets one, the same every run (an unordered unique() picked one by chance)
            names = g.sort("turn_index").filter(pl.col("role") == "user")["speaker"].unique(maintain_order=True).to_list()
            owner_name[u] = names[0] if names else u
        ts_of = dict(zip(self.turn_index, self.ts))
        rows = []
        for r in memories.filter(pl.col("user_id").is_in(conv.user_ids)).iter_rows(named=True):
            dias = conv.dia_by_user_turn.get(r["user_id"], {})
            ev = sorted({to_primary[dias[t]] for t in (r["evidence_turn_ids"] or []) if t in dias and dias[t] in to_primary})
            if not ev:
                continue
            rows.append({"memory_id": r["memory_id"], "user_id": conv.user_id, "type": r["type"],
                         "content": f"({owner_name.get(r['user_id'], r['user_id'])}) {r['content']}",
                         "episode_id": None, "evidence_turn_ids": ev, "position": ev[-1], "valid_from": ts_of.get(ev[-1])})
        if not rows:
            return None
        return pl.DataFrame(rows, schema_overrides={"evidence_turn_ids": pl.List(pl.Int64), "episode_id": pl.String,
                                                    "valid_from": pl.Datetime("us", "UTC")}).unique(
            "memory_id", keep="first", maintain_order=True)

    def unit_dates(self) -> dict:
        """Session timestamp of every unit a state can cite: memories (their last evidence turn) and turns."""
        out = {f"turn:{t}": ts for t, ts in zip(self.turn_index, self.ts)}
        if self.memories is not None:
            out.update(zip(self.memories["memory_id"].to_list(), self.memories["valid_from"].to_list()))
        return out

    # -- contexts (text shown to the answer step)
    def full_history(self) -> str:
        out = ["Conversation, session by session; each session starts with its date."]
        prev = None
        n = 0
        for s, ts, line in zip(self.sessions, self.ts, self.lines):
            if s != prev:
                n += 1
                out.append(f"\nSession {n} ({_date(ts)}):")
                prev = s
            out.append(line)
        return "\n".join(out)

    def turn_vecs(self) -> np.ndarray:
        if self._turn_vecs is None:
            self._turn_vecs = self.emb.encode(self.lines)
        return self._turn_vecs

    def memory_sources(self) -> dict[str, list[str]]:
        """memory_id -> its evidence turns' texts, as the product's embeddings asset builds them."""
        from qumem_pipeline.index.memory_keys import source_texts

        return source_texts(self.memories, self.conv.turns)

    def mem_vecs(self) -> np.ndarray:
        """Memory keys as the product's index builds them (``index.memory_keys``: text and source turns)."""
        if self._mem_vecs is None:
            from qumem_pipeline.index.memory_keys import keys_for

            self._mem_vecs = keys_for(self.memories, self.memory_sources(), self.emb)
        return self._mem_vecs

    @staticmethod
    def _fill(order, words: Sequence[int], budget: int) -> list[int]:
        """Units taken whole in rank order while they fit the word budget (one too long is passed over)."""
        picked, spent = [], 0
        for j in order:
            if spent + words[j] <= budget:
                picked.append(int(j))
                spent += words[j]
            if spent >= budget:
                break
        return picked

    def topk_turns(self, qvecs: np.ndarray, budget: int) -> list[tuple[str, int]]:
        words = [len(x.split()) for x in self.lines]
        out = []
        for row in qvecs @ self.turn_vecs().T:
            picked = sorted(self._fill(np.argsort(-row, kind="stable"), words, budget))
            lines = ["Relevant parts of the conversation (in order, with dates):"]
            for j in picked:
                lines.append(f"[{_date(self.ts[j])}] {self.lines[j]}")
            out.append(("\n".join(lines), sum(words[j] for j in picked)))
        return out

    def topk_memories(self, qvecs: np.ndarray, budget: int) -> list[tuple[str, int]]:
        contents = self.memories["content"].to_list()
        pos = self.memories["position"].to_list()
        when = self.memories["valid_from"].to_list()
        words = [len(c.split()) for c in contents]
        out = []
        for row in qvecs @ self.mem_vecs().T:
            picked = sorted(self._fill(np.argsort(-row, kind="stable"), words, budget), key=lambda j: (pos[j], j))
            lines = ["Memories about the two speakers (in order, with dates):"]
            lines += [f"[{_date(when[j])}] {contents[j]}" for j in picked]
            out.append(("\n".join(lines), sum(words[j] for j in picked)))
        return out

    def queries(self, questions: Sequence[QAQuestion]):
        from qumem_pipeline.query.strategies.base import Query

        return [Query(q.key, self.conv.user_id, q.question, self.as_of) for q in questions]

    def _typed_retriever(self):
        """The typed memory stores (FAISS per type) over this conversation's memories, built once."""
        from qumem_pipeline.index.embeddings import embed_memories
        from qumem_pipeline.index.vector_store import VectorStore, build_user_indexes, normalize_type
        from qumem_pipeline.query.retrieval import TypedMemoryRetriever

        if self._qumem is None:
            mems = self.memories.with_columns(
                pl.Series("type", [normalize_type(t) for t in self.memories["type"].to_list()], dtype=pl.String))
            store = VectorStore.in_memory([build_user_indexes(
                embed_memories(mems, self.emb, sources=self.memory_sources()), self.conv.user_id)])
            self._qumem = TypedMemoryRetriever(store, self.emb, mems)
        return self._qumem

    def _adamem_retriever(self):
        """AdaMem's bundle (turns, memories, graph from the episodes or the sessions), built once."""
        from qumem_pipeline.eval.locomo.adamem_units import session_episodes
        from qumem_pipeline.query.strategies.adamem.retriever import AdaMemRetriever, UserBundle

        if self._adamem is None:
            mems = self.memories if self.memories is not None else pl.DataFrame(schema={
                "memory_id": pl.String, "user_id": pl.String, "type": pl.String, "content": pl.String,
                "episode_id": pl.String, "evidence_turn_ids": pl.List(pl.Int64), "position": pl.Int64,
                "valid_from": pl.Datetime("us", "UTC")})
            turns = self.conv.turns
            eps = self.episodes if self.episodes is not None and self.episodes.height else session_episodes(turns)
            bundle = UserBundle.build(self.conv.user_id, turns, mems, self.emb, episodes=eps)
            self._adamem = AdaMemRetriever({self.conv.user_id: bundle}, self.emb)
        return self._adamem

    def qumem_states(self, questions: Sequence[QAQuestion], llm) -> list["StateRow | None"]:
        """Z_q per question (A1 -> A2 -> typed retrieval -> A3), None where A3 gave nothing usable."""
        from qumem_pipeline.query.strategies.registry import infer_user_states

        out = infer_user_states(self.queries(questions), llm, self._typed_retriever(), strategy="qumem", k=QUMEM_K)
        return _state_rows(out.states, questions)

    def hybrid_states(self, questions: Sequence[QAQuestion], llm) -> list["StateRow | None"]:
        """Z_q per question by ``qumem_hybrid``: qumem's plans over the typed stores plus AdaMem's
        hybrid retrieval of the question itself, A3 on both."""
        from qumem_pipeline.query.strategies.hybrid import HybridRetriever
        from qumem_pipeline.query.strategies.registry import infer_user_states

        retriever = HybridRetriever(self._typed_retriever(), self._adamem_retriever())
        out = infer_user_states(self.queries(questions), llm, retriever, strategy="qumem_hybrid", k=QUMEM_K)
        return _state_rows(out.states, questions)

    def adamem_states(self, questions: Sequence[QAQuestion], llm) -> list["StateRow | None"]:
        from qumem_pipeline.query.strategies.adamem.retriever import DEFAULT_K
        from qumem_pipeline.query.strategies.adamem.strategy import infer_adamem_states

        out = infer_adamem_states(self.queries(questions), llm, self._adamem_retriever(), k=DEFAULT_K)
        return _state_rows(out.states, questions)

    def evidence_turns(self) -> dict[str, list[str]]:
        """memory_id -> the unit ids ("turn:<t>") of the turns it rests on."""
        if self.memories is None:
            return {}
        return {m: [f"turn:{t}" for t in (ev or [])] for m, ev in
                zip(self.memories["memory_id"].to_list(), self.memories["evidence_turn_ids"].to_list())}

    def unit_texts(self) -> dict:
        """Text of every unit a state can cite: memories (owner-prefixed content) and turns ("Name: text")."""
        out = {f"turn:{t}": line for t, line in zip(self.turn_index, self.lines)}
        if self.memories is not None:
            out.update(zip(self.memories["memory_id"].to_list(), self.memories["content"].to_list()))
        return out


@dataclass
class StateRow:
    """What a state strategy returned for one question: Z_q, the units it cites, and the candidates its
    retrieval found (best score first)."""

    state: dict | None
    cited: list[str]
    candidates: list[str]


def _state_rows(states: pl.DataFrame, questions: Sequence[QAQuestion]) -> list[StateRow | None]:
    by_id = {}
    for r in states.iter_rows(named=True):
        cands = sorted(r["candidates"] or [], key=lambda c: (-(c["score"] or 0.0), c["memory_id"]))
        by_id[r["query_id"]] = StateRow(json.loads(r["state"]) if r["state"] else None,
                                        list(r["cited_memory_ids"] or []), [c["memory_id"] for c in cands])
    return [by_id.get(q.key) for q in questions]


def render_grounded(row: "StateRow | None", texts: dict, dates: dict | None, budget: int) -> str:
    """Z_q grounded in its evidence, within the same word budget as the top-k contexts.

    Why: the paper's relevant facts F_q are memories *selected* by the state agent; a 1.5B model's
    one-line restatement of a memory drops or garbles the detail a question asks for ("what did she
    paint?", measured: qumem F1 0.269 with restated facts first vs topk_memories 0.382 on the same
    memories), so a fact is shown as the memories it cites, verbatim and dated (its statement only
    where no citation resolves). The preference trajectory and insights, which are inferences, stay
    as the state wrote them. The rest of the budget goes to the other retrieved candidates, best
    score first, each whole."""
    if row is None or row.state is None:
        return render_state(None)
    state = row.state

    def dated(uid: str) -> str:
        return f"[{_date(dates.get(uid)) if dates else 'unknown date'}] {texts[uid]}"

    seen: set[str] = set()
    facts: list[str] = []
    for f in state.get("facts") or []:
        cited = [u for u in f.get("memory_ids") or [] if u in texts and u not in seen]
        if not cited and not any(u in seen for u in f.get("memory_ids") or []):
            facts.append(f"- {f.get('statement', '')}{_cited_dates(f, dates)}")
        for u in cited:
            seen.add(u)
            facts.append(f"- {dated(u)}")
    head = [STATE_HEADER]
    if facts:
        head += ["Relevant facts (the memories the state selected, with dates):", *facts]
    head += _inferred_lines(state, dates)
    if len(head) == 1:
        head.append("- (nothing relevant found)")
    spent = sum(len(x.split()) for x in head)
    lines = [dated(u) for u in dict.fromkeys([*row.cited, *row.candidates]) if u in texts and u not in seen]
    more = [lines[j] for j in ConversationContext._fill(range(len(lines)), [len(x.split()) for x in lines],
                                                         budget - spent)]
    if more:
        head += ["Other evidence retrieved for this question (with dates):", *more]
    return "\n".join(head)


EVIDENCE_RENDER = ("evidence render v1: the state's inferences, then the turns its cited memories rest on, "
                   "then those of the other retrieved memories, whole, in conversation order, within the budget")


def render_with_evidence(row: "StateRow | None", texts: dict, dates: dict | None, budget: int,
                         evidence: dict[str, list[str]]) -> str:
    """Z_q with its evidence: the state's preference trajectory and insights (its inferences), then the
    conversation turns its cited memories rest on, then those of the other retrieved memories (best
    score first), each turn whole and shown once, in conversation order, within the word budget.

    Why: on LoCoMo the state's answers trailed top-k over turns most on single-hop questions (F1 0.297
    against 0.418, table ``locomo_qa_qwen15b_dev5``), where the detail asked for is in a turn and a
    1.5B model's memory of it drops it; the memories chose *which* turns matter, the turns keep what
    was said."""
    if row is None or row.state is None:
        return render_state(None)
    head = [STATE_HEADER, *_inferred_lines(row.state, dates)]
    spent = sum(len(x.split()) for x in head)
    turns: list[str] = []
    for u in dict.fromkeys([*row.cited, *row.candidates]):
        turns += [t for t in evidence.get(u, ()) if t in texts and t not in turns]
    words = [len(texts[t].split()) for t in turns]
    picked = ConversationContext._fill(range(len(turns)), words, budget - spent)
    order = sorted(picked, key=lambda j: int(turns[j].split(":", 1)[1]))
    if order:
        head += ["Evidence: the conversation turns the retrieved memories rest on (in order, with dates):",
                 *(f"[{_date(dates.get(turns[j])) if dates else 'unknown date'}] {texts[turns[j]]}" for j in order)]
    elif len(head) == 1:
        head.append("- (nothing relevant found)")
    return "\n".join(head)


TURNS_RENDER = ("turns render v1: the state's preference trajectory and insights, then the question's top-k turns "
                "in conversation order, dated, within the word budget of topk_turns")


def render_with_turns(row: "StateRow | None", dates: dict | None, turns_text: str) -> str:
    """The state's inferences (preference trajectory, insights) in front of the question's own top-k turns.

    Why: on PersonaMem's test half AdaMem's state alone trailed top-k over turns most on the latest
    preferences (9 of 20 right against 14, table ``personamem_qwen15b_ctx1_test``): a state that kept an
    earlier preference as the current one hid the order in which the user said things, which the turns
    keep. The turns get topk_turns' whole budget (the comparison then measures what the state adds), the
    state's facts are left out (the turns say them in the user's words)."""
    head = [STATE_HEADER, *(_inferred_lines(row.state, dates) if row is not None and row.state is not None else [])]
    if len(head) == 1:
        head.append("- (none inferred)")
    return "\n".join([*head, turns_text])


def _cited_dates(item: dict, dates: dict | None) -> str:
    """' [stated 7 May 2023]' (or a range) from the dates of the units an item cites, '' without any."""
    got = sorted({dates[m] for m in item.get("memory_ids") or [] if dates and dates.get(m) is not None})
    if not got:
        return ""
    span = _date(got[0]) if len(got) == 1 or _date(got[0]) == _date(got[-1]) else f"{_date(got[0])} to {_date(got[-1])}"
    return f" [stated {span}]"


STATE_HEADER = "Inferred state of the conversation's speakers, relevant to the question:"


def _inferred_lines(state: dict, dates: dict | None) -> list[str]:
    """The state's preference trajectory and insights (its inferences), one line each, dated."""
    lines = []
    for p in state.get("preference_trajectory") or []:
        lines.append(f"- preference ({p.get('aspect', '')}): earlier {p.get('earlier', '')}; now {p.get('current', '')}"
                     f" ({p.get('applies_now_because', '')}){_cited_dates(p, dates)}")
    for i in state.get("insights") or []:
        lines.append(f"- insight: {i.get('insight', '')}{_cited_dates(i, dates)}")
    return lines


def render_state(state: dict | None, dates: dict | None = None) -> str:
    """Z_q (or AdaMem's research notes) as the answer step's context. Citations are ids, so they are
    left out, but the dates of what each item cites (``dates``: unit id -> session timestamp) are shown:
    a statement like "lost his job yesterday" is answerable only with the day it was said."""
    if state is None:
        return "Inferred state: (none: the state inference gave no usable output)"
    lines = [STATE_HEADER]
    lines += [f"- fact: {f.get('statement', '')}{_cited_dates(f, dates)}" for f in state.get("facts") or []]
    lines += _inferred_lines(state, dates)
    if len(lines) == 1:
        lines.append("- (nothing relevant found)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ token window


class TokenCounter:
    """Prompt tokens by the served model's own tokenizer and chat template when it is a local directory,
    else an over-estimate (characters / 3), so nothing that does not fit is sent."""

    def __init__(self, model: str | None) -> None:
        self.tok = None
        self.method = "chars/3 estimate"
        self.window = None
        p = Path(model) if model else None
        if p is not None and p.is_dir():
            try:
                cfg = json.loads((p / "config.json").read_text())
                self.window = int(cfg.get("max_position_embeddings") or 0) or None
            except (OSError, ValueError):
                pass
            if (p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists():
                from transformers import AutoTokenizer

                self.tok = AutoTokenizer.from_pretrained(str(p))
                self.method = f"tokenizer of {p.name}"

    def count(self, messages: list[dict]) -> int:
        if self.tok is not None:
            try:
                ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                return len(ids["input_ids"] if isinstance(ids, dict) else ids)
            except (ValueError, TypeError):
                text = "\n".join(m["content"] for m in messages)
                return len(self.tok(text)["input_ids"]) + 8 * len(messages)
        return sum(len(m["content"]) for m in messages) // 3 + 8 * len(messages)


def _contexts(s: str, cx: ConversationContext, part: list[QAQuestion], llm, words: int, emb):
    """(context text, row metadata) per question for strategy ``s``."""
    if s == "none":
        return ["Context: (none)"] * len(part), [{"context_words": 0} for _ in part]
    if s == "full_history":
        text = cx.full_history()
        return [text] * len(part), [{"context_words": len(text.split())} for _ in part]
    if s in ("topk_turns", "topk_memories"):
        qv = emb.encode([q.question for q in part])
        got = cx.topk_turns(qv, words) if s == "topk_turns" else cx.topk_memories(qv, words)
        return [g[0] for g in got], [{"context_words": g[1]} for g in got]
    states = {"qumem": cx.qumem_states, "qumem_hybrid": cx.hybrid_states, "adamem": cx.adamem_states,
              "qumem_evidence": cx.qumem_states, "adamem_turns": cx.adamem_states}[s]
    rows = states(part, llm)
    dates = cx.unit_dates()
    if s == "adamem_turns":  # AdaMem's calls (replayed where adamem made them), then the question's top-k turns
        turns = cx.topk_turns(emb.encode([q.question for q in part]), words)
        texts = [render_with_turns(r, dates, t[0]) for r, t in zip(rows, turns)]
    elif s == "qumem_evidence":  # texts and evidence built once for the chunk, not per question
        units, evidence = cx.unit_texts(), cx.evidence_turns()
        texts = [render_with_evidence(r, units, dates, words, evidence) for r in rows]
    else:
        units = cx.unit_texts()
        texts = [render_grounded(r, units, dates, words) for r in rows]
    return texts, [{"context_words": len(t.split()), "state_ok": r is not None and r.state is not None}
                   for t, r in zip(texts, rows)]
