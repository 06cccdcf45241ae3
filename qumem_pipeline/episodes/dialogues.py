"""Readers for dialogue-segmentation reference files.

Both formats are turned into :class:`Dialogue` objects, whose ``boundaries`` list has one entry per
*gap* between adjacent utterances (``n - 1`` entries for ``n`` utterances): ``boundaries[i] == 1``
means utterance ``i + 1`` starts a new segment.

Formats
- ``tiage``: ``{dialog_id: [[utterance, label], ...]}``; label ``"1"`` = starts a new topic,
  ``"0"`` = continues, ``"-1"`` = first utterance (a "1"/"-1" on the first utterance is ignored: the
  first utterance always opens a segment). Labels may be strings or ints.
- ``segments``: ``[{"dial_id", "utterances": [str, ...], "segments": [len, ...]}, ...]``, consecutive
  segment lengths (a boundary after each segment but the last). Also accepted: a dict
  ``{dial_id: {"utterances", "segments"}}``, or a top-level ``{"dialogues": [...]}`` wrapper; ``dial_id``
  may be missing (the list index is used). When the segment lengths do not sum to the number of
  utterances the dialogue is still read: lengths are clipped/extended to fit, and a warning is counted
  in :attr:`ReadResult.warnings`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMATS = ("tiage", "segments")


@dataclass
class Dialogue:
    dial_id: str
    utterances: list[str]
    boundaries: list[int]  # len == len(utterances) - 1 (0 for an empty dialogue)

    def __post_init__(self) -> None:
        want = max(0, len(self.utterances) - 1)
        if len(self.boundaries) != want:
            raise ValueError(
                f"dialogue {self.dial_id}: {len(self.boundaries)} boundaries for "
                f"{len(self.utterances)} utterances (want {want})"
            )

    @property
    def n_segments(self) -> int:
        return (1 + sum(self.boundaries)) if self.utterances else 0

    def segment_lengths(self) -> list[int]:
        return boundaries_to_masses(self.boundaries) if self.utterances else []


@dataclass
class ReadResult:
    dialogues: list[Dialogue]
    fmt: str
    warnings: list[str] = field(default_factory=list)


def masses_to_boundaries(masses: list[int], n: int) -> tuple[list[int], bool]:
    """Segment lengths -> gap boundaries for ``n`` utterances. Returns (boundaries, consistent)."""
    b = [0] * max(0, n - 1)
    pos = 0
    for m in masses[:-1] if masses else []:
        pos += int(m)
        if 0 < pos < n:
            b[pos - 1] = 1
    consistent = sum(int(m) for m in masses) == n and all(int(m) > 0 for m in masses)
    return b, consistent


def boundaries_to_masses(boundaries: list[int]) -> list[int]:
    masses, cur = [], 1
    for x in boundaries:
        if x:
            masses.append(cur)
            cur = 1
        else:
            cur += 1
    masses.append(cur)
    return masses


def _text(x: Any) -> str:
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    if isinstance(x, dict):  # {"text": ...} / {"utterance": ...} style turns
        for key in ("text", "utterance", "content"):
            if key in x:
                return _text(x[key])
    return str(x)


def detect_format(data: Any) -> str:
    if isinstance(data, dict) and "dialogues" in data and isinstance(data["dialogues"], list):
        return "segments"
    items = data if isinstance(data, list) else list(data.values()) if isinstance(data, dict) else []
    for item in items:
        if isinstance(item, dict) and ("segments" in item or "utterances" in item):
            return "segments"
        if isinstance(item, list):
            if not item:
                continue
            first = item[0]
            if isinstance(first, (list, tuple)) and len(first) >= 2:
                return "tiage"
        break
    raise ValueError(
        "cannot detect the format: expected TIAGE {id: [[utterance, label], ...]} or a segments "
        "list [{dial_id, utterances, segments}, ...]; pass fmt explicitly"
    )


def parse_tiage(data: dict) -> ReadResult:
    if not isinstance(data, dict):
        raise ValueError("TIAGE format must be a JSON object {dialog_id: [[utterance, label], ...]}")
    out, warnings = [], []
    for did, turns in data.items():
        utts, bounds = [], []
        for j, turn in enumerate(turns or []):
            utt, label = (turn[0], turn[1]) if len(turn) >= 2 else (turn[0] if turn else "", "0")
            utts.append(_text(utt))
            if j > 0:
                try:
                    lab = int(str(label).strip())
                except ValueError:
                    warnings.append(f"{did}[{j}]: unreadable label {label!r} read as 0")
                    lab = 0
                bounds.append(1 if lab == 1 else 0)
        out.append(Dialogue(str(did), utts, bounds))
    return ReadResult(out, "tiage", warnings)


def parse_segments(data: Any) -> ReadResult:
    if isinstance(data, dict) and isinstance(data.get("dialogues"), list):
        data = data["dialogues"]
    if isinstance(data, dict):
        items = [dict(v, dial_id=v.get("dial_id", k)) for k, v in data.items()]
    elif isinstance(data, list):
        items = data
    else:
        raise ValueError("segments format must be a JSON list of {dial_id, utterances, segments}")
    out, warnings = [], []
    for i, item in enumerate(items):
        did = str(item.get("dial_id", item.get("id", i)))
        utts = [_text(u) for u in (item.get("utterances") or [])]
        masses = [int(m) for m in (item.get("segments") or [])]
        if not masses and utts:
            masses = [len(utts)]
            warnings.append(f"{did}: no segments given; read as one segment")
        bounds, ok = masses_to_boundaries(masses, len(utts))
        if not ok:
            warnings.append(
                f"{did}: segment lengths {masses} do not partition {len(utts)} utterances"
            )
        out.append(Dialogue(did, utts, bounds))
    return ReadResult(out, "segments", warnings)


def read_dialogues(path: str | Path, fmt: str | None = None) -> ReadResult:
    """Read a reference file; ``fmt`` is ``"tiage"``, ``"segments"`` or ``None`` (auto-detect)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return parse_dialogues(data, fmt)


def parse_dialogues(data: Any, fmt: str | None = None) -> ReadResult:
    fmt = fmt or detect_format(data)
    if fmt == "tiage":
        return parse_tiage(data)
    if fmt == "segments":
        return parse_segments(data)
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
