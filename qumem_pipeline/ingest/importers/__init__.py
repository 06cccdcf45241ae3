"""Format importers: each turns one source format into the raw turn frame (see base.py).

``import_archive(path)`` picks the importer from ``detect_format(path)``: ``locomo`` and
``chatgpt`` JSON files, ``personamem`` contexts (either layout), or canonical ``jsonl`` / ``parquet`` (a file, a directory or a glob,
handled by ``importers.canonical``, imported lazily).
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from qumem_pipeline.ingest.importers.base import ImportResult, ParseFailure
from qumem_pipeline.ingest.importers.chatgpt import import_chatgpt
from qumem_pipeline.ingest.importers.locomo import import_locomo
from qumem_pipeline.ingest.importers.personamem import import_personamem, is_personamem

IMPORTERS = {"locomo": import_locomo, "chatgpt": import_chatgpt, "personamem": import_personamem}
FORMATS = ("locomo", "chatgpt", "personamem", "jsonl", "parquet")
# formats read one whole file at a time by their importer (never split into canonical line batches)
WHOLE_FILE_FORMATS = tuple(IMPORTERS)

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.txt")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_PEEK_BYTES = 1 << 20


def _by_suffix(name: str) -> str | None:
    name = name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    return None


def _json_kind(obj: object) -> str | None:
    first = obj[0] if isinstance(obj, list) and obj else obj
    if isinstance(first, dict):
        if "mapping" in first or "current_node" in first:
            return "chatgpt"
        if "conversation" in first or "sample_id" in first:
            return "locomo"
    return None


def _peek_json(path: Path) -> str | None:
    with open(path, "rb") as f:
        head = f.read(_PEEK_BYTES)
    if b'"mapping"' in head and b'"current_node"' in head:
        return "chatgpt"
    if b'"sample_id"' in head or (b'"speaker_a"' in head and b'"conversation"' in head):
        return "locomo"
    try:  # markers not in the first MiB: read it all
        return _json_kind(json.loads(path.read_bytes()))
    except (ValueError, UnicodeDecodeError):
        return None


def detect_format(path: str | os.PathLike) -> str:
    """'locomo', 'chatgpt', 'personamem', 'jsonl' or 'parquet' for a file, a directory or a glob.

    Raises ValueError when the format cannot be told (say which with ``fmt=``).
    """
    p = Path(path)
    if p.is_file():
        if is_personamem(p):  # a JSONL file too: one {context_id: [messages]} per line
            return "personamem"
        kind = _by_suffix(p.name)
        if kind:
            return kind
        if p.name.lower().endswith(".json"):
            kind = _peek_json(p)
            if kind:
                return kind
        raise ValueError(f"{p}: cannot tell the archive format (expected LoCoMo or ChatGPT JSON, JSONL or Parquet)")
    if p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file()]
    else:
        files = [Path(m) for m in glob.glob(str(path), recursive=True) if Path(m).is_file()]
        if not files:
            raise FileNotFoundError(f"no archive files found at {path!s}")
    kinds = {k for k in (_by_suffix(f.name) for f in files) if k}
    if len(kinds) == 1:
        return kinds.pop()
    if not kinds:
        raise ValueError(f"{path}: no .jsonl/.ndjson or .parquet files (LoCoMo / ChatGPT JSON: pass the file itself)")
    # both: the canonical importer reads either kind of file from one directory
    return "jsonl"


def import_archive(path: str | os.PathLike, fmt: str | None = None, **kw) -> ImportResult:
    """Import `path` with the importer for `fmt` (detected when not given)."""
    fmt = fmt or detect_format(path)
    if fmt in IMPORTERS:
        return IMPORTERS[fmt](str(path), **kw)
    if fmt in ("jsonl", "parquet"):
        from qumem_pipeline.ingest.importers.canonical import import_canonical

        return import_canonical(path, **kw)
    raise ValueError(f"unknown archive format {fmt!r}; expected one of {', '.join(FORMATS)}")


__all__ = [
    "IMPORTERS",
    "FORMATS",
    "ImportResult",
    "ParseFailure",
    "detect_format",
    "import_archive",
    "import_chatgpt",
    "import_locomo",
    "import_personamem",
    "WHOLE_FILE_FORMATS",
]
