"""What a run made, read back from the DuckDB warehouse: the end-of-run summary of `qumem run` and the
per-user view of `qumem show USER_ID`, as rich tables for people and as a dict (JSON) for scripts.

The figures are the warehouse's rows of the run's users: users, turns, quarantined rows, episodes,
memories by type, query states, persona profiles and the LLM calls and tokens by stage (`llm_ledger`,
whose `stage` column names decompose / persona_merge / a1 / a2 / a3 ...). The caller adds what only
the orchestrator knows (wall time by stage, run ids, locations). Samples (one memory and one state
with its citations per user) are printed, never written to the JSON file: a file of user text outside
the tables would outlive `qumem forget`.

It sits above the stages it reports on (it reads the memories stage's types), beside the CLI.
"""

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from qumem_pipeline.contracts.ids import USER_ID_PATTERN
from qumem_pipeline.memories.decompose import MEMORY_TYPES

SAMPLE_USERS = 5  # users with a sample memory and state in the summary; the rest are counted
TEXT_CHARS = 160  # a sample's text is cut here in the summary (`qumem show` prints it whole)

EMBEDDED_NOTE = (
    "Quality: these memories and states come from the embedded SmolLM2-135M-Instruct, a 135M-parameter model "
    "run on CPU, decoding against schema bounds cut to a third of the items and half the length (it fills "
    "every field to its bound). Expect weak memories (many read \"The user...\" or repeat one phrase) and states "
    "that say little: this run shows that the pipeline works, not what it can find. For real output, point the LLM "
    "stages at an OpenAI-compatible server (e.g. vLLM): "
    "QUMEM_LLM_KIND=openai QUMEM_LLM_BASE_URL=http://HOST:8000/v1 .venv/bin/qumem run  (docs/models.md)."
)
# Rows of `quarantine` that belong to no user (no or invalid id), as the warehouse loads them.
UNATTRIBUTED_SQL = "user_id IS NULL OR NOT regexp_full_match(user_id, ?) OR contains(user_id, '..')"


def quality_note(models: Sequence[dict]) -> str:
    """The honest note on output quality for the models that wrote the run's LLM calls."""
    if not models:
        return "Quality: no LLM call was made for these users (no episodes or no queries)."
    embedded = [m for m in models if m.get("backend") == "local" or "smollm2" in str(m.get("model", "")).lower()]
    if any("smollm2" in str(m.get("model", "")).lower() for m in embedded):
        return EMBEDDED_NOTE
    if embedded:
        names = ", ".join(sorted({str(m["model"]) for m in embedded}))
        return (f"Quality: these memories and states come from the embedded {names}, a small model run on CPU "
                "(bench/embedded_models.py rates its output: grounded memories, template slots, repeats). Expect plain "
                "but short memories and states that miss what a larger model finds. For stronger output, point the LLM "
                "stages at an OpenAI-compatible server (e.g. vLLM): "
                "QUMEM_LLM_KIND=openai QUMEM_LLM_BASE_URL=http://HOST:8000/v1 .venv/bin/qumem run  (docs/models.md).")
    names = ", ".join(f"{m['model']} ({m['backend']})" for m in models)
    return (f"Quality: memories and states come from {names}. Judge them by the samples above and "
            "`qumem show USER_ID`; figures for the models we tried are in docs/models.md and docs/evaluation.md.")


def _has(con, table: str) -> bool:
    return bool(con.execute("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'main' "
                            "AND table_name = ?", [table]).fetchone()[0])


def _count(con, table: str, users: list[str], where: str = "TRUE") -> int:
    if not _has(con, table):
        return 0
    return int(con.execute(f'SELECT count(*) FROM "{table}" WHERE user_id IN (SELECT unnest(?)) AND {where}',
                           [users]).fetchone()[0])


def _cut(text: str | None, n: int = TEXT_CHARS) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= n else text[: n - 1] + "…"


def state_items(state_json: str | None) -> list[tuple[str, str, list[str]]]:
    """(kind, text, memory ids) of every item of a user state Z_q: facts, preference trajectory, insights."""
    try:
        state = json.loads(state_json or "{}")
    except (TypeError, ValueError):
        return []
    items = []
    for f in state.get("facts") or []:
        items.append(("fact", str(f.get("statement", "")), list(f.get("memory_ids") or [])))
    for p in state.get("preference_trajectory") or []:
        text = f"{p.get('aspect', '')}: {p.get('earlier', '')} -> {p.get('current', '')}"
        if p.get("applies_now_because"):
            text += f" (now because {p['applies_now_because']})"
        items.append(("preference", text, list(p.get("memory_ids") or [])))
    for i in state.get("insights") or []:
        items.append(("insight", str(i.get("insight", "")), list(i.get("memory_ids") or [])))
    return items


def _memories_by_id(con, user_id: str, ids: Sequence[str]) -> dict[str, dict]:
    if not ids or not _has(con, "memories"):
        return {}
    rows = con.execute("SELECT memory_id, type, content, evidence_turn_ids FROM memories "
                       "WHERE user_id = ? AND memory_id IN (SELECT unnest(?))", [user_id, list(ids)]).fetchall()
    return {m: {"memory_id": m, "type": t, "content": c, "evidence_turn_ids": list(e or [])} for m, t, c, e in rows}


def _sample(con, user_id: str) -> dict:
    """One memory (the user's first fact, else preference, else insight) and one state with its citations."""
    out: dict[str, Any] = {"user_id": user_id, "memory": None, "state": None}
    if _has(con, "memories"):
        row = con.execute(
            "SELECT type, content, evidence_turn_ids FROM memories WHERE user_id = ? "
            "ORDER BY list_position(?, type) NULLS LAST, position, memory_id LIMIT 1",
            [user_id, list(MEMORY_TYPES)]).fetchone()
        if row:
            out["memory"] = {"type": row[0], "content": row[1], "evidence_turn_ids": list(row[2] or [])}
    if _has(con, "query_states"):
        # the user's state that cites the most memories, so the sample shows what citations look like
        row = con.execute(
            "SELECT query_id, query, state, cited_memory_ids, cited_turn_ids FROM query_states WHERE user_id = ? "
            "ORDER BY len(cited_memory_ids) DESC, query_id LIMIT 1", [user_id]).fetchone()
        if row:
            out["state"] = _state_view(con, user_id, *row)
    return out


def _state_view(con, user_id: str, query_id: str, query: str, state: str, cited: list, turns: list) -> dict:
    items = state_items(state)
    mems = _memories_by_id(con, user_id, list(cited or []))
    return {"query_id": query_id, "query": query, "items": [{"kind": k, "text": t, "memory_ids": ids} for k, t, ids in items],
            "citations": [mems[m] for m in (cited or []) if m in mems], "cited_turn_ids": list(turns or [])}


def collect(con, users: Sequence[str], *, paid_since: datetime | None = None,
            sample_users: int = SAMPLE_USERS) -> dict[str, Any]:
    """The figures of `users` in the warehouse open on `con` (module doc), and samples for the first
    `sample_users` users that have memories. `paid_since`: LLM calls created from then on were paid by
    this run (the others were replayed from checkpoints)."""
    users = sorted(users)
    summary: dict[str, Any] = {"users": {"total": len(users)}}
    c = summary["counts"] = {}
    c["turns"] = _count(con, "turns", users)
    summary["users"]["with_turns"] = int(con.execute(
        "SELECT count(DISTINCT user_id) FROM turns WHERE user_id IN (SELECT unnest(?))", [users]).fetchone()[0]
    ) if _has(con, "turns") else 0
    c["quarantined_rows"] = _count(con, "quarantine", users)
    c["quarantined_rows_unattributed"] = int(con.execute(
        f"SELECT count(*) FROM quarantine WHERE {UNATTRIBUTED_SQL}", [USER_ID_PATTERN.pattern]).fetchone()[0]
    ) if _has(con, "quarantine") else 0
    c["episodes"] = _count(con, "episodes", users)
    c["memories"] = _count(con, "memories", users)
    by_type = dict(con.execute("SELECT type, count(*) FROM memories WHERE user_id IN (SELECT unnest(?)) GROUP BY 1",
                               [users]).fetchall()) if _has(con, "memories") else {}
    c["memories_by_type"] = {t: int(by_type.get(t, 0)) for t in [*MEMORY_TYPES, *sorted(set(by_type) - set(MEMORY_TYPES))]}
    c["memory_outputs_quarantined"] = _count(con, "memory_quarantine", users)
    c["persona_profiles"] = _count(con, "persona_profiles", users)
    c["query_states"] = _count(con, "query_states", users)
    c["query_states_citing_memories"] = _count(con, "query_states", users, "len(cited_memory_ids) > 0")
    c["queries_quarantined"] = _count(con, "query_quarantine", users)

    stages: list[dict] = []
    models: list[dict] = []
    if _has(con, "llm_ledger"):
        since = paid_since.isoformat() if paid_since else None
        rows = con.execute(
            "SELECT s, count(*), "
            "count(*) FILTER (WHERE ?::TIMESTAMPTZ IS NOT NULL AND created_at >= ?::TIMESTAMPTZ), "
            "coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0), "
            "count(*) FILTER (WHERE status <> 'ok') "
            "FROM (SELECT *, coalesce(stage, '?') AS s FROM llm_ledger WHERE user_id IN (SELECT unnest(?))) "
            "GROUP BY s ORDER BY list_position(['decompose', 'persona_merge', 'a1', 'a2', 'a3', 'research', 'qa'], s) "
            "NULLS LAST, s",
            [since, since, users]).fetchall()
        stages = [{"stage": s, "calls": int(n), "paid_this_run": int(p) if paid_since else None,
                   "prompt_tokens": int(pt), "completion_tokens": int(ct), "failed_output": int(f)}
                  for s, n, p, pt, ct, f in rows]
        models = [{"backend": b, "model": m} for b, m in con.execute(
            "SELECT DISTINCT coalesce(backend, '?'), coalesce(model, '?') FROM llm_ledger "
            "WHERE user_id IN (SELECT unnest(?)) ORDER BY 1, 2", [users]).fetchall()]
    summary["llm"] = {"by_stage": stages, "models": models,
                      "calls": sum(s["calls"] for s in stages),
                      "prompt_tokens": sum(s["prompt_tokens"] for s in stages),
                      "completion_tokens": sum(s["completion_tokens"] for s in stages)}
    summary["quality_note"] = quality_note(models)

    with_memories = [u for u in users if _count(con, "memories", [u])] if _has(con, "memories") else []
    summary["samples"] = [_sample(con, u) for u in with_memories[:sample_users]]
    summary["samples_omitted_users"] = max(0, len(with_memories) - sample_users)
    summary["users"]["with_memories"] = len(with_memories)
    return summary


def user_view(con, user_id: str) -> dict[str, Any] | None:
    """Everything `qumem show` prints for one user, or None when the warehouse has nothing of theirs."""
    def rows(sql: str, table: str) -> list[dict]:
        if not _has(con, table):
            return []
        cur = con.execute(sql, [user_id])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]

    view = {
        "user_id": user_id,
        "turns": _count(con, "turns", [user_id]),
        "quarantined_rows": _count(con, "quarantine", [user_id]),
        "episodes": rows("SELECT episode_index, first_turn_index, last_turn_index, n_turns, start_ts, end_ts "
                         "FROM episodes WHERE user_id = ? ORDER BY episode_index", "episodes"),
        "memories": rows("SELECT memory_id, type, content, evidence_turn_ids, episode_id, position FROM memories "
                         "WHERE user_id = ? ORDER BY position, list_position(['fact', 'preference', 'insight'], type), "
                         "memory_id", "memories"),
        "states": [],
    }
    for s in rows("SELECT query_id, query, state, cited_memory_ids, cited_turn_ids FROM query_states "
                  "WHERE user_id = ? ORDER BY query_id", "query_states"):
        view["states"].append(_state_view(con, user_id, s["query_id"], s["query"], s["state"],
                                          s["cited_memory_ids"], s["cited_turn_ids"]))
    if not (view["turns"] or view["quarantined_rows"] or view["episodes"] or view["memories"] or view["states"]):
        return None
    return view


# ------------------------------------------------------------------------------------ rendering

def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f}s" if seconds < 120 else f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def render_summary(summary: dict[str, Any], console) -> None:
    """The end-of-run summary as rich tables on `console` (a rich Console)."""
    from rich.panel import Panel
    from rich.text import Text

    for table in (_made_table(summary), _llm_table(summary["llm"]), _wall_table(summary),
                  _where_table(summary.get("locations", {})), _samples_table(summary)):
        if table is not None:
            console.print(table)
    console.print(Panel(Text(summary["quality_note"]), title="output quality", title_align="left"))


def _table(title: str, *columns: str, **kw):
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", **kw)
    for col in columns:
        t.add_column(col)
    return t


def _made_table(summary: dict[str, Any]):
    from rich.text import Text

    c, u, loc = summary["counts"], summary["users"], summary.get("locations", {})
    t = _table("qumem run: what was made", "what")
    t.add_column("count", justify="right")
    t.add_column("detail")
    t.add_row("users", str(u["total"]), f"{u.get('with_turns', 0)} with turns, {u.get('with_memories', 0)} with memories")
    t.add_row("turns", str(c["turns"]), "")
    q_detail = f"+ {c['quarantined_rows_unattributed']} rows with no valid user id"
    if loc.get("quarantine"):
        q_detail += f"; table {loc['quarantine']}"
    t.add_row("quarantined rows", str(c["quarantined_rows"]), Text(q_detail))
    t.add_row("episodes", str(c["episodes"]), "")
    t.add_row("memories", str(c["memories"]), ", ".join(f"{k} {n}" for k, n in c["memories_by_type"].items()))
    t.add_row("memory outputs quarantined", str(c["memory_outputs_quarantined"]), "LLM outputs off the schema or cut")
    t.add_row("persona profiles", str(c["persona_profiles"]), "")
    t.add_row("query states", str(c["query_states"]),
              f"{c['query_states_citing_memories']} cite memories; {c['queries_quarantined']} queries quarantined")
    return t


def _llm_table(llm: dict[str, Any]):
    from rich.text import Text

    t = _table("LLM calls and tokens by stage", "stage")
    for col in ("calls", "paid this run", "prompt tokens", "completion tokens", "bad output"):
        t.add_column(col, justify="right")
    for s in llm["by_stage"]:
        t.add_row(s["stage"], str(s["calls"]), "-" if s["paid_this_run"] is None else str(s["paid_this_run"]),
                  f"{s['prompt_tokens']:,}", f"{s['completion_tokens']:,}", str(s["failed_output"]))
    paid = [s["paid_this_run"] for s in llm["by_stage"] if s["paid_this_run"] is not None]
    t.add_row("total", str(llm["calls"]), str(sum(paid)) if paid else "-", f"{llm['prompt_tokens']:,}",
              f"{llm['completion_tokens']:,}", str(sum(s["failed_output"] for s in llm["by_stage"])), style="bold")
    if llm["models"]:
        t.caption = Text("model: " + ", ".join(f"{m['model']} ({m['backend']})" for m in llm["models"]))
    return t


def _wall_table(summary: dict[str, Any]):
    wall = summary.get("wall_s_by_stage") or {}
    if not wall:
        return None
    t = _table("Wall time by stage", "stage")
    t.add_column("wall time", justify="right")
    for stage, s in wall.items():
        t.add_row(stage, _fmt_s(s))
    if summary.get("wall_s") is not None:
        t.add_row("other: start-up, model loads, orchestration", _fmt_s(max(0.0, summary["wall_s"] - sum(wall.values()))))
    t.add_row("total (command)", _fmt_s(summary.get("wall_s")), style="bold")
    return t


def _where_table(loc: dict[str, Any]):
    from rich.text import Text

    if not loc:
        return None
    t = _table("Where things are", "what")
    t.add_column("where", overflow="fold")
    names = {"data_root": "tables (Delta Lake)", "warehouse": "warehouse (DuckDB)", "quarantine": "bad rows",
             "dagster_home": "run history (Dagster UI)", "summary_json": "this summary as JSON", "log": "full log"}
    for k, label in names.items():
        if loc.get(k):
            t.add_row(label, Text(str(loc[k])))
    return t


def _samples_table(summary: dict[str, Any]):
    from rich.text import Text

    samples = summary.get("samples") or []
    if not samples:
        return None
    t = _table("One memory and one user state per user", "user", show_lines=True)
    t.add_column("memory", ratio=1, overflow="fold")
    t.add_column("user state (query -> state, citations)", ratio=2, overflow="fold")
    for s in samples:
        m = s["memory"]
        mem = f"[{m['type']}] {_cut(m['content'])}\nturns {m['evidence_turn_ids']}" if m else "-"
        t.add_row(Text(s["user_id"]), Text(mem), Text(_state_text(s["state"])))
    omitted = summary.get("samples_omitted_users", 0)
    if omitted:
        t.caption = f"{omitted} more users not shown: `qumem show USER_ID`"
    return t


def _state_text(state: dict | None, cut: bool = True) -> str:
    if not state:
        return "-"
    f = _cut if cut else (lambda x: " ".join(str(x or "").split()))
    lines = [f"Q: {f(state['query'])}"]
    items = state["items"][:3] if cut else state["items"]
    lines += [f"{it['kind']}: {f(it['text'])}" for it in items] or ["(empty state: nothing relevant retrieved)"]
    for m in state["citations"][:3] if cut else state["citations"]:
        lines.append(f"  cites [{m['type']}] {f(m['content'])} (turns {m['evidence_turn_ids']})")
    if not state["citations"]:
        lines.append("  cites no memory")
    return "\n".join(lines)


def render_user(view: dict[str, Any], console) -> None:
    """`qumem show USER_ID`: the user's episodes, memories and query states as rich tables."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    console.print(Text(f"{view['user_id']}: {view['turns']} turns, {view['quarantined_rows']} quarantined rows, "
                       f"{len(view['episodes'])} episodes, {len(view['memories'])} memories, "
                       f"{len(view['states'])} query states", style="bold"))
    t = Table(title="episodes", box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("#", "turns", "n", "from", "to"):
        t.add_column(col)
    for e in view["episodes"]:
        t.add_row(str(e["episode_index"]), f"{e['first_turn_index']}-{e['last_turn_index']}", str(e["n_turns"]),
                  str(e["start_ts"] or "")[:19], str(e["end_ts"] or "")[:19])
    console.print(t)
    t = Table(title="memories", box=box.SIMPLE_HEAD, title_justify="left")
    t.add_column("type")
    t.add_column("memory", overflow="fold")
    t.add_column("evidence turns")
    for m in view["memories"]:
        t.add_row(m["type"], Text(str(m["content"])), ", ".join(str(x) for x in (m["evidence_turn_ids"] or [])))
    console.print(t)
    t = Table(title="query states", box=box.SIMPLE_HEAD, title_justify="left", show_lines=True)
    t.add_column("query", overflow="fold")
    t.add_column("state", overflow="fold")
    t.add_column("citations", overflow="fold")
    for s in view["states"]:
        state = "\n".join(f"{it['kind']}: {it['text']}" for it in s["items"]) or "(empty)"
        cites = "\n".join(f"[{m['type']}] {m['content']} (turns {', '.join(map(str, m['evidence_turn_ids']))})"
                          for m in s["citations"]) or "-"
        t.add_row(Text(f"{s['query_id']}: {s['query']}"), Text(state), Text(cites))
    console.print(t)
