"""Append-only JSONL logs and the ledger backend, so a resumed QA run replays finished calls instead of paying twice."""

import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from qumem_pipeline.llm.base import (
    ERROR_INVALID_JSON, ERROR_LENGTH, ERROR_SCHEMA, BackendBase, ChatRequest, ChatResult, generate_each,
    collect_each, read_output,
)


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


# Errors the model's own output made (a cut at the token budget, JSON off the schema): the same
# request gets the same answer at temperature 0, so a rerun replays them. Transport and HTTP
# failures and timeouts produced no answer and are sent again.
REPLAYABLE_ERRORS = (ERROR_LENGTH, ERROR_SCHEMA, ERROR_INVALID_JSON)


def _replayable(row: dict) -> bool:
    if row["status"] == "ok":
        return True
    kind = (row.get("error") or "").split(":", 1)[0]
    return kind in REPLAYABLE_ERRORS and bool(row.get("completion_tokens")) and row.get("finish_reason") is not None


class LedgerBackend(BackendBase):
    """Wraps the run's backend: every call it sends is a ledger row, and a rerun pays for no finished call
    twice. The n-th call of a request this run replays the n-th ledger row of that request when that one
    finished (an answer, or an error of the model's own output), so a retry after a failure is replayed
    as the retry, and a run resumed or repeated makes exactly the calls, and gets exactly the results,
    of the first."""

    def __init__(self, inner, ledger_path: str | os.PathLike) -> None:
        self.inner = inner
        self.model_name = inner.model_name
        self.backend_name = inner.backend_name
        self.log = JsonlLog(ledger_path)
        self.tags: dict = {}
        self.sent = self.replayed = 0
        # strategy -> what the calls behind this run's answers returned, replayed or sent (the ledger
        # holds every call ever paid for, other runs' included)
        self.used: dict[str, dict[str, int]] = defaultdict(
            lambda: {"calls": 0, "errors": 0, "salvaged": 0, "prompt_tokens": 0, "completion_tokens": 0})
        self._rows: dict[str, list[dict]] = defaultdict(list)  # fingerprint -> finished rows, in call order
        self._seen: dict[str, int] = defaultdict(int)  # fingerprint -> calls made this run
        self._attempts: dict[str, int] = defaultdict(int)
        for row in self.log.rows():
            self._attempts[row["fingerprint"]] += 1
            if row.get("model") == self.model_name and _replayable(row):
                self._rows[row["fingerprint"]].append(row)

    def _replay(self, req: ChatRequest, fp: str) -> ChatResult | None:
        """The ledger's answer to this call (the n-th of its request this run), or None: it must be sent.
        Past the rows of that request, its latest good answer: another strategy asking the very same
        thing (qumem_hybrid's A1/A2 are qumem's) is not paid for twice; a retry after a bad output is."""
        nth = self._seen[fp]
        self._seen[fp] += 1
        rows = self._rows.get(fp, [])
        if nth >= len(rows):
            good = [r for r in rows if r["status"] == "ok"]
            if not good:
                return None
            row = good[-1]
        else:
            row = rows[nth]
        self.replayed += 1
        # read again, not copied: a finished output reads as this code reads it (a salvage added later included)
        parsed, error, salvaged = read_output(row["raw_text"], req.json_schema, row["finish_reason"], req.max_tokens)
        return ChatResult(req.request_id, parsed, row["raw_text"], error, row["prompt_tokens"],
                          row["completion_tokens"], row["cached_tokens"], 0.0, 0, row["finish_reason"], salvaged)

    def _row(self, req: ChatRequest, fp: str, res: ChatResult, now: str) -> dict:
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
            "salvaged": res.salvaged,
            "raw_text": res.raw_text, "parsed": json.dumps(res.parsed) if res.parsed is not None else None,
        }
        if _replayable(row):
            self._rows[fp].append(row)
        self.sent += 1
        return row

    def _tally(self, res: ChatResult) -> None:
        tally_call(self.used, self.tags, res)

    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        return collect_each(self.generate_each, requests)  # each call a ledger row as it finishes

    def generate_each(self, requests: list[ChatRequest], on_result) -> None:
        """Replayed calls handed over at once, the rest sent through the inner backend's own
        ``generate_each`` (a bounded number in flight), each one a ledger row the moment it finishes:
        a killed decomposition loses no finished call, and no batch waits on its slowest call."""
        def drain(reqs: list[ChatRequest]) -> list[ChatRequest]:
            send, queue = [], list(reqs)
            while queue:
                req = queue.pop(0)
                res = self._replay(req, request_fingerprint(self.model_name, req))
                if res is None:
                    send.append(req)
                else:
                    self._tally(res)
                    queue.extend(on_result(req, res) or [])
            return send

        def finished(req: ChatRequest, res: ChatResult) -> list[ChatRequest]:
            fp = request_fingerprint(self.model_name, req)
            self.log.append([self._row(req, fp, res, datetime.now(timezone.utc).isoformat())])
            self._tally(res)
            return drain(on_result(req, res) or [])

        send = drain(requests)
        if send:
            generate_each(self.inner, send, finished)

    def close(self) -> None:
        self.inner.close()


def tally_call(used: dict[str, dict[str, int]], tags: dict, res: ChatResult) -> None:
    """Count one answered call under its strategy tag (the QA report's llm_calls per strategy)."""
    tally = used[tags.get("strategy") or "?"]
    tally["calls"] += 1
    tally["errors"] += not res.ok
    tally["salvaged"] += res.salvaged
    tally["prompt_tokens"] += res.prompt_tokens
    tally["completion_tokens"] += res.completion_tokens
