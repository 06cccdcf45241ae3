"""Validation of decomposer output into memory rows, and the output tables' schemas, apart from the call loop."""

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import polars as pl

from qumem_pipeline.memories.grounding import supporting_turns
from qumem_pipeline.memories.prompts import MAX_EVIDENCE_IDS, Episode
from qumem_pipeline.memories.readability import has_repeated_phrase, has_template_slot, is_near_empty

# -- output tables ----------------------------------------------------------------------------
MEMORY_SCHEMA = pl.Schema(
    {
        "memory_id": pl.String,
        "user_id": pl.String,
        "type": pl.String,
        "content": pl.String,
        "episode_id": pl.String,
        "evidence_turn_ids": pl.List(pl.Int64),
        "position": pl.Int64,
        "valid_from": pl.Datetime("us", "UTC"),
        "model": pl.String,
        "prompt_version": pl.String,
        "code_version": pl.String,
        "created_at": pl.Datetime("us", "UTC"),
    }
)

DECOMPOSE_QUARANTINE_SCHEMA = pl.Schema(
    {
        "user_id": pl.String,
        "episode_id": pl.String,
        "type": pl.String,
        "request_id": pl.String,
        "reason": pl.String,
        "raw": pl.String,
        "attempts": pl.Int64,
        "model": pl.String,
        "prompt_version": pl.String,
        "code_version": pl.String,
        "created_at": pl.Datetime("us", "UTC"),
    }
)

LEDGER_SCHEMA = pl.Schema(
    {
        "request_id": pl.String,
        "user_id": pl.String,
        "episode_id": pl.String,
        "type": pl.String,
        "attempt": pl.Int64,  # 1 = first call, 2 = the retry after bad output
        "status": pl.String,  # ok | retried | quarantined
        "episode_turns": pl.Int64,
        "prompt_tokens": pl.Int64,
        "completion_tokens": pl.Int64,
        "cached_tokens": pl.Int64,  # as reported by the server; null when it reports none
        "shared_prefix_tokens": pl.Int64,  # prompt tokens shared by the episode's three calls
        "latency_s": pl.Float64,
        "transport_attempts": pl.Int64,
        "backend": pl.String,
        "model": pl.String,
        "prompt_version": pl.String,
        # which LLM stage paid for the call: decompose | persona_merge | a1 | a2 | a3 | research | qa
        # (null in rows written before the column existed: all of them decompose)
        "stage": pl.String,
        "code_version": pl.String,
        "created_at": pl.Datetime("us", "UTC"),
    }
)


# -- memory rows ------------------------------------------------------------------------------
def unreadable(content: str) -> str | None:
    """Why no reader can use this memory (readability.py's rules), or None: "slot" ("[user_name]"),
    "near_empty" (fewer than 3 content words), "repeat" (a phrase said 3 times)."""
    if has_template_slot(content):
        return "slot"
    if is_near_empty(content):
        return "near_empty"
    if has_repeated_phrase(content):
        return "repeat"
    return None


_WS = re.compile(r"\s+")


def normalize_content(text: str) -> str:
    t = unicodedata.normalize("NFKC", text).casefold()
    t = _WS.sub(" ", t).strip()
    return t.rstrip(" .!;,")


def memory_id(user_id: str, episode_id: str, mem_type: str, content: str) -> str:
    key = "\x1f".join([user_id, episode_id, mem_type, normalize_content(content)])
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


@dataclass
class DecomposeStats:
    episodes: int = 0
    turns: int = 0
    calls: int = 0
    retries: int = 0
    quarantined: int = 0
    memories: int = 0
    duplicates_collapsed: int = 0
    evidence_ids_dropped: int = 0
    memories_dropped_no_evidence: int = 0
    memories_dropped_empty: int = 0
    # the small model's gate (model_profiles.ModelProfile.memory_gate): unreadable memories, by rule
    memories_dropped_slot: int = 0
    memories_dropped_near_empty: int = 0
    memories_dropped_repeat: int = 0
    memories_dropped_ungrounded: int = 0  # its words mostly absent from its episode (memories/grounding.py)
    reused_calls: int = 0  # ledger rows restored from a checkpoint instead of sent again

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def memories_from_output(
    ep: Episode,
    mem_type: str,
    parsed: dict[str, Any],
    stats: DecomposeStats,
    *,
    model: str,
    prompt_version: str,
    code_version: str,
    created_at: datetime,
    gate: bool = False,
) -> list[dict[str, Any]]:
    """The call's memories as rows; ``gate`` (the small model's): drop (and count) the ones ``unreadable`` names
    and those their episode does not ground, and cite the turns that hold each kept one's words."""
    by_index = {t.turn_index: t for t in ep.turns}
    merged: dict[str, dict[str, Any]] = {}
    for item in parsed.get("memories") or []:
        content = " ".join(str(item.get("content") or "").split())
        if not normalize_content(content):
            stats.memories_dropped_empty += 1
            continue
        why = unreadable(content) if gate else None
        if why:
            setattr(stats, f"memories_dropped_{why}", getattr(stats, f"memories_dropped_{why}") + 1)
            continue
        ids = []
        for raw_id in item.get("evidence_turn_ids") or []:
            if isinstance(raw_id, int) and not isinstance(raw_id, bool) and raw_id in by_index:
                ids.append(raw_id)
            else:
                stats.evidence_ids_dropped += 1
        if gate:  # the small model's citations are repaired from the episode's words, or the memory is invented
            ids = supporting_turns(content, ids, ep.turns, MAX_EVIDENCE_IDS)
            if ids is None:
                stats.memories_dropped_ungrounded += 1
                continue
        if not ids:
            stats.memories_dropped_no_evidence += 1
            continue
        mid = memory_id(ep.user_id, ep.episode_id, mem_type, content)
        if mid in merged:
            stats.duplicates_collapsed += 1
            merged[mid]["evidence_turn_ids"] = sorted(set(merged[mid]["evidence_turn_ids"]) | set(ids))
            continue
        merged[mid] = {"memory_id": mid, "content": content, "evidence_turn_ids": sorted(set(ids))}
    rows = []
    for m in merged.values():
        position = max(m["evidence_turn_ids"])
        ts = by_index[position].timestamp
        rows.append(
            {
                "memory_id": m["memory_id"],
                "user_id": ep.user_id,
                "type": mem_type,
                "content": m["content"],
                "episode_id": ep.episode_id,
                "evidence_turn_ids": m["evidence_turn_ids"],
                "position": position,
                "valid_from": ts,
                "model": model,
                "prompt_version": prompt_version,
                "code_version": code_version,
                "created_at": created_at,
            }
        )
    return rows
