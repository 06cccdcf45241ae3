"""ChatGPT's data export (``conversations.json``): the format people actually download.

The file is a JSON list of conversations ``{title, create_time, update_time, mapping,
current_node, conversation_id | id, ...}``. ``mapping`` is a tree of nodes
``{id, message | null, parent, children}``; edits and regenerations create side branches, and
the conversation the person saw is the branch that ends at ``current_node``. We walk the parents
up from ``current_node`` and reverse: side branches are not imported (they are counted).

Mapping onto the raw turn frame:

- Roles: ``user`` -> user, ``assistant`` -> assistant, ``tool`` -> other; any other role is passed
  through unchanged so validation quarantines it. ``system`` messages are skipped.
- Skipped, and counted in ChatGPTImportStats (not failures: the export is fine, these nodes are
  just not conversation turns): nodes without a message (the root), system messages, nodes with
  ``metadata.is_visually_hidden_from_conversation``, content types without string parts (code,
  execution_output, thoughts, user_editable_context, ...), and messages whose text is empty
  (e.g. the blank assistant message before a tool call).
- Text = the string parts joined by newlines; an image part (``image_asset_pointer``) becomes
  ``[image]``, an audio transcription its text, other audio / video pointers ``[audio]`` /
  ``[video]``, any other non-string part ``[<content_type>]``.
- The export carries no user id: ``user_id`` is the argument, else the name of the file's parent
  directory (validated later, like every user id).
- ``conversation_id`` = the conversation's ``conversation_id`` (or ``id``); ``session_id`` = the
  same; ``timestamp`` = the message's ``create_time`` (epoch seconds) as text, null when absent;
  ``source_ref`` = the message id; ``speaker`` = ``author.name`` when set (tool names such as
  ``python``), else the role; ``source_row`` = 1-based position of the conversation in the file.
- ``turn_index`` = position in the user's whole history: conversations in ``create_time`` order
  (file order for ties / missing times), messages in branch order.
- A malformed conversation (not an object, no id, missing/invalid ``mapping``, ``current_node``
  not in the mapping, a broken parent chain, a cycle) becomes ONE ParseFailure naming the
  conversation; the other conversations still import.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from qumem_pipeline.ingest.importers.base import ImportResult, ParseFailure, escape_raw, raw_frame

ROLE_MAP = {"user": "user", "assistant": "assistant", "tool": "other"}
TEXT_CONTENT_TYPES = ("text", "multimodal_text")


@dataclass
class ChatGPTImportStats:
    conversations: int = 0  # conversations in the file
    imported_conversations: int = 0
    failed_conversations: int = 0  # each is one ParseFailure
    messages_imported: int = 0
    off_branch_nodes: int = 0  # nodes of edits / regenerations not on the current_node branch
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count (on-branch nodes only)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


class _Malformed(Exception):
    def __init__(self, field_name: str, reason: str):
        super().__init__(reason)
        self.field_name = field_name
        self.reason = reason


def import_chatgpt(path: str, user_id: str | None = None) -> ImportResult:
    """Import a ChatGPT ``conversations.json`` export (see the module docstring)."""
    return import_chatgpt_with_stats(path, user_id)[0]


def default_user_id(path: str) -> str:
    """The user id an export gets without an explicit one: its parent directory's name."""
    return Path(os.path.abspath(path)).parent.name


def import_chatgpt_with_stats(path: str, user_id: str | None = None) -> tuple[ImportResult, ChatGPTImportStats]:
    src = str(path)
    uid = user_id if user_id is not None else default_user_id(path)
    stats = ChatGPTImportStats()
    data = Path(path).read_bytes()
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        f = ParseFailure(src, None, "(file)", f"not valid UTF-8 at byte {e.start}", escape_raw(data[:4096]), user_id=uid)
        return ImportResult(raw=raw_frame([]), failures=[f]), stats
    except json.JSONDecodeError as e:
        f = ParseFailure(src, None, "(file)", f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                         escape_raw(data[:4096]), user_id=uid)
        return ImportResult(raw=raw_frame([]), failures=[f]), stats
    if isinstance(obj, dict) and "mapping" in obj:
        obj = [obj]
    if not isinstance(obj, list):
        f = ParseFailure(src, None, "(file)", f"expected a JSON list of conversations, got {type(obj).__name__}",
                         escape_raw(data[:4096]), user_id=uid)
        return ImportResult(raw=raw_frame([]), failures=[f]), stats

    failures: list[ParseFailure] = []
    parsed: list[tuple[float | None, int, list[dict]]] = []
    for row, conv in enumerate(obj, start=1):
        stats.conversations += 1
        try:
            turns = _conversation_turns(conv, stats)
        except _Malformed as m:
            stats.failed_conversations += 1
            failures.append(
                ParseFailure(src, row, m.field_name, f"conversation {_name(conv, row)}: {m.reason}",
                             escape_raw(json.dumps(conv, ensure_ascii=False, default=str)), user_id=uid)
            )
            continue
        stats.imported_conversations += 1
        created = conv.get("create_time")
        created = float(created) if isinstance(created, (int, float)) and not isinstance(created, bool) else None
        for t in turns:
            t["source_row"] = row
        parsed.append((created, row, turns))

    # conversations in creation order (missing times keep file order, after dated ones)
    parsed.sort(key=lambda c: (c[0] is None, c[0] if c[0] is not None else 0.0, c[1]))
    records: list[dict] = []
    for _, _, turns in parsed:
        for t in turns:
            t["turn_index"] = len(records)
            t["user_id"] = uid
            t["source_file"] = src
            records.append(t)
    stats.messages_imported = len(records)
    return ImportResult(raw=raw_frame(records), failures=failures), stats


def _name(conv: object, row: int) -> str:
    if isinstance(conv, dict):
        cid = conv.get("conversation_id") or conv.get("id")
        title = conv.get("title")
        if cid or title:
            return f"{cid!s} ({title!r})" if title else str(cid)
    return f"#{row}"


def _branch(mapping: dict, current: object) -> list[dict]:
    """Nodes from the root to current_node, following parents; raise _Malformed when broken."""
    if not isinstance(current, str) or current not in mapping:
        raise _Malformed("current_node", f"current_node {current!r} is not a node of the mapping")
    path: list[dict] = []
    seen: set[str] = set()
    node_id: object = current
    while node_id is not None:
        if not isinstance(node_id, str) or node_id not in mapping:
            raise _Malformed("mapping", f"broken parent chain: node {node_id!r} is not in the mapping")
        if node_id in seen:
            raise _Malformed("mapping", f"cycle in the parent chain at node {node_id!r}")
        seen.add(node_id)
        node = mapping[node_id]
        if not isinstance(node, dict):
            raise _Malformed("mapping", f"node {node_id!r} is {type(node).__name__}, expected an object")
        path.append(node)
        node_id = node.get("parent")
    path.reverse()
    return path


def _part_text(part: object) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        ctype = part.get("content_type")
        if ctype == "audio_transcription" and isinstance(part.get("text"), str):
            return part["text"]
        kind = ctype if isinstance(ctype, str) else ""
        if "audio" in kind:
            return "[audio]"
        if "video" in kind:
            return "[video]"
        if kind == "image_asset_pointer" or "asset_pointer" in part:
            return "[image]"
        return f"[{ctype}]" if isinstance(ctype, str) and ctype else "[attachment]"
    return None


def _conversation_turns(conv: object, stats: ChatGPTImportStats) -> list[dict]:
    if not isinstance(conv, dict):
        raise _Malformed("(conversation)", f"is {type(conv).__name__}, expected an object")
    cid = conv.get("conversation_id") or conv.get("id")
    if not isinstance(cid, str) or not cid.strip():
        raise _Malformed("conversation_id", "has no conversation_id / id")
    mapping = conv.get("mapping")
    if not isinstance(mapping, dict) or not mapping:
        raise _Malformed("mapping", "mapping is missing or not an object")
    branch = _branch(mapping, conv.get("current_node"))
    stats.off_branch_nodes += len(mapping) - len(branch)

    turns: list[dict] = []
    for node in branch:
        msg = node.get("message")
        if msg is None:
            stats.skip("no_message")
            continue
        if not isinstance(msg, dict):
            raise _Malformed("message", f"node {node.get('id')!r}: message is {type(msg).__name__}, expected an object")
        author = msg.get("author") if isinstance(msg.get("author"), dict) else {}
        role = author.get("role")
        if role == "system":
            stats.skip("system")
            continue
        meta = msg.get("metadata") if isinstance(msg.get("metadata"), dict) else {}
        if meta.get("is_visually_hidden_from_conversation"):
            stats.skip("hidden")
            continue
        content = msg.get("content") if isinstance(msg.get("content"), dict) else {}
        ctype = content.get("content_type")
        parts = content.get("parts") if isinstance(content.get("parts"), list) else []
        if ctype not in TEXT_CONTENT_TYPES and not any(isinstance(p, str) for p in parts):
            stats.skip(f"content_type:{ctype}")
            continue
        pieces = [t for t in (_part_text(p) for p in parts) if t is not None and t.strip()]
        text = "\n".join(pieces)
        if not text.strip():
            stats.skip("empty")
            continue
        created = msg.get("create_time")
        if isinstance(created, bool) or created is None:
            ts = None
        elif isinstance(created, (int, float, str)):
            ts = str(created)
        else:
            ts = None
        name = author.get("name")
        turns.append(
            {
                "conversation_id": cid,
                "session_id": cid,
                "role": ROLE_MAP.get(role, role) if isinstance(role, str) else None,
                "speaker": name if isinstance(name, str) and name else (role if isinstance(role, str) else None),
                "text": text,
                "timestamp": ts,
                "source_ref": str(msg.get("id") or node.get("id")),
            }
        )
    return turns


__all__ = ["import_chatgpt", "import_chatgpt_with_stats", "ChatGPTImportStats", "default_user_id"]
