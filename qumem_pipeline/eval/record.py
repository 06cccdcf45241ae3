"""The evaluation record: every model call an evaluation makes, stored by content, committed to git.

Layout (``eval_record/`` at the repository root, ``RECORD_ROOT``; ``QUMEM_EVAL_RECORD`` or ``--record``
point elsewhere, ``off`` turns it off):

- ``calls/<k[:2]>/<k[2:]>.json.gz`` - one entry per call, gzip (mtime 0) of one JSON object with sorted
  keys. ``k`` = sha256 of the served model id with its dtype (``model``), the decoding parameters
  (``decoding``), ``max_tokens``, the digest of the output schemas (``schema_digest``), the digest of the
  prompt (``prompt_digest``) and, for the n-th identical request of one run (a retry), ``occurrence``.
  The value: the output text, prompt and completion tokens, finish reason (and the stage, the request's
  schema name). Machine-free: the same call answered the same gives the same bytes on every machine, so
  two machines that grow the record add disjoint files and their commits merge without conflicts.
- ``runs/<digest>.json`` - one manifest per recorded run (its settings, conversations and the questions
  each strategy answered), named by its content: what ``--replay-only`` with no other flag replays.
- ``memories/<dataset>/<model>/<conversation>[.s<max sessions>].t<max tokens>.jsonl.gz`` - the memories
  tables a decomposition produced (sorted rows, machine-free columns).
- ``tables/<name>.json`` - each published table: its command and the figures it printed.

A prompt is stored only as its digest, so the record cannot say what an entry was asked; "no current
prompt uses it" is decided by replaying every manifest and table (``qumem eval record prune``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qumem_pipeline.llm.base import (
    ERROR_INVALID_JSON, ERROR_LENGTH, ERROR_SCHEMA, BackendBase, ChatRequest, ChatResult,
    collect_each, generate_each, read_output,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
RECORD_ROOT = REPO_ROOT / "eval_record"
ENV = "QUMEM_EVAL_RECORD"
ERROR_RECORD_MISS = "record_miss"
REPLAYABLE_ERRORS = (ERROR_LENGTH, ERROR_SCHEMA, ERROR_INVALID_JSON)
_QUESTION = re.compile(r"(?:^|/)([^/]+#\d+)(?:/|$)")


def default_root() -> Path | None:
    """The record a CLI run uses: ``$QUMEM_EVAL_RECORD`` (a path, or ``off``), else ``eval_record/``."""
    raw = os.environ.get(ENV)
    if raw is None:
        return RECORD_ROOT
    if raw.strip().lower() in ("", "0", "off", "none", "false", "no"):
        return None
    return Path(raw)


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def digest(obj: Any) -> str:
    return hashlib.sha256(canonical(obj).encode("utf-8")).hexdigest()


def gz_bytes(text: str) -> bytes:
    """gzip with no name and mtime 0: equal text, equal bytes."""
    return gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------ identity


def _unwrap(backend: Any) -> Any:
    seen = 0
    while hasattr(backend, "inner") and backend.inner is not None and seen < 8:
        backend = backend.inner
        seen += 1
    return backend


def model_identity(backend: Any) -> dict:
    """``{"model_name", "model", "decoding"}`` of the backend that answers: ``model`` is the served
    model id with its dtype (``name@dtype``; a served name that carries ``@dtype`` already, as
    vllm-managed names one forced with ``--dtype``, is kept), ``decoding`` what else decides the output."""
    b = _unwrap(backend)
    name = str(b.model_name)
    if "@" in name:
        model = name
    else:
        dtype = None
        cmd = getattr(b, "cmd", None)
        if cmd:
            from qumem_pipeline.llm.vllm_managed import dtype_in

            dtype = dtype_in(cmd)
        if dtype is None:
            torch_model = getattr(b, "model", None)
            dt = getattr(torch_model, "dtype", None)
            dtype = str(dt).replace("torch.", "") if dt is not None else getattr(b, "dtype", None)
        model = f"{name}@{dtype or 'auto'}"
    client = getattr(b, "_client", b)
    if hasattr(client, "temperature"):
        decoding = {"engine": "openai-compatible", "temperature": float(client.temperature),
                    "seed": getattr(client, "seed", None), "compact_json": bool(getattr(client, "compact_json", True))}
    elif getattr(b, "backend_name", "") == "local":
        decoding = {"engine": "transformers", "sampling": "greedy", "grammar": "xgrammar", "compact_json": True}
        if getattr(b, "output_bounds", None):
            decoding["output_bounds"] = b.output_bounds
    else:
        decoding = {"engine": str(getattr(b, "backend_name", "") or type(b).__name__)}
    return {"model_name": name, "model": model, "decoding": decoding}


def call_key(identity: dict, req: ChatRequest, occurrence: int = 0) -> tuple[str, dict]:
    """(key, key fields) of one request to the model ``identity`` names."""
    fields = {"model": identity["model"], "decoding": identity["decoding"], "max_tokens": int(req.max_tokens),
              "schema_digest": digest([req.json_schema, req.decoding_schema]),
              "prompt_digest": digest(req.messages)}
    if occurrence:
        fields["occurrence"] = int(occurrence)
    return digest(fields), fields


def _replayable(res: ChatResult) -> bool:
    if res.ok:
        return True
    return res.error_kind in REPLAYABLE_ERRORS and bool(res.completion_tokens) and res.finish_reason is not None


# ------------------------------------------------------------------------------------ the store


_TOUCHED: dict[Path, set[str]] = {}


class EvalRecord:
    """The record on disk: entries read on demand, written once each."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.calls = self.root / "calls"
        self._cache: dict[str, dict | None] = {}
        # every key asked for, shared by every EvalRecord on this root in the process (``prune`` keeps these)
        self.touched: set[str] = _TOUCHED.setdefault(self.root.resolve(), set())

    def path_of(self, key: str) -> Path:
        return self.calls / key[:2] / f"{key[2:]}.json.gz"

    def get(self, key: str) -> dict | None:
        self.touched.add(key)
        if key not in self._cache:
            p = self.path_of(key)
            self._cache[key] = json.loads(gzip.decompress(p.read_bytes())) if p.is_file() else None
        return self._cache[key]

    def put(self, entry: dict) -> bool:
        """Write an entry unless its key is there (first answer wins); True when written."""
        key = entry["key"]
        if self.get(key) is not None:
            return False
        write_atomic(self.path_of(key), gz_bytes(canonical(entry)))
        self._cache[key] = entry
        return True

    def keys(self) -> list[str]:
        if not self.calls.is_dir():
            return []
        return sorted(d.name + f.name[: -len(".json.gz")] for d in self.calls.iterdir() if d.is_dir()
                      for f in d.iterdir() if f.name.endswith(".json.gz") and not f.name.startswith(".tmp-"))

    def remove(self, key: str) -> None:
        p = self.path_of(key)
        p.unlink(missing_ok=True)
        self._cache.pop(key, None)
        if p.parent.is_dir() and not any(p.parent.iterdir()):
            p.parent.rmdir()

    # -- runs
    def add_run(self, manifest: dict) -> Path:
        text = json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=False) + "\n"
        path = self.root / "runs" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
        if not path.exists():
            write_atomic(path, text.encode("utf-8"))
        return path

    def runs(self) -> list[dict]:
        d = self.root / "runs"
        return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []

    # -- memories
    def memories_path(self, dataset: str, model: str, sample_id: str, max_sessions: int | None, max_tokens: int) -> Path:
        slug = re.sub(r"[^A-Za-z0-9_.@-]+", "_", model)
        name = f"{sample_id}{f'.s{max_sessions}' if max_sessions else ''}.t{int(max_tokens)}.jsonl.gz"
        return self.root / "memories" / Path(dataset).stem / slug / name

    def size(self) -> dict:
        files = [p for p in self.root.rglob("*") if p.is_file()] if self.root.is_dir() else []
        calls = [p for p in files if p.is_relative_to(self.calls)]
        return {"files": len(files), "bytes": sum(p.stat().st_size for p in files), "call_entries": len(calls),
                "call_bytes": sum(p.stat().st_size for p in calls)}


MEMORY_COLUMNS = ("memory_id", "user_id", "episode_id", "type", "content", "evidence_turn_ids", "position",
                  "confidence", "model", "prompt_version")


def write_memories(record: EvalRecord, path: Path, memories) -> bool:
    """The memories of one conversation as sorted, machine-free gzip JSONL; True when the bytes changed."""
    cols = [c for c in MEMORY_COLUMNS if c in memories.columns]
    rows = sorted(memories.select(cols).to_dicts(), key=lambda r: (r["user_id"], str(r.get("memory_id"))))
    data = gz_bytes("".join(canonical(r) + "\n" for r in rows))
    if path.is_file() and path.read_bytes() == data:
        return False
    write_atomic(path, data)
    return True


def episodes_path(record: EvalRecord, dataset: str, classifier_version: str, sample_id: str,
                  max_sessions: int | None) -> Path:
    """Where the episodes a decomposition was asked over live: by the continuity classifier that made them,
    so calls recorded under one classifier still replay after the shipped one changes."""
    name = f"{sample_id}{f'.s{max_sessions}' if max_sessions else ''}.jsonl.gz"
    slug = re.sub(r"[^A-Za-z0-9_.@-]+", "_", classifier_version)
    return record.root / "episodes" / Path(dataset).stem / slug / name


def write_episodes(path: Path, episodes_by_user: dict) -> bool:
    """Every speaker's episodes of one conversation as sorted, machine-free gzip JSONL; True when written."""
    rows = sorted((r for df in episodes_by_user.values() for r in df.to_dicts()),
                  key=lambda r: (r["user_id"], r["episode_index"]))
    data = gz_bytes("".join(canonical(r) + "\n" for r in rows))
    if path.is_file() and path.read_bytes() == data:
        return False
    write_atomic(path, data)
    return True


def read_episodes(path: Path) -> dict:
    """user_id -> episodes frame (the segmentation's schema), as `write_episodes` stored them."""
    import polars as pl

    from qumem_pipeline.episodes.segmentation import EPISODE_SCHEMA

    rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line.strip()]
    strings = {k: pl.String if isinstance(t, pl.Datetime) else t for k, t in EPISODE_SCHEMA.items()}
    df = pl.DataFrame(rows, schema=strings).with_columns(
        pl.col(k).str.to_datetime(time_zone="UTC", time_unit="us") for k, t in EPISODE_SCHEMA.items() if isinstance(t, pl.Datetime))
    return {u: g.sort("episode_index") for (u,), g in df.group_by("user_id", maintain_order=True)}


def read_memories_jsonl(paths: Sequence[Path]):
    import polars as pl

    rows = [json.loads(line) for p in paths for line in gzip.decompress(Path(p).read_bytes()).decode().splitlines()
            if line.strip()]
    return pl.DataFrame(rows, schema_overrides={"evidence_turn_ids": pl.List(pl.Int64)}) if rows else pl.DataFrame()


# ------------------------------------------------------------------------------------ the backend


class RecordBackend(BackendBase):
    """Answers from the record, sends the rest to ``inner`` and records what comes back.

    With ``inner=None`` (``--replay-only``) nothing is sent: a call the record lacks gets an error
    result (``record_miss``) and is listed in ``missing``, so the run goes on and every missing call is
    known at its end. ``tags`` are handed to ``inner`` (the ledger), ``used`` tallies every call behind
    the run's answers as the ledger does."""

    def __init__(self, inner, record: EvalRecord, identity: dict | None = None,
                 conversation_of_user: dict[str, str] | None = None) -> None:
        if inner is None and identity is None:
            raise ValueError("a replay-only record backend needs the model identity to replay")
        self.inner = inner
        self.record = record
        self._identity = identity
        self.backend_name = "record" if inner is None else getattr(inner, "backend_name", "record")
        self.conversation_of_user = dict(conversation_of_user or {})
        self._tags: dict = {}
        self.hits = self.appended = self.sent_here = 0
        self.touched: set[str] = set()
        self.missing: dict[str, dict] = {}
        self._occ: dict[str, int] = defaultdict(int)
        self._earlier: dict[str, list[str]] = {}  # key of an n-th identical request -> keys of the earlier ones
        self.used: dict[str, dict[str, int]] = defaultdict(
            lambda: {"calls": 0, "errors": 0, "salvaged": 0, "prompt_tokens": 0, "completion_tokens": 0})

    # -- pass-through attributes the harness reads
    @property
    def identity(self) -> dict:
        if self._identity is None:
            self._identity = model_identity(self.inner)
        return self._identity

    @property
    def model_name(self) -> str:  # type: ignore[override]
        return self.identity["model_name"]

    @property
    def tags(self) -> dict:
        return self._tags

    @tags.setter
    def tags(self, value: dict) -> None:
        self._tags = dict(value)
        if self.inner is not None and hasattr(self.inner, "tags"):
            self.inner.tags = dict(value)

    @property
    def sent(self) -> int:
        return int(getattr(self.inner, "sent", self.sent_here)) if self.inner is not None else 0

    @property
    def replayed(self) -> int:
        return self.hits + (int(getattr(self.inner, "replayed", 0)) if self.inner is not None else 0)

    @property
    def log(self):
        return getattr(self.inner, "log", None)

    # -- keys
    def _key(self, req: ChatRequest) -> tuple[str, dict]:
        base, _ = call_key(self.identity, req)
        n = self._occ[base]
        self._occ[base] += 1
        key, fields = call_key(self.identity, req, n)
        if n:
            self._earlier[key] = [call_key(self.identity, req, m)[0] for m in range(n - 1, -1, -1)]
        return key, fields

    def _conversation(self, req: ChatRequest) -> str | None:
        if self._tags.get("conversation"):
            return self._tags["conversation"]
        uid = (req.metadata or {}).get("user_id")
        if uid in self.conversation_of_user:
            return self.conversation_of_user[uid]
        m = _QUESTION.search(req.request_id)
        return m.group(1).split("#")[0] if m else None

    def _hit(self, req: ChatRequest, key: str) -> ChatResult | None:
        """The recorded answer to this call; for the n-th identical request of the run, the n-th entry,
        else an earlier one that answered it well: another strategy asking the very same thing (the
        qumem_hybrid strategy's A1/A2 are qumem's) is not paid for again. Only a retry after a bad
        output, whose earlier entries all failed, is sent."""
        self.touched.add(key)
        e = self.record.get(key)
        if e is None:
            return self._answered_earlier(req, key)
        self.hits += 1
        parsed, error, salvaged = read_output(e["output"], req.json_schema, e["finish_reason"], req.max_tokens)
        return ChatResult(req.request_id, parsed, e["output"], error, int(e["prompt_tokens"]),
                          int(e["completion_tokens"]), None, 0.0, 0, e["finish_reason"], salvaged)

    def _answered_earlier(self, req: ChatRequest, key: str) -> ChatResult | None:
        for earlier in self._earlier.get(key, ()):
            e = self.record.get(earlier)
            if e is None:
                continue
            parsed, error, salvaged = read_output(e["output"], req.json_schema, e["finish_reason"], req.max_tokens)
            if error is None:
                self.touched.add(earlier)
                self.hits += 1
                return ChatResult(req.request_id, parsed, e["output"], None, int(e["prompt_tokens"]),
                                  int(e["completion_tokens"]), None, 0.0, 0, e["finish_reason"], salvaged)
        return None

    def _miss(self, req: ChatRequest, key: str) -> ChatResult:
        m = _QUESTION.search(req.request_id)
        self.missing.setdefault(key, {
            "stage": req.schema_name, "strategy": self._tags.get("strategy"), "request_id": req.request_id,
            "conversation": self._conversation(req), "question": m.group(1) if m else None})
        return ChatResult(req.request_id, None, "", f"{ERROR_RECORD_MISS}: no recorded answer for key {key[:16]}")

    def _store(self, req: ChatRequest, key: str, fields: dict, res: ChatResult) -> None:
        if not _replayable(res):
            return
        entry = {**fields, "key": key, "stage": req.schema_name, "output": res.raw_text,
                 "finish_reason": res.finish_reason, "prompt_tokens": int(res.prompt_tokens),
                 "completion_tokens": int(res.completion_tokens)}
        if self.record.put(entry):
            self.appended += 1

    def _tally(self, res: ChatResult) -> None:
        from qumem_pipeline.eval.locomo.qa_ledger import tally_call

        tally_call(self.used, self._tags, res)

    def generate(self, requests: list[ChatRequest]) -> list[ChatResult]:
        return collect_each(self.generate_each, requests)  # each call recorded as it finishes

    def generate_each(self, requests: list[ChatRequest], on_result) -> None:
        keys: dict[int, tuple[str, dict]] = {}

        def drain(reqs: list[ChatRequest]) -> list[ChatRequest]:
            send, queue = [], list(reqs)
            while queue:
                req = queue.pop(0)
                k = self._key(req)
                res = self._hit(req, k[0])
                if res is None and self.inner is None:
                    res = self._miss(req, k[0])
                if res is None:
                    keys[id(req)] = k
                    send.append(req)
                else:
                    self._tally(res)
                    queue.extend(on_result(req, res) or [])
            return send

        def finished(req: ChatRequest, res: ChatResult) -> list[ChatRequest]:
            self.sent_here += 1
            self._store(req, *keys.pop(id(req)), res)
            self._tally(res)
            return drain(on_result(req, res) or [])

        send = drain(requests)
        if send:
            generate_each(self.inner, send, finished)

    def missing_summary(self) -> dict:
        by_stage: dict[str, int] = defaultdict(int)
        by_conv: dict[str, int] = defaultdict(int)
        for m in self.missing.values():
            by_stage[m["stage"]] += 1
            by_conv[m["conversation"] or "?"] += 1
        return {"calls": len(self.missing), "by_stage": dict(sorted(by_stage.items())),
                "by_conversation": dict(sorted(by_conv.items()))}

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def format_missing(backend: RecordBackend, limit: int = 40) -> str:
    """The calls a replay could not answer: counts by stage and conversation, then the first ``limit``."""
    s = backend.missing_summary()
    lines = [f"replay-only: {s['calls']} model call(s) are not in the record {backend.record.root}",
             f"  by stage: {json.dumps(s['by_stage'])}", f"  by conversation: {json.dumps(s['by_conversation'])}"]
    for key, m in sorted(backend.missing.items(), key=lambda kv: (str(kv[1]["conversation"]), kv[1]["request_id"]))[:limit]:
        lines.append(f"  missing {key[:16]} {m['stage']:<16} {m['strategy'] or '-':<14} {m['request_id']}")
    if s["calls"] > limit:
        lines.append(f"  ... and {s['calls'] - limit} more")
    lines.append("grow the record with the same command without --replay-only (a model runs), then commit eval_record/")
    return "\n".join(lines)


def identity_from_runs(record: EvalRecord, dataset: str | None = None, model: str | None = None) -> dict:
    """The one model identity the record's runs used (on ``dataset`` when given), or the one ``model`` names."""
    seen: dict[str, dict] = {}
    for r in record.runs():
        if dataset is None or r.get("dataset") == Path(dataset).name:
            ident = {"model_name": r["model_name"], "model": r["model"], "decoding": r["decoding"]}
            seen[digest(ident)] = ident
    if model is not None:
        seen = {k: v for k, v in seen.items() if model in (v["model"], v["model_name"])}
    if len(seen) != 1:
        names = sorted(v["model"] for v in seen.values())
        raise SystemExit(f"replay-only: the record {record.root} has {len(seen)} model(s) for this dataset "
                         f"{names}; name one with --replay-model" if seen else
                         f"replay-only: the record {record.root} has no recorded run for this dataset")
    return next(iter(seen.values()))


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


Replayer = Callable[[list[str]], tuple[int, dict | None, "RecordBackend | None"]]
