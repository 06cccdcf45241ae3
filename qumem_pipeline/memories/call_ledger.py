"""Every LLM call of the later stages (persona merges, the query agents) checkpointed and in the ledger,
as decomposition's calls are: a killed or failed run repeats no finished call, and every call is a
ledger row that names its stage and carries its tokens.

`CheckpointedLLM` wraps the run's backend; the stage code keeps calling `generate` (through
`llm.retry`) as before. Every request must say whose it is and for which stage (`call_tags` in its
metadata: `user_id`, `stage`, and the query or profile it serves). Each request gets a content key
(`checkpoints.request_call_key`: user, stage, model id, decoding parameters, schemas, a digest of the
prompt, and how many identical requests this run sent before it, so a retry is a call of its own).
A key that an earlier run finished is replayed from the checkpoint table, with no request sent; the
others go to the backend continuously (`generate_each`), each recorded in the checkpoint table as it
finishes (`CheckpointStore.record`; flushed before `generate` returns or raises). Finished means what
the same request would get again at temperature 0: an answer, or an error of the model's own output
(cut at its budget, off the schema, not JSON); an HTTP or transport failure produced no answer, so
it is sent again.

Every call the run used, replayed or sent, is one ledger row (`ledger()`, `parsing.LEDGER_SCHEMA`) in
request order, whatever the completion order, with the tokens, latency and `created_at` of the call
that was paid for: a resumed or repeated run writes the rows an uninterrupted one did. Each asset
writes its rows to a ledger table of its own (one writer per table: `persona_llm_ledger`,
`query_llm_ledger`) and its checkpoints to a checkpoint table of its own (`persona_checkpoints`,
`query_checkpoints`); the warehouse folds the ledgers into `llm_ledger` beside decomposition's rows.
After publishing, `compact` keeps each user's checkpoints of the calls this run used (a result cache
for the next run; rows of user-keyed tables, so `forget` removes them).
"""

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import polars as pl

from qumem_pipeline.llm.base import (
    ERROR_INVALID_JSON, ERROR_LENGTH, ERROR_SCHEMA, BackendBase, ChatRequest, ChatResult, LLMBackend, LLMError,
    generate_each, read_output,
)
from qumem_pipeline.llm.model_profiles import output_bounds_of
from qumem_pipeline.memories.checkpoints import CallOutcome, CheckpointStore, request_call_key
from qumem_pipeline.memories.parsing import LEDGER_SCHEMA

# Stage names of the calls, as the `stage` column of every ledger writes them.
PERSONA_MERGE, A1, A2, A3, RESEARCH, QA = "persona_merge", "a1", "a2", "a3", "research", "qa"
# The tables each asset writes (checkpoints, ledger); the warehouse folds the ledgers into `llm_ledger`.
PERSONA_TABLES = ("persona_checkpoints", "persona_llm_ledger")
QUERY_TABLES = ("query_checkpoints", "query_llm_ledger")
LEDGER_TABLES = ("llm_ledger", PERSONA_TABLES[1], QUERY_TABLES[1])

# Errors the model's own output made: the same request answers the same at temperature 0, so they are
# finished calls (replayed). Anything else (an HTTP error answer) is sent again.
REPLAYABLE_ERRORS = (ERROR_LENGTH, ERROR_SCHEMA, ERROR_INVALID_JSON)


def call_tags(user_id: str, stage: str, unit: str | None = None) -> dict[str, Any]:
    """The metadata a request needs to be checkpointed and ledgered: whose call, which stage, for what."""
    return {"user_id": user_id, "stage": stage, "unit": unit}


def finished(res: ChatResult) -> bool:
    """True when a rerun would get the same result: replay it instead of paying again."""
    if res.ok:
        return True
    return res.error_kind in REPLAYABLE_ERRORS and res.finish_reason is not None


class CheckpointedLLM(BackendBase):
    """The run's backend with every call checkpointed per user and recorded as a ledger row (module doc).

    `store` None: nothing is checkpointed or replayed, calls are still ledgered. `progress(stage, done,
    total)`, when set, is called once a batch starts (its replayed calls counted as done) and after each
    of its calls finishes; `stage` is the batch's stage name(s) from the requests' tags (a1, a2, a3, ...)."""

    def __init__(self, inner: LLMBackend, store: CheckpointStore | None, *, code_version: str,
                 prompt_version: str | None = None, created_at: datetime | None = None,
                 progress: Callable[[str, int, int], None] | None = None) -> None:
        self.inner = inner
        self.progress = progress
        self.store = store
        self.code_version = code_version
        self.prompt_version = prompt_version
        created_at = created_at or datetime.now(timezone.utc)
        self.created_at = created_at if created_at.tzinfo else created_at.replace(tzinfo=timezone.utc)
        self.decoding = {"temperature": getattr(inner, "temperature", 0.0), "seed": getattr(inner, "seed", None)}
        bounds = output_bounds_of(inner)
        if bounds:  # the embedded engine's cut schema bounds decide its output too
            self.decoding["output_bounds"] = bounds
        self.sent = self.replayed = 0
        self._restored: dict[str, CallOutcome] = {}
        self._loaded: set[str] = set()
        self._seen: dict[str, int] = defaultdict(int)  # occurrence-0 key -> identical requests sent this run
        self._tries: dict[str, int] = defaultdict(int)  # request id -> calls of it this run (the row's attempt)
        self._rows: list[tuple[dict[str, Any], datetime]] = []
        self._used: dict[str, set[str]] = defaultdict(set)  # user -> checkpoint keys this run used

    @property
    def model_name(self) -> str:  # type: ignore[override]
        return self.inner.model_name

    @property
    def backend_name(self) -> str:  # type: ignore[override]
        return self.inner.backend_name

    # -- keys ---------------------------------------------------------------------------------
    @staticmethod
    def _tags(req: ChatRequest) -> dict[str, Any]:
        md = req.metadata or {}
        if not md.get("user_id") or not md.get("stage"):
            raise ValueError(f"request {req.request_id}: a checkpointed call needs metadata user_id and stage "
                             "(memories.call_ledger.call_tags)")
        return md

    def _key(self, req: ChatRequest, occurrence: int) -> str:
        md = self._tags(req)
        return request_call_key(md["user_id"], md["stage"], self.model_name, self.decoding, req.schema_name,
                                req.json_schema, req.decoding_schema, req.messages, req.max_tokens, occurrence)

    def _load(self, users: set[str]) -> None:
        new = sorted(users - self._loaded)
        if new and self.store is not None:
            self._restored.update(self.store.load(new))
        self._loaded.update(new)

    def would_replay(self, req: ChatRequest) -> bool:
        """Whether `generate` would answer this request (as the next one of its kind) from a checkpoint."""
        self._load({self._tags(req)["user_id"]})
        return self._key(req, self._seen[self._key(req, 0)]) in self._restored

    # -- calls --------------------------------------------------------------------------------
    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        self._load({self._tags(r)["user_id"] for r in requests})
        keys: list[str] = []
        attempts: list[int] = []
        for req in requests:
            first = self._key(req, 0)
            keys.append(self._key(req, self._seen[first]))
            self._seen[first] += 1
            self._tries[req.request_id] += 1
            attempts.append(self._tries[req.request_id])
        out: list[ChatResult | None] = [None] * len(requests)
        rows: list[tuple[dict[str, Any], datetime] | None] = [None] * len(requests)
        todo: list[int] = []
        for i, req in enumerate(requests):
            o = self._restored.get(keys[i])
            if o is None:
                todo.append(i)
                continue
            out[i], rows[i] = self._replay(req, o, attempts[i])
            self._used[o.user_id].add(keys[i])
            self.replayed += 1
        sending = [replace(requests[i]) for i in todo]  # own objects: results are matched by identity
        slot = {id(r): i for r, i in zip(sending, todo)}
        stage = ",".join(dict.fromkeys(str(self._tags(r)["stage"]) for r in requests))
        done = [len(requests) - len(todo)]
        if self.progress is not None and requests:
            self.progress(stage, done[0], len(requests))

        def on_result(req: ChatRequest, res: ChatResult) -> None:
            i = slot[id(req)]
            out[i] = res
            row = self._ledger_row(requests[i], res, attempts[i])
            rows[i] = (row, self.created_at)
            self.sent += 1
            if finished(res):
                md = requests[i].metadata
                o = CallOutcome(key=keys[i], user_id=md["user_id"], episode_id=md.get("unit") or requests[i].request_id,
                                type=md["stage"], status="ok" if res.ok else "error",
                                output={"raw_text": res.raw_text, "finish_reason": res.finish_reason},
                                quarantine=None, ledger=[row], created_at=self.created_at)
                self._restored[keys[i]] = o
                self._used[o.user_id].add(keys[i])
                if self.store is not None:
                    self.store.record(o)
            done[0] += 1
            if self.progress is not None:
                self.progress(stage, done[0], len(requests))
            return None

        try:
            if sending:
                generate_each(self.inner, sending, on_result)
        except LLMError as exc:
            exc.partial_results = list(out)  # type: ignore[attr-defined]
            raise
        finally:
            if self.store is not None:
                self.store.flush()  # every finished call is on disk before this returns or raises
        self._rows.extend(r for r in rows if r is not None)
        return out  # type: ignore[return-value]

    def _replay(self, req: ChatRequest, o: CallOutcome, attempt: int) -> tuple[ChatResult, tuple[dict, datetime]]:
        paid = o.ledger[-1]
        raw, finish = (o.output or {}).get("raw_text") or "", (o.output or {}).get("finish_reason")
        # read again, not copied: a finished output reads as this code reads it
        parsed, error, salvaged = read_output(raw, req.json_schema, finish, req.max_tokens)
        res = ChatResult(req.request_id, parsed, raw, error, prompt_tokens=int(paid.get("prompt_tokens") or 0),
                         completion_tokens=int(paid.get("completion_tokens") or 0),
                         cached_tokens=paid.get("cached_tokens"), latency_s=0.0,
                         attempts=int(paid.get("transport_attempts") or 1), finish_reason=finish, salvaged=salvaged)
        row = {**paid, "request_id": req.request_id, "attempt": attempt}
        return res, (row, o.created_at)

    def _ledger_row(self, req: ChatRequest, res: ChatResult, attempt: int) -> dict[str, Any]:
        md = req.metadata
        return {
            "request_id": req.request_id, "user_id": md["user_id"], "episode_id": None, "type": req.schema_name,
            "attempt": attempt, "status": "ok" if res.ok else "error", "episode_turns": None,
            "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "cached_tokens": res.cached_tokens, "shared_prefix_tokens": None, "latency_s": res.latency_s,
            "transport_attempts": res.attempts, "backend": self.backend_name, "model": self.model_name,
            "prompt_version": self.prompt_version, "stage": md["stage"],
        }

    # -- what the asset writes ----------------------------------------------------------------
    def ledger(self) -> pl.DataFrame:
        """One row per call this run used, in request order (`parsing.LEDGER_SCHEMA`)."""
        rows = [{**{c: r.get(c) for c in LEDGER_SCHEMA.names()}, "code_version": self.code_version, "created_at": at}
                for r, at in self._rows]
        return pl.DataFrame(rows, schema=LEDGER_SCHEMA) if rows else LEDGER_SCHEMA.to_frame()

    def keys_by_user(self, users: list[str]) -> dict[str, set[str]]:
        return {u: set(self._used.get(u, ())) for u in users}

    def compact(self, users: list[str]) -> int:
        """Keep only the checkpoints this run used, per user (one commit)."""
        return -1 if self.store is None else self.store.compact_users(self.keys_by_user(users))

    def summary(self) -> dict[str, Any]:
        """Calls sent and replayed, and tokens per stage (what the asset's metadata shows)."""
        df = self.ledger()
        by_stage = {s: {"calls": int(n), "prompt_tokens": int(p or 0), "completion_tokens": int(c or 0)}
                    for s, n, p, c in df.group_by("stage").agg(pl.len(), pl.col("prompt_tokens").sum(),
                                                                pl.col("completion_tokens").sum()).sort("stage").rows()}
        return {"llm_calls": df.height, "llm_calls_sent": self.sent, "llm_calls_replayed": self.replayed,
                "tokens_by_stage": by_stage}

    def close(self) -> None:
        pass  # the inner backend belongs to its owner
