"""PersonaMem: pick the response that fits this user now, every strategy side by side.

``qumem eval personamem DIR [--contexts F] [--questions F] [--strategies ...] [--split dev|test]
[--replay-only] --json``. Each question is a query asked after message ``end_index`` of its context:
the strategies see only the turns up to it, and only memories whose evidence ends there
(``data.up_to``). Strategies, all with the same model and the same answer step, differing only in
the context they give it:

- ``none``: no context (the floor); ``full_history``: the context's last messages before the
  question, truncated to the model's window (``--context-tokens``, by a 4-characters-per-token bound
  so the same text replays without the tokenizer);
- ``topk_turns`` / ``topk_memories``: turns / typed memories ranked by MiniLM similarity to the
  user's message, within a word budget (``--words``);
- ``qumem``, ``adamem``, ``qumem_hybrid``: the product's user states, as in the LoCoMo harness.

The answer is chosen two ways (``--methods``): ``choice`` (a schema-constrained letter) and
``likelihood`` (the options' length-normalised log-likelihood, ``likelihood.py``). Every model call
goes through the evaluation record; ``--replay-only`` answers from it alone. Output: a table, and a
JSON report whose last line holds ``n_questions``, ``accuracy.<strategy>``,
``accuracy_by_type.<strategy>.<type>``, ``vs_topk_turns`` / ``vs_qumem`` (paired bootstrap), and
calls and tokens per strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from qumem_pipeline.eval.locomo.qa_ledger import JsonlLog
from qumem_pipeline.eval.locomo.qa_prompt import ADAMEM_STRATEGIES, MEMORY_STRATEGIES, QA_STRATEGIES
from qumem_pipeline.eval.locomo.qa_summary import paired_difference
from qumem_pipeline.eval.personamem import prompts
from qumem_pipeline.query.strategies.state_labels import STATE_LABEL_MODES, raw_state_labels, state_label_mode
from qumem_pipeline.eval.personamem.data import LETTERS, PMQuestion, default_paths, load, up_to
from qumem_pipeline.eval.personamem.likelihood import OptionScorer, pick

STRATEGIES = QA_STRATEGIES  # the LoCoMo harness's strategies, built by the same `_contexts`
METHODS = ("choice", "likelihood")
DEFAULT_WORDS = 512
DEFAULT_CONTEXT_TOKENS = 32768  # Qwen2.5's window; the full history is cut to fit it
CHARS_PER_TOKEN_BOUND = 4  # English text tokenizes to more than 4 characters a token: the cut always fits
RESERVE_TOKENS = 2048  # the question, four options and the answer
KIND = "personamem_mc"


def strategy_version(s: str) -> str:
    from qumem_pipeline.eval.locomo.qa import strategy_version as locomo_version

    return locomo_version(s)


def full_history(cx, budget_chars: int) -> str:
    """The latest messages that fit ``budget_chars``, in order, each session marked."""
    lines, used = [], 0
    for line, sess in zip(reversed(cx.lines), reversed(cx.sessions)):
        if used + len(line) + 1 > budget_chars:
            break
        lines.append((sess, line))
        used += len(line) + 1
    out, prev = ["Conversation with the user (the latest part that fits, in order):"], None
    for sess, line in reversed(lines):
        if sess != prev:
            out.append(f"\n[{sess}]")
            prev = sess
        out.append(line)
    return "\n".join(out)


class _Run:
    """One evaluation: data, backend (record first), memories, per-(context, as-of) contexts, rows."""

    def __init__(self, contexts_path, questions_path, *, out, record, replay_only, replay_model, llm_kind, log):
        from qumem_pipeline.eval.record import EvalRecord

        self.record = EvalRecord(record) if record is not None and not isinstance(record, EvalRecord) else record
        self.replay_only, self.replay_model, self.llm_kind = replay_only, replay_model, llm_kind
        self.contexts_path, self.questions_path = Path(contexts_path), Path(questions_path)
        self.dataset = self.contexts_path.name
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.work = tempfile.TemporaryDirectory(prefix="qumem-pm-") if replay_only else None
        base = Path(self.work.name) / "replay.json" if replay_only else Path(out)
        self.out = Path(out) if out else None
        stem = base.with_suffix("")
        self.paths = {"checkpoint": stem.with_name(stem.name + ".checkpoint.jsonl"),
                      "ledger": stem.with_name(stem.name + ".ledger.jsonl"),
                      "memories": stem.with_name(stem.name + ".memories")}
        self.paths["checkpoint"].parent.mkdir(parents=True, exist_ok=True)
        self._backend = self.scorer = self.emb = None
        self.cx_cache: dict = {}
        self.skipped: dict = {}

    # -- backend and scorer
    def backend(self):
        if self._backend is None:
            from qumem_pipeline.eval.locomo.qa import make_backend
            from qumem_pipeline.eval.locomo.qa_ledger import LedgerBackend
            from qumem_pipeline.eval.record import RecordBackend, identity_from_runs

            convs = {c.sample_id: c.sample_id for c in self.data.conversations}
            if self.replay_only:
                ident = identity_from_runs(self.record, self.dataset, self.replay_model)
                self._backend = RecordBackend(None, self.record, ident, convs)
            else:
                inner = LedgerBackend(make_backend(self.llm_kind), self.paths["ledger"])
                self._backend = RecordBackend(inner, self.record, None, convs) if self.record is not None else inner
        return self._backend

    def option_scorer(self) -> OptionScorer:
        if self.scorer is None:
            from qumem_pipeline.eval.record import _unwrap, model_identity

            b = self.backend()
            ident = b.identity if hasattr(b, "identity") else model_identity(b)
            server = None
            if not self.replay_only:
                inner = _unwrap(b)
                base_url = getattr(inner, "base_url", None) or getattr(getattr(inner, "_client", None), "base_url", None)
                model_dir = os.environ.get("QUMEM_LLM_MODEL", "")
                if base_url and Path(model_dir).is_dir():
                    server = (base_url, getattr(inner, "served_model_name", None) or inner.model_name, model_dir)
                else:
                    self.skipped["likelihood_live"] = ("needs an OpenAI-compatible vLLM server and the model's "
                                                       "directory in QUMEM_LLM_MODEL (its tokenizer)")
            self.scorer = OptionScorer(self.record, ident, server)
        return self.scorer

    # -- memories
    def prepare(self, strategies, episodes_version, llm_max_tokens) -> None:
        from qumem_pipeline.eval.locomo.sources import build_episodes, decompose_memories

        self.episodes_version = episodes_version
        if episodes_version:
            from qumem_pipeline.eval.record import episodes_path, read_episodes

            self.episodes = {}
            for c in self.data.conversations:
                p = episodes_path(self.record, self.dataset, episodes_version, c.sample_id, None)
                if not p.is_file():
                    raise SystemExit(f"the record holds no episodes of {c.sample_id} from classifier {episodes_version}")
                self.episodes.update(read_episodes(p))
        else:
            self.episodes, self.episodes_version = build_episodes(self.data.conversations, all_users=True)
        self.memories = None
        if any(s in MEMORY_STRATEGIES or s in ADAMEM_STRATEGIES for s in strategies):
            b = self.backend()
            b.tags = {"strategy": "decompose"}
            t0 = time.perf_counter()
            self.memories = decompose_memories(self.data.conversations, self.episodes, b, self.paths["memories"],
                                               llm_max_tokens, self.log)
            self.log(f"[personamem] memories: {self.memories.height} in {time.perf_counter() - t0:.0f}s")
            if self.memories.height == 0:
                self.memories = None

    def context(self, sample_id: str, as_of: int):
        from qumem_pipeline.eval.locomo.qa_contexts import ConversationContext

        key = (sample_id, as_of)
        if key not in self.cx_cache:
            if self.emb is None:
                from qumem_pipeline.index.embeddings import Embedder

                self.emb = Embedder.load()
            conv = up_to(self.conv_by_id[sample_id], as_of)
            mems = self.memories
            if mems is not None:
                mems = mems.filter((pl.col("user_id") == sample_id) & (pl.col("position") <= as_of))
            eps = self.episodes.get(sample_id)
            if eps is not None:
                eps = eps.filter(pl.col("last_turn_index") <= as_of)
            self.cx_cache[key] = ConversationContext(conv, self.emb, mems, eps)
        return self.cx_cache[key]


def run_personamem(contexts_path, questions_path, *, out=None, strategies: Sequence[str] = STRATEGIES,
                   methods: Sequence[str] = METHODS, split: str | None = None, contexts: Sequence[str] | None = None,
                   question_keys: Sequence[str] | None = None, limit: int | None = None, words: int = DEFAULT_WORDS,
                   context_tokens: int = DEFAULT_CONTEXT_TOKENS, chunk: int = 16, llm_max_tokens: int = 384,
                   record=None, replay_only: bool = False, replay_model: str | None = None,
                   episodes_version: str | None = None, llm_kind: str | None = None, log=None) -> dict:
    """Answer, score and report; every call through ``record`` (replay-only: from it alone)."""
    strategies = list(dict.fromkeys(strategies))
    bad = set(strategies) - set(STRATEGIES) or set(methods) - set(METHODS)
    if bad:
        raise ValueError(f"unknown strategies/methods {sorted(bad)}; expected {STRATEGIES} and {METHODS}")
    if replay_only and record is None:
        raise ValueError("--replay-only needs a record")
    r = _Run(contexts_path, questions_path, out=out, record=record, replay_only=replay_only,
             replay_model=replay_model, llm_kind=llm_kind, log=log)
    t0 = time.perf_counter()
    r.data = load(contexts_path, questions_path, contexts=contexts)
    r.conv_by_id = {c.sample_id: c for c in r.data.conversations}
    qs = [q for q in r.data.questions if split is None or q.split == split]
    if question_keys is not None:
        keep = set(question_keys)
        qs = [q for q in qs if q.key in keep]
    qs = qs[:limit] if limit else qs
    r.log(f"[personamem] {r.data.info['contexts']} contexts, {len(r.data.questions)} questions, {len(qs)} selected")
    ckpt = JsonlLog(r.paths["checkpoint"])
    done = {(row["strategy"], row["key"]): row for row in ckpt.rows()
            if row.get("prompt_version") == prompts.PROMPT_VERSION and row.get("strategy_version") == strategy_version(row["strategy"])}
    try:
        r.prepare(strategies, episodes_version, llm_max_tokens)
        _answer(r, qs, strategies, methods, done, ckpt, words, context_tokens, chunk)
    except KeyboardInterrupt:
        r.skipped["interrupted"] = "stopped by a signal: the report and the record hold what was answered"
    finally:
        if r._backend is not None:
            r._backend.close()
    report = build_report(qs, strategies, methods, done, r)
    report["settings"] = {"words": words, "context_tokens": context_tokens, "chunk": chunk,
                          "llm_max_tokens": llm_max_tokens, "episodes_version": r.__dict__.get("episodes_version"),
                          "methods": list(methods), "split": split, "state_labels": state_label_mode()}
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    if not replay_only and r.record is not None and r._backend is not None and hasattr(r._backend, "identity"):
        report["record"] = _record_run(r, qs, strategies, done, report["settings"])
    if r.out is not None:
        r.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = r.out.with_name(".tmp-" + r.out.name)
        tmp.write_text(json.dumps(report, indent=2, default=str))
        os.replace(tmp, r.out)
    if r.work is not None:
        r.work.cleanup()
    return report


def _answer(r: _Run, qs, strategies, methods, done, ckpt, words, context_tokens, chunk) -> None:
    """Question chunks, every strategy on each chunk (so paired comparisons grow together)."""
    from qumem_pipeline.eval.locomo.qa_contexts import _contexts
    from qumem_pipeline.llm.base import ChatRequest
    from qumem_pipeline.llm.retry import generate_with_retry

    groups: dict = defaultdict(list)
    for q in qs:
        groups[(q.sample_id, q.as_of)].append(q)
    total = len(qs) * len(strategies)
    n_done, t0 = sum(1 for s in strategies for q in qs if (s, q.key) in done), time.perf_counter()
    budget = max(0, (context_tokens - RESERVE_TOKENS) * CHARS_PER_TOKEN_BOUND)
    for (sample_id, as_of), group in groups.items():
        for start in range(0, len(group), chunk):
            part_all = group[start:start + chunk]
            for s in strategies:
                part = [q for q in part_all if (s, q.key) not in done]
                if not part:
                    continue
                cx = r.context(sample_id, as_of)
                if s in MEMORY_STRATEGIES and cx.memories is None:
                    r.skipped[f"strategy_{s}"] = "no memories (decomposition gave none, or not asked)"
                    continue
                b = r.backend()
                b.tags = {"strategy": s, "prompt_version": prompts.PROMPT_VERSION}
                if s == "full_history":
                    text = full_history(cx, budget)
                    texts, meta = [text] * len(part), [{"context_words": len(text.split())} for _ in part]
                else:
                    texts, meta = _contexts(s, cx, part, b, words, r.emb)
                b.tags = {"strategy": s, "prompt_version": prompts.PROMPT_VERSION}
                results = [None] * len(part)
                if "choice" in methods:
                    reqs = [ChatRequest(f"{s}/{q.key}/choice", prompts.choice_messages(t, q.question, q.options),
                                        prompts.CHOICE_SCHEMA, prompts.CHOICE_MAX_TOKENS, "pm_choice",
                                        metadata={"user_id": sample_id}) for q, t in zip(part, texts)]
                    if s == "full_history" and len(reqs) > 1:  # the first alone fills the prefix cache
                        results = generate_with_retry(b, reqs[:1]) + generate_with_retry(b, reqs[1:])
                    else:
                        results = generate_with_retry(b, reqs)
                scores = [None] * len(part)
                if "likelihood" in methods and s != "full_history":
                    scores = r.option_scorer().score([(prompts.likelihood_messages(t, q.question), q.options)
                                                      for q, t in zip(part, texts)])
                rows = [_row(s, q, m, res, sc, b) for q, m, res, sc in zip(part, meta, results, scores)]
                ckpt.append(rows)
                for row in rows:
                    done[(s, row["key"])] = row
                n_done += len(rows)
                el = time.perf_counter() - t0
                r.log(f"[personamem] {s} {sample_id}: {n_done}/{total} done, {len(rows) / max(el, 1e-9) * 60:.1f}/min "
                      f"last chunk, {el / 60:.1f} min so far")
                t0 = time.perf_counter()


def _row(s: str, q: PMQuestion, meta: dict, res, scores, backend) -> dict:
    choice = None
    if res is not None and res.ok and res.parsed and res.parsed.get("answer") in LETTERS:
        choice = LETTERS.index(res.parsed["answer"])
    ll = pick(scores)
    return {"strategy": s, "key": q.key, "sample_id": q.sample_id, "qtype": q.qtype, "split": q.split,
            "correct": q.correct, "choice": choice, "choice_error": None if res is None or res.ok else res.error,
            "likelihood_scores": scores, "likelihood_pick": ll, **meta,
            "prompt_tokens": getattr(res, "prompt_tokens", 0), "completion_tokens": getattr(res, "completion_tokens", 0),
            "model": getattr(backend, "model_name", None), "prompt_version": prompts.PROMPT_VERSION,
            "strategy_version": strategy_version(s)}


def _hit(row: dict | None, method: str) -> float | None:
    if row is None:
        return None
    got = row["choice"] if method == "choice" else row["likelihood_pick"]
    if method == "likelihood" and row.get("likelihood_scores") is None:
        return None
    return 1.0 if got == row["correct"] else 0.0  # an unusable choice counts as wrong (chance is 0.25)


def build_report(qs, strategies, methods, done, r: _Run) -> dict:
    """Accuracy per method, strategy, type and split; paired differences against topk_turns and qumem."""
    rep: dict = {"n_questions": len(qs), "distinct_questions": len({q.question for q in qs}),
                 "splits": {sp: sum(1 for q in qs if q.split == sp) for sp in ("dev", "test")},
                 "dataset": r.data.info, "prompt_version": prompts.PROMPT_VERSION, "skipped": r.skipped}
    # over several contexts the same question is asked of each: resample questions, not rows (one context:
    # rows, as the record's single-context tables were measured)
    by_question = len({q.sample_id for q in qs}) > 1
    rep["ci_resampling"] = "question text (clusters)" if by_question else "question"
    for method in methods:
        suffix = "" if method == "choice" else "_likelihood"
        acc, by_type, by_split, vs_topk, vs_qumem, n, agree = {}, {}, {}, {}, {}, {}, {}
        for s in strategies:
            hits = {q.key: _hit(done.get((s, q.key)), method) for q in qs}
            got = [h for h in hits.values() if h is not None]
            n[s] = len(got)
            acc[s] = round(sum(got) / len(got), 4) if got else None
            by_type[s] = _grouped(qs, hits, lambda q: q.qtype)
            by_split[s] = _grouped(qs, hits, lambda q: q.split)
            for base, into in (("topk_turns", vs_topk), ("qumem", vs_qumem)):
                if base in strategies and s != base:
                    pairs = [(hits[q.key], _hit(done.get((base, q.key)), method), q.question) for q in qs]
                    pairs = [p for p in pairs if p[0] is not None and p[1] is not None]
                    into[s] = paired_difference([p[0] for p in pairs], [p[1] for p in pairs],
                                                clusters=[p[2] for p in pairs] if by_question else None)
                    if base == "topk_turns":  # where the two differ, question by question
                        agree[s] = {"both": sum(1 for p in pairs if p[0] and p[1]),
                                    "neither": sum(1 for p in pairs if not p[0] and not p[1]),
                                    "only_topk_turns": sum(1 for p in pairs if p[1] and not p[0]),
                                    f"only_{s}": sum(1 for p in pairs if p[0] and not p[1])}
        rep[f"accuracy{suffix}"] = acc
        rep[f"n_scored{suffix}"] = n
        rep[f"accuracy_by_type{suffix}"] = by_type
        rep[f"accuracy_by_split{suffix}"] = by_split
        rep[f"vs_topk_turns{suffix}"] = vs_topk
        rep[f"vs_qumem{suffix}"] = vs_qumem
        rep[f"agreement_vs_topk_turns{suffix}"] = agree
    b = r._backend
    rep["llm_calls"] = {k: dict(v) for k, v in getattr(b, "used", {}).items()} if b is not None else {}
    if r.scorer is not None:
        rep["likelihood_calls"] = {"replayed": r.scorer.hits, "sent": r.scorer.sent, "missing": r.scorer.missing,
                                   "prompt_tokens_sent": r.scorer.prompt_tokens}
    if r.replay_only and b is not None:
        rep["replay"] = {"calls_replayed": b.hits, "missing": b.missing_summary()}
    return rep


def _grouped(qs, hits: dict, key) -> dict:
    groups: dict = defaultdict(list)
    for q in qs:
        if hits[q.key] is not None:
            groups[key(q)].append(hits[q.key])
    return {g: {"n": len(v), "accuracy": round(sum(v) / len(v), 4)} for g, v in sorted(groups.items())}


def _record_run(r: _Run, qs, strategies, done, settings: dict) -> dict:
    from qumem_pipeline.eval.record import episodes_path, file_sha256, write_episodes

    b = r._backend
    ident = b.identity
    written = []
    for c in r.data.conversations:
        mine = {u: e for u, e in r.episodes.items() if u in c.user_ids}
        p = episodes_path(r.record, r.dataset, r.episodes_version, c.sample_id, None)
        if mine and write_episodes(p, mine):
            written.append(str(p.relative_to(r.record.root)))
    answered = {s: sorted(q.key for q in qs if (s, q.key) in done) for s in strategies}
    manifest = {"kind": KIND, "dataset": r.dataset, "dataset_sha256": file_sha256(r.contexts_path),
                "questions": r.questions_path.name, "questions_sha256": file_sha256(r.questions_path),
                "model_name": ident["model_name"], "model": ident["model"], "decoding": ident["decoding"],
                "settings": settings, "conversations": sorted(r.conv_by_id), "answered": {s: k for s, k in answered.items() if k}}
    mpath = r.record.add_run(manifest)
    return {"root": str(r.record.root), "hits": b.hits, "appended": b.appended, "manifest": mpath.name,
            "episodes_written": written}


def format_table(rep: dict) -> str:
    lines = [f"PersonaMem: {rep['n_questions']} questions ({rep['distinct_questions']} distinct; "
             f"dev {rep['splits']['dev']}, test {rep['splits']['test']})",
             f"{'strategy':<14} {'choice':>7} {'n':>4} {'vs topk_turns [95% CI]':>28} {'likelihood':>10} {'n':>4}"]
    for s, a in rep.get("accuracy", {}).items():
        v = rep.get("vs_topk_turns", {}).get(s)
        vs = f"{v['delta']:+.3f} [{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}]" if v and v.get("delta") is not None else "-"
        la = rep.get("accuracy_likelihood", {}).get(s)
        lines.append(f"{s:<14} {a if a is not None else '-':>7} {rep['n_scored'][s]:>4} {vs:>28} "
                     f"{la if la is not None else '-':>10} {rep.get('n_scored_likelihood', {}).get(s, 0):>4}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="qumem eval personamem", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a PersonaMem directory (either layout)")
    ap.add_argument("--contexts", default=None, help="the contexts file (default: found in PATH)")
    ap.add_argument("--questions", default=None, help="the questions CSV (default: found in PATH)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--methods", default=",".join(METHODS), help="choice,likelihood")
    ap.add_argument("--split", choices=["dev", "test"], default=None, help="only the questions of one split")
    ap.add_argument("--context-ids", default=None, help="comma list of contexts to keep (pm-<id> or id prefix)")
    ap.add_argument("--question-keys", default=None, help="comma list of question ids")
    ap.add_argument("--limit", type=int, default=None, help="the first N selected questions")
    ap.add_argument("--words", type=int, default=DEFAULT_WORDS)
    ap.add_argument("--context-tokens", type=int, default=DEFAULT_CONTEXT_TOKENS)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--llm-max-tokens", type=int, default=384)
    ap.add_argument("--episodes-version", default=None)
    ap.add_argument("--llm-kind", default=None)
    ap.add_argument("--state-labels", choices=STATE_LABEL_MODES, default="expanded",
                    help="'raw': user states keep memory aliases in their text (tables measured before "
                    "query/strategies/state_labels.py)")
    ap.add_argument("--out", default=None, help="report path (default .artifacts/personamem/<contexts stem>.json)")
    ap.add_argument("--record", default=None, help="the evaluation record (default eval_record/; 'off': none)")
    ap.add_argument("--replay-only", action="store_true", help="no model: every call from the record")
    ap.add_argument("--replay-model", default=None)
    ap.add_argument("--json", action="store_true")
    return ap


def _comma(v):
    return [x.strip() for x in v.split(",") if x.strip()] if v else None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from qumem_pipeline.eval.locomo.qa import _stop_like_ctrl_c
    from qumem_pipeline.eval.record import EvalRecord, default_root

    _stop_like_ctrl_c()  # SIGTERM/SIGINT stop answering; what was answered is reported and recorded

    root = default_root() if args.record is None else (None if args.record.lower() == "off" else Path(args.record))
    record = EvalRecord(root) if root is not None else None
    if not Path(args.path).exists():
        print(f"personamem: {args.path} not found (the PersonaMem files live in ../shared/datasets/personamem; "
              "QUMEM_SHARED_DATASETS moves that folder)", file=sys.stderr)
        return 2
    ctx, qf = default_paths(args.path) if not (args.contexts and args.questions) else (None, None)
    ctx, qf = Path(args.contexts) if args.contexts else ctx, Path(args.questions) if args.questions else qf
    out = args.out or (None if args.replay_only else str(Path(".artifacts") / "personamem" / f"{ctx.stem}.json"))
    with raw_state_labels(args.state_labels == "raw"):
        rep = run_personamem(ctx, qf, out=out, strategies=_comma(args.strategies), methods=_comma(args.methods),
                             split=args.split, contexts=_comma(args.context_ids), question_keys=_comma(args.question_keys),
                             limit=args.limit, words=args.words, context_tokens=args.context_tokens, chunk=args.chunk,
                             llm_max_tokens=args.llm_max_tokens, record=record, replay_only=args.replay_only,
                             replay_model=args.replay_model, episodes_version=args.episodes_version,
                             llm_kind=args.llm_kind)
    print(format_table(rep))
    rc = 0
    if args.replay_only and rep.get("replay", {}).get("missing", {}).get("calls"):
        print(f"[personamem] the record lacks {rep['replay']['missing']['calls']} calls: "
              f"{json.dumps(rep['replay']['missing'])}", file=sys.stderr)
        rc = 1
    if args.json:
        print(json.dumps(rep, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
