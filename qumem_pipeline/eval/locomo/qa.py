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
  step over the final research notes (the same answer prompt; AdaMem's own working answer is not used);
- ``qumem_hybrid``: qumem's A1/A2 plans over the typed stores added to AdaMem's hybrid retrieval of the
  question itself, qumem's A3 on the union, then the answer step as for ``qumem``.

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
import json
import os
import shlex
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from qumem_pipeline.contracts.versions import CODE_VERSION
from qumem_pipeline.eval.locomo.qa_metrics import score_answer
from qumem_pipeline.index.memory_keys import SOURCE_WEIGHT
from qumem_pipeline.llm.base import ChatRequest
from qumem_pipeline.llm.retry import generate_with_retry
from qumem_pipeline.query.strategies.state_labels import STATE_LABEL_MODES, raw_state_labels, state_label_mode
# Re-exported: tests, the harness and benches import these from here.
from qumem_pipeline.eval.locomo.qa_contexts import (  # noqa: F401
    ConversationContext,
    QAQuestion,
    TokenCounter,
    _cited_dates,
    _contexts,
    _date,
    load_questions,
    render_state,
    sample_questions,
)
from qumem_pipeline.eval.locomo.qa_ledger import JsonlLog, LedgerBackend, request_fingerprint  # noqa: F401
from qumem_pipeline.eval.locomo.qa_prompt import (  # noqa: F401
    ABSTAIN_ANSWER,
    ANSWER_INSTRUCTION,
    ANSWER_MAX_TOKENS,
    ANSWER_PROMPT_VERSION,
    ANSWER_SCHEMA,
    ANSWER_SYSTEM,
    CONTEXT_FORMAT,
    DEFAULT_CHUNK,
    DEFAULT_CONTEXT_TOKENS,
    DEFAULT_WORDS,
    HEADLINE,
    ADAMEM_STRATEGIES,
    MEMORY_STRATEGIES,
    QA_STRATEGIES,
    STATE_STRATEGIES,
    QUMEM_K,
    answer_messages,
)
from qumem_pipeline.eval.locomo.qa_summary import _ledger_totals, _mean, build_report, format_table  # noqa: F401


def make_backend(llm_kind: str | None):
    """The run's backend from $QUMEM_LLM_KIND / _BASE_URL / _MODEL / _COMPACT_JSON (vllm-managed also reads
    $QUMEM_VLLM_MAX_MODEL_LEN and $QUMEM_VLLM_EXTRA_ARGS); generous request timeouts (a long prompt
    on a CPU engine with many requests in flight takes minutes, and a retry would restart it)."""
    from qumem_pipeline.llm.factory import make_backend as factory

    kind = (llm_kind or os.environ.get("QUMEM_LLM_KIND", "local")).strip().lower()
    timeout = float(os.environ.get("QUMEM_LLM_TIMEOUT_S", "1800"))
    if kind == "openai":
        # QUMEM_LLM_COMPACT_JSON=0 for a server started without compact JSON (the evaluation model's vLLM
        # server is): the request then asks what that server does, and the record keys its calls the same
        extra = ({"compact_json": os.environ["QUMEM_LLM_COMPACT_JSON"].strip().lower() not in ("0", "false", "no")}
                 if os.environ.get("QUMEM_LLM_COMPACT_JSON") else {})
        return factory(kind, base_url=os.environ["QUMEM_LLM_BASE_URL"], model=os.environ.get("QUMEM_LLM_MODEL") or None,
                       timeout_s=timeout, **extra)
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
    record=None,
    replay_only: bool = False,
    replay_model: str | None = None,
    question_keys: Sequence[str] | None = None,
    cover: bool = False,
    episodes_version: str | None = None,
) -> dict:
    """Answer, score, checkpoint; the JSON report (also written to ``out``) and the HTML next to it.

    ``record`` (an ``eval.record.EvalRecord`` or its path): every call is answered from it when it holds
    the call, else sent and added to it; the run's manifest and the memories it decomposed go there too.
    ``replay_only``: no model at all - every call from the record, in a fresh work directory (no
    checkpoint, ledger or memories of earlier runs are read); calls it lacks are answered with an error
    and listed in ``report['replay']['missing']``. With ``cover`` the report keeps only the questions
    (and conversations) whose every call was in the record, and says which. ``episodes_version``: with
    ``decompose``, the episodes the record holds from that continuity classifier instead of the shipped
    classifier's (a recording run stores the episodes it decomposed, so its calls replay after the
    classifier changes)."""
    from qumem_pipeline.eval.record import EvalRecord

    if record is not None and not isinstance(record, EvalRecord):
        record = EvalRecord(record)
    if replay_only and record is None:
        raise ValueError("--replay-only needs a record (--record PATH, or the default eval_record/)")
    strategies = list(dict.fromkeys(strategies))
    bad = set(strategies) - set(QA_STRATEGIES)
    if bad:
        raise ValueError(f"unknown QA strategies {sorted(bad)}; expected {QA_STRATEGIES}")
    if decompose and memories is not None:
        raise ValueError("give either a memories table or --decompose, not both")
    qa = _QARun(path, out=out, record=record, replay_only=replay_only, replay_model=replay_model,
                llm_backend=llm_backend, llm_kind=llm_kind, log=log, device=device, embedder=embedder)
    try:
        qa.select(sample_per_category, seed, conversations, max_sessions, limit_conversations, question_keys)
        qa.prepare_memories(strategies, memories, decompose, memories_out, continuity_artifact, episodes_version,
                            llm_max_tokens)
        run = qa.runnable(strategies)
        try:
            qa.answer(run, words, chunk, context_tokens)
        except KeyboardInterrupt:  # e.g. a recording run stopped at its deadline: what it answered still counts
            qa.skipped["interrupted"] = ("stopped by SIGINT or SIGTERM while answering: the report and the record hold the "
                                         "questions answered before; a rerun answers the rest")
            qa.log("[qa] interrupted: reporting and recording what was answered")
    finally:
        qa.close()  # before the report: the record's part of it counts what the backend flushed on close
    settings = {"max_sessions": max_sessions, "words": words, "chunk": chunk, "context_tokens": context_tokens,
                "llm_max_tokens": llm_max_tokens, "decompose": bool(decompose), "state_labels": state_label_mode(),
                "memories": None if decompose or memories is None else str(memories)}
    return qa.report(run, strategies, settings, cover, sample_per_category, seed, words, retrieval_report)


class _QARun:
    """One `run_qa` call's state: its questions, what the checkpoint already answered, the backend
    (opened on first use), the memories and episodes, and what was skipped and why."""

    def __init__(self, path: str, *, out, record, replay_only: bool, replay_model, llm_backend, llm_kind, log,
                 device, embedder):
        self.path, self.record, self.replay_only, self.replay_model = path, record, replay_only, replay_model
        self.llm_backend, self.llm_kind, self.device, self.embedder = llm_backend, llm_kind, device, embedder
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.t0 = time.perf_counter()
        self.report_out = Path(out) if out is not None else None
        self.work = None
        if replay_only:  # nothing of an earlier run is read: the record is the only source of model output
            import tempfile

            self.work = tempfile.TemporaryDirectory(prefix="qumem-replay-")
            out = Path(self.work.name) / "replay.qa.json"
        self.paths = _paths(out)
        self.paths["report"].parent.mkdir(parents=True, exist_ok=True)
        self._llm: list = []
        self.skipped: dict = {}
        self.mem_df = self.episodes_by_user = self.episodes_used = self.decompose_info = self.memories = None
        self.decompose = False

    # ---- questions and what is answered already
    def select(self, sample_per_category, seed, conversations, max_sessions, limit_conversations, question_keys) -> None:
        self.max_sessions = max_sessions
        self.convs, all_questions, self.load_info = load_questions(
            self.path, conversations=conversations, max_sessions=max_sessions, limit_conversations=limit_conversations)
        selected = sample_questions(all_questions, sample_per_category, seed)
        if question_keys is not None:
            wanted = set(question_keys)
            selected = [q for q in selected if q.key in wanted]
        self.selected = selected
        self.log(f"[qa] {len(self.convs)} conversations, {len(all_questions)} questions, {len(selected)} selected "
                 f"({'all' if sample_per_category is None else f'{sample_per_category} per category, seed {seed}'})")
        self.user_conv = {u: c.sample_id for c in self.convs for u in c.user_ids}
        self.ckpt = JsonlLog(self.paths["checkpoint"])
        if self.ckpt.torn:
            self.log(f"[qa] checkpoint {self.paths['checkpoint']}: cut a torn last line (interrupted write)")
        self.done: dict[tuple[str, str], dict] = {}
        stale = 0
        for r in self.ckpt.rows():
            if (r.get("answer_prompt_version") == ANSWER_PROMPT_VERSION
                    and r.get("strategy_version") == strategy_version(r["strategy"])):
                self.done[(r["strategy"], r["key"])] = r
            else:
                stale += 1
        if stale:
            self.skipped["checkpoint_rows_other_version"] = stale

    def todo(self, strategy: str) -> list[QAQuestion]:
        return [q for q in self.selected if (strategy, q.key) not in self.done]

    def llm(self):
        """The backend, opened on first use: the record alone when replaying, else the configured one
        behind the ledger (and the record, when there is one)."""
        if not self._llm:
            from qumem_pipeline.eval.record import RecordBackend, identity_from_runs

            if self.replay_only:
                ident = identity_from_runs(self.record, self.path, self.replay_model)
                self._llm.append(RecordBackend(None, self.record, ident, self.user_conv))
            else:
                b = LedgerBackend(self.llm_backend or make_backend(self.llm_kind), self.paths["ledger"])
                self._llm.append(RecordBackend(b, self.record, None, self.user_conv) if self.record is not None else b)
        return self._llm[0]

    def close(self) -> None:
        for b in self._llm:
            b.close()

    # ---- memories
    def prepare_memories(self, strategies, memories, decompose, memories_out, continuity_artifact, episodes_version,
                         llm_max_tokens) -> None:
        """The memories table (decomposed now for the users it lacks, with ``decompose``), read only
        when a memory strategy still has questions to answer."""
        self.decompose, self.llm_max_tokens, self.episodes_version = decompose, llm_max_tokens, episodes_version
        if self.replay_only:
            memories_out = None
        want = any(self.todo(s) for s in strategies if s in MEMORY_STRATEGIES or s in ADAMEM_STRATEGIES)
        if want and (memories is not None or decompose):
            from qumem_pipeline.eval.locomo.data import read_memories

            if decompose:
                memories = self._decompose(Path(memories_out) if memories_out else self.paths["memories"],
                                           continuity_artifact, episodes_version, llm_max_tokens)
            try:
                self.mem_df = read_memories(memories)
            except (FileNotFoundError, ValueError, OSError) as e:
                self.skipped["memories"] = f"memories table unreadable: {e}"
        self.memories = memories

    def _decompose(self, mroot: Path, continuity_artifact, episodes_version, llm_max_tokens) -> Path:
        from qumem_pipeline.eval.locomo.sources import build_episodes, decompose_memories

        need_users = [u for c in self.convs for u in c.user_ids]
        missing = [u for u in need_users if u not in _existing_memory_users(mroot)]
        if episodes_version is not None:
            self.episodes_by_user = _recorded_episodes(self.record, self.path, self.convs, episodes_version,
                                                       self.max_sessions)
            clf_version = episodes_version
        else:
            self.episodes_by_user, clf_version = build_episodes(self.convs, continuity_artifact, self.device,
                                                                all_users=True)
        self.episodes_used = clf_version
        if not missing:
            self.decompose_info = {"users_decomposed": [], "memories_out": str(mroot), "reused": need_users}
            self.log(f"[qa] memories of all {len(need_users)} users already in {mroot}; not decomposed again")
            return mroot
        te = time.perf_counter()
        self.llm().tags = {"strategy": "decompose"}
        decompose_memories(self.convs, {u: e for u, e in self.episodes_by_user.items() if u in missing}, self.llm(),
                           mroot, llm_max_tokens, self.log)
        self.decompose_info = {"users_decomposed": missing, "memories_out": str(mroot),
                               "seconds_with_backend_start": round(time.perf_counter() - te, 1),
                               "continuity_classifier": clf_version}
        self.log(f"[qa] decomposed {len(missing)} users in {time.perf_counter() - te:.0f}s -> {mroot}")
        return mroot

    def runnable(self, strategies: list[str]) -> list[str]:
        """The strategies that can run; the others are in `skipped` with the reason."""
        for s in strategies:
            if s in MEMORY_STRATEGIES and self.mem_df is None and self.todo(s):
                self.skipped[f"strategy_{s}"] = self.skipped.get("memories") or (
                    "needs typed memories: give --memories PARQUET_DIR or --decompose")
        if self.mem_df is None and any(s in strategies and self.todo(s) for s in ADAMEM_STRATEGIES):
            self.skipped["adamem_without_memories"] = "no memories: adamem retrieved over turns only"
        return [s for s in strategies if f"strategy_{s}" not in self.skipped]

    # ---- answering
    def answer(self, run: list[str], words: int, chunk: int, context_tokens: int | None) -> None:
        """Every question still to answer, strategy by strategy and conversation by conversation, in
        chunks; each chunk's rows go to the checkpoint as soon as it is back."""
        self.total = sum(len(self.selected) for _ in run)
        self.n_done = sum(1 for s in run for q in self.selected if (s, q.key) in self.done)
        self.log(f"[qa] strategies {run}: {self.n_done}/{self.total} already answered (checkpoint {self.paths['checkpoint']})")
        self.emb, self.counter, self.window = None, None, None
        self.window_skips: dict[str, int] = defaultdict(int)
        self.answered_now, self.t_answer = 0, None
        self.conv_by_id = {c.sample_id: c for c in self.convs}
        self.ctx_cache: dict[str, ConversationContext] = {}
        for s in run:
            by_conv: dict[str, list[QAQuestion]] = defaultdict(list)
            for q in self.todo(s):
                by_conv[q.sample_id].append(q)
            for sample_id, qs in by_conv.items():
                cx = self._context(sample_id)
                if s in MEMORY_STRATEGIES and cx.memories is None:
                    self.skipped[f"strategy_{s}_{sample_id}"] = "no memories of this conversation's users"
                    continue
                if s == "full_history" and self.counter is None:
                    self.counter = TokenCounter(os.environ.get("QUMEM_LLM_MODEL"))
                    served = os.environ.get("QUMEM_VLLM_MAX_MODEL_LEN") if self.llm_backend is None else None
                    self.window = (context_tokens or (int(served) if served else None) or self.counter.window
                                   or DEFAULT_CONTEXT_TOKENS)
                for start in range(0, len(qs), chunk):
                    self._answer_chunk(s, cx, qs[start : start + chunk], start == 0, words)
        if self.window_skips:
            self.skipped["full_history_over_context_window"] = {
                "questions": sum(self.window_skips.values()), "by_conversation": dict(self.window_skips),
                "window_tokens": self.window, "counted_by": self.counter.method}

    def _context(self, sample_id: str) -> ConversationContext:
        if sample_id not in self.ctx_cache:
            if self.emb is None:
                from qumem_pipeline.embedding.minilm import Embedder

                self.emb = self.embedder or Embedder.load(device=self.device)
            conv = self.conv_by_id[sample_id]
            eps = (self.episodes_by_user or {}).get(conv.user_id)
            self.ctx_cache[sample_id] = ConversationContext(conv, self.emb, self.mem_df, eps)
        return self.ctx_cache[sample_id]

    def _answer_chunk(self, s: str, cx: ConversationContext, part: list[QAQuestion], first: bool, words: int) -> None:
        if self.t_answer is None:
            self.t_answer = time.perf_counter()
        backend = self.llm()
        backend.tags = {"strategy": s, "prompt_version": ANSWER_PROMPT_VERSION}
        contexts, meta = _contexts(s, cx, part, backend, words, self.emb)
        reqs, keep = [], []
        for q, c, m in zip(part, contexts, meta):
            msgs = answer_messages(c, q.question)
            if s == "full_history":
                m["prompt_tokens_counted"] = self.counter.count(msgs)
                if m["prompt_tokens_counted"] + ANSWER_MAX_TOKENS > self.window:
                    self.window_skips[cx.conv.sample_id] += 1
                    continue
            reqs.append(ChatRequest(f"{s}/{q.key}/answer", msgs, ANSWER_SCHEMA, ANSWER_MAX_TOKENS, "qa_answer",
                                    metadata={"user_id": cx.conv.user_id}))
            keep.append((q, m))
        backend.tags = {"strategy": s, "prompt_version": ANSWER_PROMPT_VERSION}
        if s == "full_history" and reqs and first:  # the first alone: it fills the server's prefix cache
            results = generate_with_retry(backend, reqs[:1]) + generate_with_retry(backend, reqs[1:])
        else:
            results = generate_with_retry(backend, reqs)
        rows = [self._row(s, q, m, r, backend) for (q, m), r in zip(keep, results)]
        self.ckpt.append(rows)
        for row in rows:
            self.done[(s, row["key"])] = row
        self.answered_now += len(rows)
        self.n_done += len(rows) + (len(part) - len(keep))
        el = time.perf_counter() - self.t_answer
        rate = self.answered_now / el if el > 0 else 0.0
        eta = (self.total - self.n_done) / rate if rate > 0 else float("nan")
        self.log(f"[qa] {s} {cx.conv.sample_id}: {self.n_done}/{self.total} done, {rate * 60:.1f} questions/min, "
                 f"ETA {eta / 60:.1f} min (LLM calls sent {backend.sent}, replayed {backend.replayed})")

    @staticmethod
    def _row(s: str, q: QAQuestion, m: dict, r, backend) -> dict:
        pred = (r.parsed or {}).get("answer") if r.ok else None
        return {"strategy": s, "key": q.key, "sample_id": q.sample_id, "category": q.category,
                "question": q.question, "gold": q.gold, "prediction": pred,
                "error": None if r.ok else r.error, **score_answer(pred, q.gold, q.category), **m,
                "answer_prompt_tokens": r.prompt_tokens, "answer_completion_tokens": r.completion_tokens,
                "model": backend.model_name, "answer_prompt_version": ANSWER_PROMPT_VERSION,
                "strategy_version": strategy_version(s), "code_version": CODE_VERSION,
                "created_at": datetime.now(timezone.utc).isoformat()}

    # ---- the report
    def report(self, run, strategies, settings: dict, cover: bool, sample_per_category, seed, words,
               retrieval_report) -> dict:
        """The JSON report (written to `out`, the HTML beside it; when replaying only to `out`, if a
        .json path): scores, what was skipped, the record's part, the ledger's totals."""
        selected, convs, backend = self.selected, self.convs, (self._llm[0] if self._llm else None)
        memories = self.memories if self.decompose else None
        replay_info = None
        if self.replay_only:
            replay_info, selected, _ = _replay_summary(backend, selected, convs, cover, self.record, self.path,
                                                       self.max_sessions, self.llm_max_tokens, memories)
        report = build_report(selected, run, self.done, self.skipped, strategies)
        # Not every strategy scores every selected question (full_history skips prompts over the context
        # window, a memory strategy skips conversations without memories, a run may stop part way:
        # `qa.<s>.not_answered`), so `n_scored` counts the category 1-4 questions scored by every strategy
        # of the run; each strategy's own count is `qa.<s>.n`.
        report["n_scored"] = sum(1 for q in selected if q.category in HEADLINE
                                 and all((s, q.key) in self.done for s in run)) if run else 0
        if replay_info is not None:
            report["replay"] = replay_info
        elif self.record is not None and backend is not None:
            if self.decompose and self.episodes_used:
                settings["episodes_version"] = self.episodes_used
            report["record"] = _record_run(backend, self.record, self.path, convs, selected, run, self.done, memories,
                                           settings, self.episodes_by_user if self.decompose else None)
        ledger_rows = JsonlLog(self.paths["ledger"]).rows() if self.paths["ledger"].exists() else []
        report.update({
            "dataset": str(self.path), **self.load_info, "n_conversations": len(convs), "seed": seed,
            "decomposition": self.decompose_info, "sample_per_category": sample_per_category, "words_budget": words,
            "model": backend.model_name if backend else (next(iter(self.done.values()))["model"] if self.done else None),
            "answer_prompt_version": ANSWER_PROMPT_VERSION,
            "memories": str(self.memories) if self.memories is not None else None,
            "memory_keys": {"source_weight": SOURCE_WEIGHT,
                            "rule": "topk_memories and qumem rank memories by normalize(text + w * normalize(mean of "
                                    "source turns)); adamem by their text"},
            "checkpoint": str(self.paths["checkpoint"]), "ledger": str(self.paths["ledger"]),
            "html": str(self.paths["html"]),
            "llm_calls": {"sent_this_run": backend.sent if backend else 0,
                          "replayed_this_run": backend.replayed if backend else 0,
                          "by_strategy_this_run": {k: dict(v) for k, v in backend.used.items()} if backend else {},
                          "ledger_rows": len(ledger_rows),
                          "ledger_by_strategy": _ledger_totals(ledger_rows)},
            "wall_s": round(time.perf_counter() - self.t0, 1),
        })
        return self._write(report, retrieval_report)

    def _write(self, report: dict, retrieval_report) -> dict:
        from qumem_pipeline.eval.locomo.qa_report import write_html

        if self.replay_only:  # the work directory goes; the report goes where --out said, if anywhere
            report.update({"checkpoint": None, "ledger": None, "html": None})
            if self.report_out is not None and self.report_out.suffix == ".json":
                self.report_out.parent.mkdir(parents=True, exist_ok=True)
                self.report_out.write_text(json.dumps(report, indent=2, default=str))
            self.work.cleanup()
            return report
        write_html(report, self.paths["html"], retrieval_report)
        tmp = self.paths["report"].with_name(".tmp-" + self.paths["report"].name)
        tmp.write_text(json.dumps(report, indent=2, default=str))
        os.replace(tmp, self.paths["report"])
        return report


def _memory_frames(memories, convs) -> dict:
    """sample_id -> that conversation's memories (both speakers'), from a memories table path."""
    import polars as pl

    from qumem_pipeline.eval.locomo.data import read_memories

    try:
        df = read_memories(memories)
    except (FileNotFoundError, ValueError, OSError):
        return {}
    return {c.sample_id: df.filter(pl.col("user_id").is_in(c.user_ids)) for c in convs}


def _recorded_episodes(record, path, convs, version: str, max_sessions) -> dict:
    """Every speaker's episodes of these conversations as the record holds them from classifier `version`."""
    from qumem_pipeline.eval.record import episodes_path, read_episodes

    if record is None:
        raise ValueError("--episodes-version reads the episodes from the record: give one")
    out, lacking = {}, []
    for c in convs:
        p = episodes_path(record, Path(path).name, version, c.sample_id, max_sessions)
        if p.is_file():
            out.update(read_episodes(p))
        else:
            lacking.append(c.sample_id)
    if lacking:
        raise SystemExit(f"the record holds no episodes of {lacking} from classifier {version} "
                         f"(under {record.root / 'episodes'}); run without --episodes-version to segment again")
    return out


def _record_run(backend, record, path, convs, selected, run, done, memories, settings: dict,
                episodes_by_user: dict | None = None) -> dict:
    """The run's manifest, decomposed memories and the episodes they came from, into the record; what
    the record gained."""
    from qumem_pipeline.eval.record import RecordBackend, episodes_path, file_sha256, write_episodes, write_memories

    if not isinstance(backend, RecordBackend):
        return {}
    ident = backend.identity
    written = []
    if memories is not None:
        for sid, df in _memory_frames(memories, convs).items():
            if df.height:
                p = record.memories_path(Path(path).name, ident["model"], sid, settings["max_sessions"],
                                         settings["llm_max_tokens"])
                if write_memories(record, p, df):
                    written.append(str(p.relative_to(record.root)))
    if episodes_by_user and settings.get("episodes_version"):
        for c in convs:
            mine = {u: e for u, e in episodes_by_user.items() if u in c.user_ids}
            p = episodes_path(record, Path(path).name, settings["episodes_version"], c.sample_id, settings["max_sessions"])
            if mine and write_episodes(p, mine):
                written.append(str(p.relative_to(record.root)))
    answered = {s: sorted(q.key for q in selected if (s, q.key) in done) for s in run}
    manifest = {"kind": "locomo_qa", "dataset": Path(path).name, "dataset_sha256": file_sha256(path),
                "model_name": ident["model_name"], "model": ident["model"], "decoding": ident["decoding"],
                "settings": settings, "conversations": sorted(c.sample_id for c in convs),
                "answered": {s: k for s, k in answered.items() if k}}
    mpath = record.add_run(manifest)
    return {"root": str(record.root), "hits": backend.hits, "appended": backend.appended, "manifest": mpath.name,
            "memories_written": written, **record.size()}


def _replay_summary(backend, selected, convs, cover, record, path, max_sessions, llm_max_tokens, memories):
    """(report['replay'], the questions kept, the conversations kept): with ``cover`` only what the
    record answered in full; the regenerated memories checked against the record's copy."""
    from qumem_pipeline.eval.record import read_memories_jsonl

    missing = dict(backend.missing) if backend is not None else {}
    bad_q = {m["question"] for m in missing.values() if m["question"]}
    bad_conv = {m["conversation"] for m in missing.values() if not m["question"]}
    kept_convs = [c.sample_id for c in convs if c.sample_id not in bad_conv]
    kept = [q for q in selected if q.key not in bad_q and q.sample_id not in bad_conv] if cover else list(selected)
    info = {"record": str(record.root), "model": backend.identity["model"] if backend else None,
            "calls_replayed": backend.hits if backend else 0, "cover": bool(cover),
            "conversations": sorted({q.sample_id for q in kept}) if cover else [c.sample_id for c in convs],
            "questions": [q.key for q in kept], "n_questions": len(kept),
            "left_out": {"conversations": sorted(bad_conv), "questions": sorted(bad_q)} if cover else None,
            "missing": backend.missing_summary() if backend else {"calls": 0},
            "missing_calls": sorted(({"key": k, **m} for k, m in missing.items()),
                                    key=lambda m: (str(m["conversation"]), m["request_id"]))}
    if memories is not None and backend is not None:
        match = {}
        for sid, df in _memory_frames(memories, convs).items():
            p = record.memories_path(Path(path).name, backend.identity["model"], sid, max_sessions, llm_max_tokens)
            if p.is_file():
                rec = read_memories_jsonl([p])
                key = lambda d: sorted(zip(d["memory_id"].to_list(), d["content"].to_list()))  # noqa: E731
                match[sid] = key(rec) == key(df)
        info["memories_match_record"] = match
    return info, kept, kept_convs


def cover_options(record, path: str) -> dict:
    """``run_qa`` options that replay everything the record's QA runs on this dataset cover: the largest
    group of runs with one model and one setting, its conversations, questions and strategies."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in record.runs():
        if r.get("kind") == "locomo_qa" and r.get("dataset") == Path(path).name:
            groups[json.dumps([r["model"], r["decoding"], r["settings"]], sort_keys=True)].append(r)
    if not groups:
        raise SystemExit(f"replay-only: the record {record.root} holds no QA run on {Path(path).name}; "
                         "grow it with a run without --replay-only")
    best = max(groups.values(), key=lambda rs: sum(len(k) for r in rs for k in r["answered"].values()))
    st = best[0]["settings"]
    keys = sorted({k for r in best for ks in r["answered"].values() for k in ks})
    strategies = [s for s in QA_STRATEGIES if any(s in r["answered"] for r in best)]
    return {"conversations": sorted({c for r in best for c in r["conversations"]}), "question_keys": keys,
            "strategies": strategies, "words": st["words"], "chunk": st["chunk"], "context_tokens": st["context_tokens"],
            "llm_max_tokens": st["llm_max_tokens"], "max_sessions": st["max_sessions"], "decompose": st["decompose"],
            "memories": st["memories"], "replay_model": best[0]["model"], "episodes_version": st.get("episodes_version"),
            "state_labels": st.get("state_labels", "raw"), "other_groups": len(groups) - 1}



def strategy_version(strategy: str) -> str:
    """What besides the answer prompt decides a strategy's answers: for the state strategies the query
    stage's version (its code, model and embedder), so a changed strategy is answered again (the
    ledger still replays every identical call); the other contexts are built here, in the eval."""
    if strategy in STATE_STRATEGIES:
        from qumem_pipeline.eval.locomo.qa_contexts import EVIDENCE_RENDER, TURNS_RENDER
        from qumem_pipeline.query.version import stage_version

        render = {"qumem_evidence": f"; {EVIDENCE_RENDER}", "adamem_turns": f"; {TURNS_RENDER}"}.get(strategy, "")
        return (stage_version("query_states") + render
                + ("" if state_label_mode() == "expanded" else "; state labels raw"))
    if strategy == "topk_memories":  # ranked by the memories' index keys (text and source turns)
        from qumem_pipeline.index.memory_keys import SOURCE_WEIGHT, keyed_version

        return "context-built-by-the-eval; memory keys " + keyed_version("", SOURCE_WEIGHT)
    return "context-built-by-the-eval"


def _parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--episodes-version", default=None, help="with --decompose: the record's episodes from this "
                    "continuity classifier version, not the shipped classifier's (replays of runs recorded under it)")
    ap.add_argument("--state-labels", choices=STATE_LABEL_MODES, default="expanded",
                    help="'raw': user states keep memory aliases in their text, as tables published before "
                    "query/strategies/state_labels.py were measured (their replays ask for it)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--retrieval-json", default=None,
                    help="a retrieval harness JSON report: its recall-vs-budget curves go into the HTML report")
    ap.add_argument("--questions", default=None, help="comma list of question keys (<sample_id>#<index>) to keep")
    ap.add_argument("--record", default=None, help="the evaluation record (default eval_record/ or $QUMEM_EVAL_RECORD; "
                    "'off': none): calls it holds are replayed, the others sent and added to it")
    ap.add_argument("--replay-only", action="store_true", help="no model: every call from the record; fails listing "
                    "the calls it lacks. With no selection flag: replays what the record's runs cover, and says which")
    ap.add_argument("--replay-model", default=None, help="with --replay-only: the recorded model (name@dtype) when the "
                    "record has several")
    return ap


def _comma_list(value: str | None) -> list[str] | None:
    return [x.strip() for x in value.split(",") if x.strip()] if value else None


def _run_options(args, raw: list[str], record) -> tuple[dict, bool]:
    """run_qa's selection from the command line, and whether it is a cover replay (--replay-only with no
    selection flag: everything the record's runs cover)."""
    opts = dict(strategies=_comma_list(args.strategies) or [],
                sample_per_category=args.sample_per_category, seed=args.seed, words=args.words,
                context_tokens=args.context_tokens, chunk=args.chunk, memories=args.memories, decompose=args.decompose,
                memories_out=args.memories_out, llm_kind=args.llm_kind, llm_max_tokens=args.llm_max_tokens,
                conversations=_comma_list(args.conversations), max_sessions=args.max_sessions,
                limit_conversations=args.limit_conversations, episodes_version=args.episodes_version,
                question_keys=_comma_list(args.questions))
    cover = args.replay_only and not any(a.startswith("--") and a.split("=", 1)[0] not in COVER_NEUTRAL for a in raw)
    if cover:  # replay everything the record covers
        got = cover_options(record, args.path)
        other = got.pop("other_groups")
        opts.update(got)
        opts["sample_per_category"] = None
        if other:
            print(f"[qa] the record holds {other} other group(s) of runs (another model or setting); replaying the "
                  "largest. Give its flags to replay another.", file=sys.stderr)
    elif args.replay_model:
        opts["replay_model"] = args.replay_model
    return opts, cover


def _replay_verdict(report: dict, record, cover: bool) -> int:
    """What a replay covered and lacked, on stderr; 1 when it lacked calls (or covered nothing)."""
    from qumem_pipeline.eval.record import format_missing

    rp = report.get("replay")
    if rp is None:
        return 0
    print(f"[qa] replayed {rp['calls_replayed']} calls from {rp['record']}: conversations {rp['conversations']}, "
          f"{rp['n_questions']} questions ({report['n_scored']} scored, categories 1-4): {rp['questions']}",
          file=sys.stderr)
    if cover and rp["left_out"] and (rp["left_out"]["questions"] or rp["left_out"]["conversations"]):
        print(f"[qa] left out, not fully in the record: {json.dumps(rp['left_out'])}", file=sys.stderr)
    if not cover and rp["missing"]["calls"]:
        print(format_missing(_MissingView(rp, record)), file=sys.stderr)
        return 1
    if cover and not rp["n_questions"]:
        print("[qa] the record covers no question of this file in full", file=sys.stderr)
        return 1
    return 0


def _stop_like_ctrl_c() -> None:
    """SIGTERM (a deadline's `timeout`, a scheduler) and SIGINT both stop a run as Ctrl-C does: the answering
    stops, and what was answered is reported and its run manifest recorded (run_qa's KeyboardInterrupt
    path). SIGINT is set here too: a run started in the background of a non-interactive shell inherits it
    ignored, and on 2026-12-05 no SIGINT could stop a recording run. A second signal acts as the default."""
    def stop(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(argv) if argv is not None else sys.argv[1:]
    args = _parser().parse_args(raw)
    _stop_like_ctrl_c()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from qumem_pipeline.eval.record import EvalRecord, default_root

    root = default_root() if args.record is None else (None if args.record.lower() == "off" else Path(args.record))
    record = EvalRecord(root) if root is not None else None
    opts, cover = _run_options(args, raw, record)
    out = args.out or (None if args.replay_only else str(Path(".artifacts") / "locomo_qa" / f"{Path(args.path).stem}.qa.json"))
    with raw_state_labels(opts.pop("state_labels", args.state_labels) == "raw"):
        report = run_qa(
            args.path, out=out, **opts, record=record, replay_only=args.replay_only, cover=cover,
            continuity_artifact=args.continuity_artifact, device=args.device,
            retrieval_report=json.loads(Path(args.retrieval_json).read_text()) if args.retrieval_json else None,
        )
    print(format_table(report))
    rc = _replay_verdict(report, record, cover)
    if args.json:
        print(json.dumps(report, default=str))
    return rc


# flags that select nothing: --replay-only with only these replays what the record covers
COVER_NEUTRAL = {"--replay-only", "--json", "--record", "--out", "--device", "--continuity-artifact", "--retrieval-json"}


class _MissingView:
    """``format_missing``'s view of a replay report (the backend is gone by then)."""

    def __init__(self, rp: dict, record) -> None:
        self.record = record
        self.missing = {m["key"]: m for m in rp["missing_calls"]}
        self._summary = rp["missing"]

    def missing_summary(self) -> dict:
        return self._summary


if __name__ == "__main__":
    sys.exit(main())
