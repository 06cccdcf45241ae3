"""Typed memory decomposition (QUMem §3.3): each episode -> factual, preference and insight memories.

For every episode the same decomposer is invoked three times, once per memory type d in
{fact, preference, insight}; each call returns atomic memories with the turns that support them.
A memory's temporal position is its latest evidence turn, and `valid_from` that turn's timestamp.

Prompts are *prefix-shared*: the system text and the episode transcript (turns numbered by their
turn ids) come first and are byte-identical across the three calls; the type-specific instruction
comes last, so a prefix cache (vLLM's, on by default) prefills an episode once for three calls.
The whole run's episodes (all users) go to the backend as one continuous stream of calls.

The prompts and schemas live in `memories.prompts`, output validation in `memories.parsing`; this
module runs the calls and re-exports both. Nothing here imports Dagster; the memories asset calls
`decompose_episodes`.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import polars as pl

from qumem_pipeline.memories.checkpoints import CallOutcome, CheckpointStore, call_key
from qumem_pipeline.llm.base import ChatRequest, ChatResult, LLMBackend, LLMError, generate_each
from qumem_pipeline.llm.model_profiles import output_bounds_of, profile_for
from qumem_pipeline.memories.version import stage_version
# Re-exported: callers (assets, query strategies, tests, benches) import these from here.
from qumem_pipeline.memories.parsing import (  # noqa: F401
    DECOMPOSE_QUARANTINE_SCHEMA,
    LEDGER_SCHEMA,
    MEMORY_SCHEMA,
    DecomposeStats,
    memories_from_output,
    memory_id,
    normalize_content,
)
from qumem_pipeline.memories.prompts import (  # noqa: F401
    MAX_CONTENT_CHARS,
    MAX_EVIDENCE_IDS,
    MAX_MEMORIES_PER_CALL,
    MAX_TURN_ID,
    MEMORY_TYPES,
    OUTPUT_INSTRUCTION,
    PROMPT_VERSION,
    SYSTEM_PROMPT,
    TYPE_INSTRUCTIONS,
    Episode,
    Turn,
    _request_id,
    build_messages,
    build_requests,
    coerce_episode,
    memory_schema,
    render_transcript,
    shared_prefix_text,
)


# -- the run ----------------------------------------------------------------------------------
# A call may write up to this many times `max_tokens`, in its one request. Why: decoding is greedy
# (temperature 0), so the old "cut at max_tokens -> retry at twice the tokens" rewrote the same first
# max_tokens tokens before going on: the same output as one request at twice the budget, paid
# max_tokens tokens more, and sent late, a straggler running alone at single-sequence speed after
# every other call had finished (issue 18: a 721-token retry, 125 s of the bench's 536 s stage). A call
# cut at the full budget is not retried: greedy decoding would repeat the cut.
LENGTH_BUDGET_FACTOR = 2
STAGE = "decompose"  # the `stage` of this stage's `llm_ledger` rows


def call_budget(max_tokens: int) -> int:
    """The max_tokens a decomposition request is sent with (the configured budget, grown once)."""
    return int(max_tokens) * LENGTH_BUDGET_FACTOR


def decompose_requests(episodes: Iterable[Any], max_tokens: int = 512,
                       types: Sequence[str] = MEMORY_TYPES) -> list[ChatRequest]:
    """The first-attempt requests `decompose_episodes` sends for `max_tokens`, exactly (benches use them)."""
    reqs = build_requests(episodes, max_tokens=call_budget(max_tokens), types=types)
    for r in reqs:
        r.metadata["budget"] = int(max_tokens)  # the configured budget: what the checkpoint key names
    return reqs


@dataclass
class DecomposeOutput:
    memories: pl.DataFrame
    quarantine: pl.DataFrame
    ledger: pl.DataFrame
    stats: DecomposeStats
    summary: dict[str, Any]
    call_keys_by_user: dict[str, set[str]] = field(default_factory=dict)  # checkpoint keys still in use


def _prefix_tokens_fn(backend: LLMBackend) -> Callable[[Episode], int] | None:
    """Exact shared-prefix length in tokens when the backend can tokenize prompts."""
    ids_fn = getattr(backend, "prompt_token_ids", None)
    if ids_fn is None:
        return None

    def fn(ep: Episode) -> int:
        seqs = [ids_fn(build_messages(ep, t)) for t in MEMORY_TYPES]
        n = 0
        for toks in zip(*seqs):
            if len(set(toks)) != 1:
                break
            n += 1
        return n

    return fn


def _estimated_prefix_tokens(ep: Episode, prompt_tokens: int, mem_type: str) -> int:
    """Without a tokenizer: the prompt's tokens scaled by the shared prefix's share of its characters."""
    msgs = build_messages(ep, mem_type)
    total = sum(len(m["content"]) for m in msgs)
    shared = len(SYSTEM_PROMPT) + len(shared_prefix_text(ep))
    return int(prompt_tokens * shared / max(1, total))


def decompose_episodes(
    episodes: Iterable[Any],
    backend: LLMBackend,
    *,
    created_at: datetime,
    max_tokens: int = 512,
    types: Sequence[str] = MEMORY_TYPES,
    prompt_version: str = PROMPT_VERSION,
    code_version: str | None = None,  # None: this code's memories stage version
    checkpoint: CheckpointStore | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DecomposeOutput:
    """Decompose every episode (all users); retry bad output once, then quarantine.

    Each call is sent with `call_budget(max_tokens)` (twice `max_tokens`, see LENGTH_BUDGET_FACTOR);
    one cut there is quarantined without a retry, other bad output (invalid JSON, off-schema) is
    retried once with the same budget.

    The calls go to the backend continuously (`generate_each`: a bounded number in flight, the
    backend's concurrency, each slot refilled the moment its call finishes), so no call waits for
    the slowest of a batch. Each finished call is handed to `checkpoint.record` as it finishes
    (the store writes them within a second or a few dozen calls) and the store is flushed before
    this returns or raises, so an endpoint failure loses no answered call. With a `checkpoint`,
    calls finished by an earlier (crashed or failed) run are restored, not repeated. The tables
    come out in (episode, type) order whatever the completion order, so a resumed run equals an
    uninterrupted one.

    `progress(done, total)` is called once with 0 before the first call is sent, then after each
    finished call with the calls sent so far (the calls restored from a checkpoint are not counted:
    they cost nothing).

    Raises `LLMEndpointError` when the endpoint stays unreachable after the backend's retries,
    after every call that did finish is checkpointed (`exc.finished_outcomes`).
    """
    if created_at.tzinfo is None:
        created_at = created_at.replace(tzinfo=timezone.utc)
    eps = [coerce_episode(e) for e in episodes]
    by_key = {(e.user_id, e.episode_id): e for e in eps}
    if len(by_key) != len(eps):
        raise ValueError("duplicate (user_id, episode_id) in the episodes handed to decompose_episodes")
    stats = DecomposeStats(episodes=len(eps), turns=sum(len(e.turns) for e in eps))
    run = _CallRunner(backend, created_at=created_at, prompt_version=prompt_version, by_key=by_key)

    restored = checkpoint.load(sorted({e.user_id for e in eps})) if checkpoint is not None else {}
    outcomes: dict[str, CallOutcome] = {}
    todo: list[ChatRequest] = []
    requests = decompose_requests(eps, max_tokens=max_tokens, types=types)
    keys = [run.key_of(r) for r in requests]
    for req, k in zip(requests, keys):
        if k in restored:
            outcomes[k] = restored[k]
            stats.reused_calls += len(restored[k].ledger)
        else:
            todo.append(req)

    fresh: list[CallOutcome] = []

    def finished(o: CallOutcome) -> None:
        outcomes[o.key] = o
        fresh.append(o)
        if checkpoint is not None:
            checkpoint.record(o)
        if progress is not None:
            progress(len(fresh), len(todo))

    if progress is not None:
        progress(0, len(todo))
    try:
        generate_each(backend, todo, lambda req, res: run.on_result(req, res, finished))
    except LLMError as exc:
        exc.finished_outcomes = list(fresh)  # type: ignore[attr-defined]
        raise
    finally:
        if checkpoint is not None:
            checkpoint.flush()  # what finished is on disk before this returns or raises
    return _assemble(eps, keys, outcomes, stats, code_version=code_version or stage_version("memories"))


class _CallRunner:
    """Turns each finished request into a final outcome, or into its one retry after bad output."""

    def __init__(self, backend: LLMBackend, *, created_at: datetime, prompt_version: str,
                 by_key: dict[tuple[str, str], Episode]) -> None:
        self.backend = backend
        self.model = backend.model_name
        self.created_at = created_at
        self.prompt_version = prompt_version
        self.by_key = by_key
        self._prefix_fn = _prefix_tokens_fn(backend)
        self._prefix_cache: dict[tuple[str, str], int] = {}
        self._first_rows: dict[str, dict[str, Any]] = {}  # call key -> ledger row of a retried first attempt

    def key_of(self, req: ChatRequest) -> str:
        md = req.metadata
        # keyed on the configured budget: a checkpoint written by the old cut-then-retry-at-2x policy
        # holds the same final output (greedy decoding), so it is still served
        bounds = output_bounds_of(self.backend)  # the embedded engine's cut bounds: other outputs
        return call_key(md["user_id"], md["episode_id"], md["type"], req.messages, self.prompt_version,
                        f"{self.model}|bounds={bounds}" if bounds else self.model, md["budget"])

    def on_result(self, req: ChatRequest, res: ChatResult,
                  finished: Callable[[CallOutcome], None]) -> list[ChatRequest] | None:
        """A final outcome goes to `finished`; bad first output becomes one retry request."""
        md = req.metadata
        attempt = md["attempt"]
        # a cut at the full budget is final: greedy decoding would write the same tokens again
        if res.ok or attempt == 2 or res.error_kind == "length":
            finished(self._finish(req, res, attempt, self._first_rows))
            return None
        self._first_rows[self.key_of(req)] = self._ledger_row(req, res, attempt, "retried")
        return [ChatRequest(
            request_id=_request_id(self.by_key[(md["user_id"], md["episode_id"])], md["type"], 2),
            messages=req.messages, json_schema=req.json_schema, constraint_schema=req.constraint_schema,
            max_tokens=req.max_tokens, schema_name=req.schema_name,
            metadata={**md, "attempt": 2, "first_error": res.error},
        )]

    def _finish(self, req: ChatRequest, res: ChatResult, attempt: int, first_rows: dict) -> CallOutcome:
        md = req.metadata
        key = self.key_of(req)
        ledger = [first_rows.pop(key)] if attempt == 2 else []
        quarantine = None
        if res.ok:
            ledger.append(self._ledger_row(req, res, attempt, "ok"))
        else:
            ledger.append(self._ledger_row(req, res, attempt, "quarantined"))
            quarantine = {
                "user_id": md["user_id"], "episode_id": md["episode_id"], "type": md["type"],
                "request_id": req.request_id,
                "reason": f"{res.error} (first attempt: {md.get('first_error')})" if attempt == 2 else str(res.error),
                "raw": res.raw_text, "attempts": attempt, "model": self.model,
                "prompt_version": self.prompt_version,
            }
        return CallOutcome(key=key, user_id=md["user_id"], episode_id=md["episode_id"], type=md["type"],
                           status="ok" if res.ok else "quarantined", output=res.parsed if res.ok else None,
                           quarantine=quarantine, ledger=ledger, created_at=self.created_at)

    def _ledger_row(self, req: ChatRequest, res: ChatResult, attempt: int, status: str) -> dict[str, Any]:
        md = req.metadata
        ep = self.by_key[(md["user_id"], md["episode_id"])]
        key = (ep.user_id, ep.episode_id)
        if key not in self._prefix_cache and self._prefix_fn is not None:
            self._prefix_cache[key] = self._prefix_fn(ep)
        shared = self._prefix_cache.get(key)
        if shared is None:
            shared = _estimated_prefix_tokens(ep, res.prompt_tokens, md["type"])
        return {
            "request_id": req.request_id, "user_id": ep.user_id, "episode_id": ep.episode_id, "type": md["type"],
            "attempt": attempt, "status": status, "episode_turns": len(ep.turns),
            "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "cached_tokens": res.cached_tokens, "shared_prefix_tokens": shared, "latency_s": res.latency_s,
            "transport_attempts": res.attempts, "backend": self.backend.backend_name, "model": self.model,
            "prompt_version": self.prompt_version, "stage": STAGE,
        }


def _assemble(eps: list[Episode], keys: list[str], outcomes: dict[str, CallOutcome], stats: DecomposeStats,
              *, code_version: str) -> DecomposeOutput:
    """The three tables from the outcomes, in request (episode, type) order."""
    by_key = {(e.user_id, e.episode_id): e for e in eps}
    memories: list[dict[str, Any]] = []
    quarantine: list[dict[str, Any]] = []
    ledger: list[dict[str, Any]] = []
    for k in keys:
        o = outcomes[k]
        # a call checkpointed before ledger rows named their stage is a decomposition call all the same
        ledger.extend({**row, "stage": row.get("stage") or STAGE, "code_version": code_version,
                       "created_at": o.created_at} for row in o.ledger)
        stats.calls += len(o.ledger)
        stats.retries += sum(1 for row in o.ledger if row["status"] == "retried")
        if o.status == "ok":
            prompt_version = o.ledger[-1]["prompt_version"]
            model = o.ledger[-1]["model"]
            memories.extend(memories_from_output(
                by_key[(o.user_id, o.episode_id)], o.type, o.output or {}, stats, model=model,
                prompt_version=prompt_version, code_version=code_version, created_at=o.created_at,
                gate=profile_for(str(model).split("@")[0]).memory_gate,
            ))
        else:
            stats.quarantined += 1
            quarantine.append({**(o.quarantine or {}), "code_version": code_version, "created_at": o.created_at})
    stats.memories = len(memories)
    mem_df = pl.DataFrame(memories, schema=MEMORY_SCHEMA) if memories else MEMORY_SCHEMA.to_frame()
    mem_df = mem_df.sort(["user_id", "episode_id", "type", "position", "memory_id"])
    q_df = pl.DataFrame(quarantine, schema=DECOMPOSE_QUARANTINE_SCHEMA) if quarantine else DECOMPOSE_QUARANTINE_SCHEMA.to_frame()
    l_df = pl.DataFrame(ledger, schema=LEDGER_SCHEMA) if ledger else LEDGER_SCHEMA.to_frame()
    summary = summarize_ledger(l_df, n_turns=stats.turns)
    summary.update({f"n_{k}": v for k, v in stats.as_dict().items()})
    keys_by_user: dict[str, set[str]] = {}
    for k in keys:
        keys_by_user.setdefault(outcomes[k].user_id, set()).add(k)
    return DecomposeOutput(memories=mem_df, quarantine=q_df, ledger=l_df, stats=stats, summary=summary,
                           call_keys_by_user=keys_by_user)


def summarize_ledger(ledger: pl.DataFrame, n_turns: int) -> dict[str, Any]:
    """Per-run cost figures (the paper's Table 4 units) from the token ledger.

    `computed_prefill_tokens` is what a prefix cache leaves to compute: within an episode the first
    call prefills its whole prompt, every later call (other types, retries) only what follows the
    shared prefix. `prefill_saved_tokens` is the rest.
    """
    turns = max(1, int(n_turns))
    calls = ledger.height
    prompt = int(ledger["prompt_tokens"].sum() or 0) if calls else 0
    completion = int(ledger["completion_tokens"].sum() or 0) if calls else 0
    computed = 0
    if calls:
        g = (
            ledger.with_row_index("_i")
            .sort("_i")
            .with_columns(pl.col("_i").rank("ordinal").over(["user_id", "episode_id"]).alias("_k"))
        )
        computed = int(
            g.select(
                pl.when(pl.col("_k") == 1)
                .then(pl.col("prompt_tokens"))
                .otherwise((pl.col("prompt_tokens") - pl.col("shared_prefix_tokens")).clip(lower_bound=0))
                .sum()
            ).item()
            or 0
        )
    reported_cached = ledger["cached_tokens"].drop_nulls() if calls else pl.Series([], dtype=pl.Int64)
    return {
        "turns": int(n_turns),
        "llm_calls": calls,
        "calls_per_100_turns": 100.0 * calls / turns,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_per_turn": prompt / turns,
        "completion_tokens_per_turn": completion / turns,
        "tokens_per_turn": (prompt + completion) / turns,
        "computed_prefill_tokens": computed,
        "computed_prefill_tokens_per_turn": computed / turns,
        "prefill_saved_tokens": prompt - computed,
        "prefill_saved_fraction": (prompt - computed) / prompt if prompt else 0.0,
        "reported_cached_tokens": int(reported_cached.sum()) if len(reported_cached) else None,
        "mean_latency_s": float(ledger["latency_s"].mean()) if calls else 0.0,
    }
