"""LoCoMo answer quality: every question answered by the configured LLM, strategies side by side.

``qumem eval locomo PATH --qa [...]``. The retrieval harness measures evidence recall; this measures
what the papers report: the answer, scored by token F1 and BLEU-1 (``qa_metrics``: LoCoMo's own
normalisation and per-category F1 rule; category 5, adversarial, apart as LoCoMo's abstention rule).

Strategies, all with the same model and the same answer prompt (``ANSWER_SYSTEM`` / ``answer_prompt``,
LoCoMo's short-phrase QA prompt plus one line saying how to abstain), differing only in the context:

- ``none``: no context at all - the floor (what the model guesses from the question alone);
- ``full_history``: the whole conversation, session by session with dates, when the prompt fits the
  context window (``--context-tokens``, default the model's ``max_position_embeddings``); questions
  whose prompt does not fit are skipped and counted. The conversation comes first and the question
  last, so the server's prefix cache computes the history once per conversation (the first question
  of a conversation is sent alone to fill the cache);
- ``topk_turns``: turns ranked by MiniLM similarity to the question, taken whole while they fit a
  word budget (``--words``, default 512), shown in conversation order with their session dates;
- ``topk_memories``: the same over the typed memories (both speakers', each shown with its owner's
  name and the date of its last evidence turn);
- ``qumem``: the product's query-conditioned user state - A1 (needs) -> A2 (plan) -> typed retrieval
  (in-memory per-type FAISS store, as ``qumem_units``) -> A3 (Z_q) -> the answer step Psi, which is
  this module's answer prompt over the rendered Z_q;
- ``adamem``: route plan -> hybrid retrieval over turns and memories -> research loop -> the answer
  step over the final research notes (the same answer prompt; AdaMem's own working answer is not used).

Memories come from ``--memories`` (a memories table) or ``--decompose`` (the pipeline's decomposition
of every speaker's episodes, written per user to ``--memories-out``, default next to ``--out``; users
already there are not decomposed again). Without either, the memory strategies are skipped with the
reason (``adamem`` then runs over turns only).

Bounded and resumable: ``--sample-per-category N`` draws N questions per category (seeded); every
answered question is appended to a checkpoint (``<out>.checkpoint.jsonl``) as soon as its chunk is
back, and a rerun answers only the rest. Every LLM call (decomposition, A1/A2/A3, research, answers)
goes to the ledger (``<out>.ledger.jsonl``, the pipeline's ``llm_ledger`` columns plus the request
fingerprint, strategy and output); a finished call found there is replayed, never paid for twice.
Output: a table, the JSON report (``qa.<strategy>.f1`` / ``.bleu1``, per category), and a
self-contained HTML report (``qa_report``) at ``<out>.html``.
"""

import argparse
import hashlib
import json
import os
import random
import shlex
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import polars as pl

from qumem_pipeline.contracts.versions import CODE_VERSION
from qumem_pipeline.eval.locomo.qa_metrics import score_answer
from qumem_pipeline.llm.base import BackendBase, ChatRequest, ChatResult

QA_STRATEGIES = ("none", "full_history", "topk_turns", "topk_memories", "qumem", "adamem")
MEMORY_STRATEGIES = ("topk_memories", "qumem")
HEADLINE = (1, 2, 3, 4)
DEFAULT_WORDS = 512
DEFAULT_CHUNK = 32
DEFAULT_CONTEXT_TOKENS = 8192  # when the model's own window is unknown
ANSWER_MAX_TOKENS = 64
QUMEM_K = 5
ABSTAIN_ANSWER = "Not mentioned in the conversation"

ANSWER_SYSTEM = (
    "You answer questions about a long conversation between two people, using only the context given "
    "with the question. Answer with JSON only."
)
# LoCoMo's QA prompt (snap-research/locomo task_eval/evaluate_gpts.py, QA_PROMPT), plus how to abstain.
ANSWER_INSTRUCTION = (
    "Based on the above context, write an answer in the form of a short phrase for the following question. "
    "Answer with exact words from the context whenever possible. Where lines carry the date they were said, "
    "resolve relative dates such as 'yesterday' or 'last week' against it. "
    f"Answer \"{ABSTAIN_ANSWER}\" only when the context says nothing about the question."
)
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 200}},
                 "required": ["answer"], "additionalProperties": False}
# How contexts are rendered is part of what an answer depends on, so it is in the version (a checkpoint
# row answered from an older rendering is answered again; the ledger still replays identical calls).
CONTEXT_FORMAT = "v2: state items carry the dates of what they cite; candidates and turns carry session dates"
ANSWER_PROMPT_VERSION = "locomo-qa-v2-" + hashlib.sha256(
    json.dumps([ANSWER_SYSTEM, ANSWER_INSTRUCTION, ANSWER_SCHEMA, ANSWER_MAX_TOKENS, CONTEXT_FORMAT],
               sort_keys=True).encode()).hexdigest()[:10]


def answer_messages(context: str, question: str) -> list[dict]:
    """Context first, question last: a long shared context stays a cacheable prefix."""
    return [{"role": "system", "content": ANSWER_SYSTEM},
            {"role": "user", "content": f"{context}\n\n{ANSWER_INSTRUCTION}\n\nQuestion: {question}\n"
                                        'Return {"answer": "..."}.'}]


# ------------------------------------------------------------------------------------ JSONL logs


class JsonlLog:
    """Append-only JSON lines, fsynced per batch; a torn last line (a killed writer) is cut on open."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.torn = 0
        if self.path.exists():
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                with open(self.path, "r+b") as f:
                    f.truncate(keep)
                self.torn = 1

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append(json.loads(line))
        return out

    def append(self, rows: Sequence[dict]) -> None:
        if not rows:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def request_fingerprint(model: str, req: ChatRequest) -> str:
    blob = json.dumps([model, req.messages, req.json_schema, req.decoding_schema, req.max_tokens], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class LedgerBackend(BackendBase):
    """Wraps the run's backend: every call it sends is a ledger row; a call whose fingerprint already has
    a good answer in the ledger is replayed from it (a resumed run pays for no finished call twice)."""

    def __init__(self, inner, ledger_path: str | os.PathLike) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.backend_name = inner.backend_name
        self.log = JsonlLog(ledger_path)
        self.tags: dict = {}
        self.sent = self.replayed = 0
        self._done: dict[str, dict] = {}
        self._attempts: dict[str, int] = defaultdict(int)
        for row in self.log.rows():
            self._attempts[row["fingerprint"]] += 1
            if row["status"] == "ok" and row.get("model") == self.model_name:
                self._done[row["fingerprint"]] = row

    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        out: list[ChatResult | None] = [None] * len(requests)
        fps = [request_fingerprint(self.model_name, r) for r in requests]
        todo = []
        for i, (req, fp) in enumerate(zip(requests, fps)):
            row = self._done.get(fp)
            if row is None:
                todo.append(i)
                continue
            self.replayed += 1
            out[i] = ChatResult(req.request_id, json.loads(row["parsed"]), row["raw_text"], None, row["prompt_tokens"],
                                row["completion_tokens"], row["cached_tokens"], 0.0, 0, row["finish_reason"])
        if todo:
            results = self.inner.generate([requests[i] for i in todo])
            now = datetime.now(timezone.utc).isoformat()
            rows = []
            for i, res in zip(todo, results):
                req, fp = requests[i], fps[i]
                self._attempts[fp] += 1
                row = {
                    "request_id": req.request_id, "user_id": (req.metadata or {}).get("user_id"), "episode_id":
                    (req.metadata or {}).get("episode_id"), "type": req.schema_name, "attempt": self._attempts[fp],
                    "status": "ok" if res.ok else "error", "prompt_tokens": res.prompt_tokens,
                    "completion_tokens": res.completion_tokens, "cached_tokens": res.cached_tokens,
                    "latency_s": round(res.latency_s, 3), "transport_attempts": res.attempts,
                    "backend": self.backend_name, "model": self.model_name, "prompt_version": self.tags.get("prompt_version"),
                    "created_at": now, "strategy": self.tags.get("strategy"), "fingerprint": fp,
                    "max_tokens": req.max_tokens, "finish_reason": res.finish_reason, "error": res.error,
                    "raw_text": res.raw_text, "parsed": json.dumps(res.parsed) if res.parsed is not None else None,
                }
                rows.append(row)
                if res.ok:
                    self._done[fp] = row
                out[i] = res
            self.sent += len(todo)
            self.log.append(rows)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.inner.close()


def generate_with_retry(llm, reqs: list[ChatRequest]) -> list[ChatResult]:
    """One retry for unusable output (as the decomposer and the query stage do)."""
    results = llm.generate(reqs) if reqs else []
    bad = [i for i, r in enumerate(results) if not r.ok]
    if bad:
        for i, r in zip(bad, llm.generate([reqs[i] for i in bad])):
            r.prompt_tokens += results[i].prompt_tokens
            r.completion_tokens += results[i].completion_tokens
            results[i] = r
    return results


# ------------------------------------------------------------------------------------ data


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
            names = g.filter(pl.col("role") == "user")["speaker"].unique().to_list()
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

    def mem_vecs(self) -> np.ndarray:
        if self._mem_vecs is None:
            self._mem_vecs = self.emb.encode(self.memories["content"].to_list())
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

    def qumem_states(self, questions: Sequence[QAQuestion], llm) -> list[dict | None]:
        """Z_q per question (A1 -> A2 -> typed retrieval -> A3), None where A3 gave nothing usable."""
        from qumem_pipeline.index.embeddings import embed_memories
        from qumem_pipeline.index.vector_store import VectorStore, build_user_indexes, normalize_type
        from qumem_pipeline.query.retrieval import TypedMemoryRetriever
        from qumem_pipeline.query.strategies.registry import infer_user_states

        if self._qumem is None:
            mems = self.memories.with_columns(
                pl.Series("type", [normalize_type(t) for t in self.memories["type"].to_list()], dtype=pl.String))
            store = VectorStore.in_memory([build_user_indexes(embed_memories(mems, self.emb), self.conv.user_id)])
            self._qumem = TypedMemoryRetriever(store, self.emb, mems)
        out = infer_user_states(self.queries(questions), llm, self._qumem, strategy="qumem", k=QUMEM_K)
        by_id = {r["query_id"]: json.loads(r["state"]) for r in out.states.iter_rows(named=True)}
        return [by_id.get(q.key) for q in questions]

    def adamem_states(self, questions: Sequence[QAQuestion], llm) -> list[dict | None]:
        from qumem_pipeline.eval.locomo.adamem_units import session_episodes
        from qumem_pipeline.query.strategies.adamem.retriever import DEFAULT_K, UserBundle
        from qumem_pipeline.query.strategies.adamem.retriever import AdaMemRetriever
        from qumem_pipeline.query.strategies.adamem.strategy import infer_adamem_states

        if self._adamem is None:
            mems = self.memories if self.memories is not None else pl.DataFrame(schema={
                "memory_id": pl.String, "user_id": pl.String, "type": pl.String, "content": pl.String,
                "episode_id": pl.String, "evidence_turn_ids": pl.List(pl.Int64), "position": pl.Int64,
                "valid_from": pl.Datetime("us", "UTC")})
            turns = self.conv.turns
            eps = self.episodes if self.episodes is not None and self.episodes.height else session_episodes(turns)
            bundle = UserBundle.build(self.conv.user_id, turns, mems, self.emb, episodes=eps)
            self._adamem = AdaMemRetriever({self.conv.user_id: bundle}, self.emb)
        out = infer_adamem_states(self.queries(questions), llm, self._adamem, k=DEFAULT_K)
        by_id = {r["query_id"]: json.loads(r["state"]) for r in out.states.iter_rows(named=True)}
        return [by_id.get(q.key) for q in questions]


def _cited_dates(item: dict, dates: dict | None) -> str:
    """' [stated 7 May 2023]' (or a range) from the dates of the units an item cites, '' without any."""
    got = sorted({dates[m] for m in item.get("memory_ids") or [] if dates and dates.get(m) is not None})
    if not got:
        return ""
    span = _date(got[0]) if len(got) == 1 or _date(got[0]) == _date(got[-1]) else f"{_date(got[0])} to {_date(got[-1])}"
    return f" [stated {span}]"


def render_state(state: dict | None, dates: dict | None = None) -> str:
    """Z_q (or AdaMem's research notes) as the answer step's context. Citations are ids, so they are
    left out, but the dates of what each item cites (``dates``: unit id -> session timestamp) are shown:
    a statement like "lost his job yesterday" is answerable only with the day it was said."""
    if state is None:
        return "Inferred state: (none: the state inference gave no usable output)"
    lines = ["Inferred state of the conversation's speakers, relevant to the question:"]
    for f in state.get("facts") or []:
        lines.append(f"- fact: {f.get('statement', '')}{_cited_dates(f, dates)}")
    for p in state.get("preference_trajectory") or []:
        lines.append(f"- preference ({p.get('aspect', '')}): earlier {p.get('earlier', '')}; now {p.get('current', '')}"
                     f" ({p.get('applies_now_because', '')}){_cited_dates(p, dates)}")
    for i in state.get("insights") or []:
        lines.append(f"- insight: {i.get('insight', '')}{_cited_dates(i, dates)}")
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


# ------------------------------------------------------------------------------------ run


def make_backend(llm_kind: str | None):
    """The run's backend from $QUMEM_LLM_KIND / _BASE_URL / _MODEL (vllm-managed also reads
    $QUMEM_VLLM_MAX_MODEL_LEN and $QUMEM_VLLM_EXTRA_ARGS); generous request timeouts (a long prompt
    on a CPU engine with many requests in flight takes minutes, and a retry would restart it)."""
    from qumem_pipeline.llm.factory import make_backend as factory

    kind = (llm_kind or os.environ.get("QUMEM_LLM_KIND", "local")).strip().lower()
    timeout = float(os.environ.get("QUMEM_LLM_TIMEOUT_S", "1800"))
    if kind == "openai":
        return factory(kind, base_url=os.environ["QUMEM_LLM_BASE_URL"], model=os.environ.get("QUMEM_LLM_MODEL") or None,
                       timeout_s=timeout)
    if kind in ("vllm-managed", "vllm"):
        cfg: dict = {"model": os.environ["QUMEM_LLM_MODEL"], "timeout_s": timeout}
        if os.environ.get("QUMEM_VLLM_MAX_MODEL_LEN"):
            cfg["max_model_len"] = int(os.environ["QUMEM_VLLM_MAX_MODEL_LEN"])
        if os.environ.get("QUMEM_VLLM_EXTRA_ARGS"):  # e.g. "--enforce-eager" (skips minutes of compile on CPU)
            cfg["extra_args"] = shlex.split(os.environ["QUMEM_VLLM_EXTRA_ARGS"])
        return factory(kind, **cfg)
    return factory(kind)


def _paths(out: str | os.PathLike) -> dict[str, Path]:
    out = Path(out)
    stem = out.with_suffix("") if out.suffix == ".json" else out
    return {"report": out if out.suffix == ".json" else out.with_suffix(".json"),
            "checkpoint": stem.with_name(stem.name + ".checkpoint.jsonl"),
            "ledger": stem.with_name(stem.name + ".ledger.jsonl"),
            "html": stem.with_name(stem.name + ".html"),
            "memories": stem.with_name(stem.name + ".memories")}


def _existing_memory_users(root: Path) -> set[str]:
    """Users whose memories table is already written under `root` (the pipeline's table store)."""
    from qumem_pipeline.storage.layout import DataLayout

    if not (root / "memories").is_dir():
        return set()
    return set(DataLayout(root).users_in("memories"))


def run_qa(
    path: str,
    *,
    out: str | os.PathLike,
    strategies: Sequence[str] = QA_STRATEGIES,
    sample_per_category: int | None = None,
    seed: int = 0,
    words: int = DEFAULT_WORDS,
    context_tokens: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    memories: str | os.PathLike | None = None,
    decompose: bool = False,
    memories_out: str | os.PathLike | None = None,
    llm_backend=None,
    llm_kind: str | None = None,
    llm_max_tokens: int = 384,
    conversations: Sequence[str] | None = None,
    max_sessions: int | None = None,
    limit_conversations: int | None = None,
    continuity_artifact: str | None = None,
    device=None,
    embedder=None,
    retrieval_report: dict | None = None,
    log=None,
) -> dict:
    """Answer, score, checkpoint; the JSON report (also written to ``out``) and the HTML next to it."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    strategies = list(dict.fromkeys(strategies))
    bad = set(strategies) - set(QA_STRATEGIES)
    if bad:
        raise ValueError(f"unknown QA strategies {sorted(bad)}; expected {QA_STRATEGIES}")
    if decompose and memories is not None:
        raise ValueError("give either a memories table or --decompose, not both")
    paths = _paths(out)
    paths["report"].parent.mkdir(parents=True, exist_ok=True)
    convs, all_questions, load_info = load_questions(path, conversations=conversations, max_sessions=max_sessions,
                                                     limit_conversations=limit_conversations)
    selected = sample_questions(all_questions, sample_per_category, seed)
    log(f"[qa] {len(convs)} conversations, {len(all_questions)} questions, {len(selected)} selected "
        f"({'all' if sample_per_category is None else f'{sample_per_category} per category, seed {seed}'})")

    ckpt = JsonlLog(paths["checkpoint"])
    if ckpt.torn:
        log(f"[qa] checkpoint {paths['checkpoint']}: cut a torn last line (interrupted write)")
    done: dict[tuple[str, str], dict] = {}
    stale = 0
    for r in ckpt.rows():
        if r.get("answer_prompt_version") == ANSWER_PROMPT_VERSION:
            done[(r["strategy"], r["key"])] = r
        else:
            stale += 1
    skipped: dict = {}
    if stale:
        skipped["checkpoint_rows_other_prompt_version"] = stale

    llm_holder: list = []

    def llm() -> LedgerBackend:
        if not llm_holder:
            inner = llm_backend or make_backend(llm_kind)
            llm_holder.append(LedgerBackend(inner, paths["ledger"]))
        return llm_holder[0]

    decompose_info = None
    try:
        def todo_of(s: str) -> list[QAQuestion]:
            return [q for q in selected if (s, q.key) not in done]

        # ---- memories (only when a memory strategy still has questions to answer)
        mem_df = None
        episodes_by_user = None
        want_mem = any(todo_of(s) for s in strategies if s in MEMORY_STRATEGIES or s == "adamem")
        if want_mem and (memories is not None or decompose):
            from qumem_pipeline.eval.locomo.data import read_memories
            from qumem_pipeline.eval.locomo.sources import build_episodes, decompose_memories

            if decompose:
                mroot = Path(memories_out) if memories_out else paths["memories"]
                need_users = [u for c in convs for u in c.user_ids]
                missing = [u for u in need_users if u not in _existing_memory_users(mroot)]
                episodes_by_user, clf_version = build_episodes(convs, continuity_artifact, device, all_users=True)
                if missing:
                    te = time.perf_counter()
                    llm().tags = {"strategy": "decompose"}
                    decompose_memories(convs, {u: e for u, e in episodes_by_user.items() if u in missing}, llm(), mroot,
                                       llm_max_tokens, log)
                    decompose_info = {"users_decomposed": missing, "memories_out": str(mroot),
                                      "seconds_with_backend_start": round(time.perf_counter() - te, 1),
                                      "continuity_classifier": clf_version}
                    log(f"[qa] decomposed {len(missing)} users in {time.perf_counter() - te:.0f}s -> {mroot}")
                else:
                    decompose_info = {"users_decomposed": [], "memories_out": str(mroot), "reused": need_users}
                    log(f"[qa] memories of all {len(need_users)} users already in {mroot}; not decomposed again")
                memories = mroot
            try:
                mem_df = read_memories(memories)
            except (FileNotFoundError, ValueError, OSError) as e:
                skipped["memories"] = f"memories table unreadable: {e}"
        for s in strategies:
            if s in MEMORY_STRATEGIES and mem_df is None and todo_of(s):
                skipped[f"strategy_{s}"] = skipped.get("memories") or (
                    "needs typed memories: give --memories PARQUET_DIR or --decompose")
        if "adamem" in strategies and mem_df is None and todo_of("adamem"):
            skipped["adamem_without_memories"] = "no memories: adamem retrieved over turns only"
        run = [s for s in strategies if f"strategy_{s}" not in skipped]

        # ---- answering
        total = sum(len(selected) for _ in run)
        n_done = sum(1 for s in run for q in selected if (s, q.key) in done)
        log(f"[qa] strategies {run}: {n_done}/{total} already answered (checkpoint {paths['checkpoint']})")
        emb = None
        counter = None
        window = None
        window_skips: dict[str, int] = defaultdict(int)
        answered_now = 0
        t_answer = None
        conv_by_id = {c.sample_id: c for c in convs}
        ctx_cache: dict[str, ConversationContext] = {}

        def ctx_of(sample_id: str) -> ConversationContext:
            nonlocal emb
            if sample_id not in ctx_cache:
                if emb is None:
                    from qumem_pipeline.index.embeddings import Embedder

                    emb = embedder or Embedder.load(device=device)
                conv = conv_by_id[sample_id]
                eps = (episodes_by_user or {}).get(conv.user_id)
                ctx_cache[sample_id] = ConversationContext(conv, emb, mem_df, eps)
            return ctx_cache[sample_id]

        for s in run:
            by_conv: dict[str, list[QAQuestion]] = defaultdict(list)
            for q in todo_of(s):
                by_conv[q.sample_id].append(q)
            for sample_id, qs in by_conv.items():
                cx = ctx_of(sample_id)
                if s in MEMORY_STRATEGIES and cx.memories is None:
                    skipped[f"strategy_{s}_{sample_id}"] = "no memories of this conversation's users"
                    continue
                if s == "full_history" and counter is None:
                    counter = TokenCounter(os.environ.get("QUMEM_LLM_MODEL"))
                    served = os.environ.get("QUMEM_VLLM_MAX_MODEL_LEN") if llm_backend is None else None
                    window = context_tokens or (int(served) if served else None) or counter.window or DEFAULT_CONTEXT_TOKENS
                for start in range(0, len(qs), chunk):
                    part = qs[start : start + chunk]
                    if t_answer is None:
                        t_answer = time.perf_counter()
                    backend = llm()
                    backend.tags = {"strategy": s, "prompt_version": ANSWER_PROMPT_VERSION}
                    contexts, meta = _contexts(s, cx, part, backend, words, emb)
                    reqs, keep = [], []
                    for q, c, m in zip(part, contexts, meta):
                        msgs = answer_messages(c, q.question)
                        if s == "full_history":
                            m["prompt_tokens_counted"] = counter.count(msgs)
                            if m["prompt_tokens_counted"] + ANSWER_MAX_TOKENS > window:
                                window_skips[sample_id] += 1
                                continue
                        reqs.append(ChatRequest(f"{s}/{q.key}/answer", msgs, ANSWER_SCHEMA, ANSWER_MAX_TOKENS, "qa_answer",
                                                metadata={"user_id": cx.conv.user_id}))
                        keep.append((q, m))
                    backend.tags = {"strategy": s, "prompt_version": ANSWER_PROMPT_VERSION}
                    if s == "full_history" and reqs and start == 0:
                        results = generate_with_retry(backend, reqs[:1]) + generate_with_retry(backend, reqs[1:])
                    else:
                        results = generate_with_retry(backend, reqs)
                    rows = []
                    for (q, m), r in zip(keep, results):
                        pred = (r.parsed or {}).get("answer") if r.ok else None
                        rows.append({"strategy": s, "key": q.key, "sample_id": q.sample_id, "category": q.category,
                                     "question": q.question, "gold": q.gold, "prediction": pred,
                                     "error": None if r.ok else r.error, **score_answer(pred, q.gold, q.category), **m,
                                     "answer_prompt_tokens": r.prompt_tokens, "answer_completion_tokens": r.completion_tokens,
                                     "model": backend.model_name, "answer_prompt_version": ANSWER_PROMPT_VERSION,
                                     "code_version": CODE_VERSION, "created_at": datetime.now(timezone.utc).isoformat()})
                    ckpt.append(rows)
                    for row in rows:
                        done[(s, row["key"])] = row
                    answered_now += len(rows)
                    n_done += len(rows) + (len(part) - len(keep))
                    el = time.perf_counter() - t_answer
                    rate = answered_now / el if el > 0 else 0.0
                    eta = (total - n_done) / rate if rate > 0 else float("nan")
                    log(f"[qa] {s} {sample_id}: {n_done}/{total} done, {rate * 60:.1f} questions/min, "
                        f"ETA {eta / 60:.1f} min (LLM calls sent {backend.sent}, replayed {backend.replayed})")
        if window_skips:
            skipped["full_history_over_context_window"] = {"questions": sum(window_skips.values()),
                                                           "by_conversation": dict(window_skips),
                                                           "window_tokens": window, "counted_by": counter.method}
    finally:
        for b in llm_holder:
            b.close()

    report = build_report(selected, run, done, skipped, strategies)
    ledger_rows = JsonlLog(paths["ledger"]).rows() if paths["ledger"].exists() else []
    report.update({
        "dataset": str(path), **load_info, "n_conversations": len(convs), "seed": seed, "decomposition": decompose_info,
        "sample_per_category": sample_per_category, "words_budget": words,
        "model": llm_holder[0].model_name if llm_holder else (next(iter(done.values()))["model"] if done else None),
        "answer_prompt_version": ANSWER_PROMPT_VERSION, "memories": str(memories) if memories is not None else None,
        "checkpoint": str(paths["checkpoint"]), "ledger": str(paths["ledger"]), "html": str(paths["html"]),
        "llm_calls": {"sent_this_run": llm_holder[0].sent if llm_holder else 0,
                      "replayed_this_run": llm_holder[0].replayed if llm_holder else 0,
                      "ledger_rows": len(ledger_rows),
                      "ledger_by_strategy": _ledger_totals(ledger_rows)},
        "wall_s": round(time.perf_counter() - t0, 1),
    })
    from qumem_pipeline.eval.locomo.qa_report import write_html

    write_html(report, paths["html"], retrieval_report)
    tmp = paths["report"].with_name(".tmp-" + paths["report"].name)
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, paths["report"])
    return report


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
    states = cx.qumem_states(part, llm) if s == "qumem" else cx.adamem_states(part, llm)
    texts = [render_state(st, cx.unit_dates()) for st in states]
    return texts, [{"context_words": len(t.split()), "state_ok": st is not None} for t, st in zip(texts, states)]


def _ledger_totals(rows: list[dict]) -> dict:
    out: dict = defaultdict(lambda: {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "errors": 0})
    for r in rows:
        t = out[r.get("strategy") or "?"]
        t["calls"] += 1
        t["prompt_tokens"] += int(r.get("prompt_tokens") or 0)
        t["completion_tokens"] += int(r.get("completion_tokens") or 0)
        t["errors"] += r.get("status") != "ok"
    return dict(out)


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(float(np.mean(xs)), 4) if xs else None


def build_report(selected: Sequence[QAQuestion], run: Sequence[str], done: dict, skipped: dict,
                 requested: Sequence[str]) -> dict:
    """``qa.<strategy>``: f1 / bleu1 over categories 1-4, per category, and category 5 apart."""
    from qumem_pipeline.ingest.importers.locomo import CATEGORY_NAMES

    by_cat: dict = defaultdict(int)
    for q in selected:
        by_cat[q.category] += 1
    qa: dict = {}
    for s in run:
        rows = [done[(s, q.key)] for q in selected if (s, q.key) in done]
        head = [r for r in rows if r["category"] in HEADLINE]
        adv = [r for r in rows if r["category"] == 5]
        per_cat = {}
        for c in HEADLINE:
            rc = [r for r in head if r["category"] == c]
            if rc:
                per_cat[str(c)] = {"name": CATEGORY_NAMES.get(c), "n": len(rc), "f1": _mean(r["f1"] for r in rc),
                                   "bleu1": _mean(r["bleu1"] for r in rc)}
        if adv:
            per_cat["5"] = {"name": CATEGORY_NAMES.get(5), "n": len(adv), "abstain": _mean(r["abstain"] for r in adv)}
        qa[s] = {
            "f1": _mean(r["f1"] for r in head), "bleu1": _mean(r["bleu1"] for r in head), "n": len(head),
            "per_category": per_cat,
            "adversarial": {"n": len(adv), "abstain": _mean(r["abstain"] for r in adv)},
            "no_answer": sum(1 for r in rows if r["prediction"] is None),
            "state_failed": sum(1 for r in rows if r.get("state_ok") is False),
            "not_answered": len(selected) - len(rows),
            "mean_context_words": _mean(r.get("context_words") for r in rows),
            "answer_prompt_tokens": sum(int(r.get("answer_prompt_tokens") or 0) for r in rows),
            "answer_completion_tokens": sum(int(r.get("answer_completion_tokens") or 0) for r in rows),
        }
    return {
        "qa": qa,
        "strategies": list(run),
        "strategies_requested": list(requested),
        "n_questions": sum(v for c, v in by_cat.items() if c in HEADLINE),
        "n_questions_adversarial": by_cat.get(5, 0),
        "questions_by_category": {str(c): n for c, n in sorted(by_cat.items(), key=lambda x: (x[0] is None, x[0]))},
        "scoring": ("token F1 and BLEU-1 over categories 1-4 (LoCoMo normalisation and per-category F1 rule, "
                    "see qa_metrics); category 5: share of answers that abstain (LoCoMo's rule)"),
        "skipped": skipped,
    }


def format_table(report: dict) -> str:
    cats = ["1", "2", "3", "4"]
    lines = [f"LoCoMo QA ({report.get('dataset')}, {report['n_questions']} questions cat 1-4 + "
             f"{report['n_questions_adversarial']} cat 5; model {report.get('model')}; topk budget "
             f"{report.get('words_budget')} words)",
             f"  {'strategy':<14}{'F1':>7}{'BLEU-1':>8}" + "".join(f"{'F1 c' + c:>8}" for c in cats)
             + f"{'c5 abst':>9}{'n':>5}{'ctx words':>10}"]

    def f(v) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    for s, v in report["qa"].items():
        pc = v["per_category"]
        lines.append(f"  {s:<14}{f(v['f1']):>7}{f(v['bleu1']):>8}"
                     + "".join(f"{f(pc.get(c, {}).get('f1')):>8}" for c in cats)
                     + f"{f(v['adversarial']['abstain']):>9}{v['n'] + v['adversarial']['n']:>5}"
                     + f"{(v['mean_context_words'] or 0):>10.0f}")
    lines.append(f"skipped: {json.dumps(report['skipped'])}")
    lines.append(f"LLM calls: {json.dumps(report.get('llm_calls', {}).get('ledger_by_strategy', {}))}")
    lines.append(f"report: {report.get('html')}; checkpoint: {report.get('checkpoint')}; wall time {report.get('wall_s')}s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="qumem eval locomo PATH --qa", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a LoCoMo-format JSON file")
    ap.add_argument("--out", default=None, help="JSON report path; checkpoint, ledger and HTML go next to it "
                    "(default .artifacts/locomo_qa/<file stem>.qa.json)")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object on the last line")
    ap.add_argument("--strategies", default=",".join(QA_STRATEGIES), help=f"comma list of {QA_STRATEGIES}")
    ap.add_argument("--sample-per-category", type=int, default=None, help="answer N questions per category (seeded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--words", type=int, default=DEFAULT_WORDS, help="word budget of the top-k strategies' context")
    ap.add_argument("--context-tokens", type=int, default=None,
                    help="context window for full_history (default: the model's max_position_embeddings, else 8192)")
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="questions per LLM batch (and checkpoint write)")
    ap.add_argument("--memories", default=None, help="memories Parquet table (file, table dir or data root)")
    ap.add_argument("--decompose", action="store_true", help="build the memories with the configured LLM")
    ap.add_argument("--memories-out", default=None, help="with --decompose: data root for the memories "
                    "(default next to --out; users already there are reused)")
    ap.add_argument("--llm-kind", default=None, help="local | openai | vllm-managed (default $QUMEM_LLM_KIND or local)")
    ap.add_argument("--llm-max-tokens", type=int, default=384, help="max completion tokens per decomposition call")
    ap.add_argument("--conversations", default=None, help="comma list of sample_ids to keep")
    ap.add_argument("--max-sessions", type=int, default=None)
    ap.add_argument("--limit-conversations", type=int, default=None)
    ap.add_argument("--continuity-artifact", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--retrieval-json", default=None,
                    help="a retrieval harness JSON report: its recall-vs-budget curves go into the HTML report")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out = args.out or str(Path(".artifacts") / "locomo_qa" / f"{Path(args.path).stem}.qa.json")
    report = run_qa(
        args.path, out=out, strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
        sample_per_category=args.sample_per_category, seed=args.seed, words=args.words,
        context_tokens=args.context_tokens, chunk=args.chunk, memories=args.memories, decompose=args.decompose,
        memories_out=args.memories_out, llm_kind=args.llm_kind, llm_max_tokens=args.llm_max_tokens,
        conversations=[c.strip() for c in args.conversations.split(",") if c.strip()] if args.conversations else None,
        max_sessions=args.max_sessions, limit_conversations=args.limit_conversations,
        continuity_artifact=args.continuity_artifact, device=args.device,
        retrieval_report=json.loads(Path(args.retrieval_json).read_text()) if args.retrieval_json else None,
    )
    print(format_table(report))
    if args.json:
        print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
