"""Whether a run's memories and user states read as something a person can use: rates computed from the
tables alone, no model. Why: the embedded model is the product's first impression, and "the memories are
poor" has to be a number a change can move (issue 50: template slots, near-empty, repeated phrases,
ungrounded memories, states made of memory labels).

Rules (each a pure function on one row, so a test can pin it):
- content words: lowercase runs of 4+ letters that are not stop words (`content_words`).
- schema-valid: decomposition calls whose output was kept, over all decomposition calls
  (1 - `memory_quarantine` rows / calls in `llm_ledger`).
- template slot: a bracketed placeholder, `[user_name]`, `{name}`, `<user>`, or an opening bracket run
  straight into a snake_case word (`[depth_depth…`, cut before it closed) (`has_template_slot`).
- near-empty: fewer than 3 content words (`is_near_empty`).
- repeated phrase: a run of >= 2 words that occurs >= 3 times in the memory (`has_repeated_phrase`;
  every repeat of a longer run repeats its first two words, so counting word pairs is enough).
- grounded: at least half of the memory's content words occur among the words of its evidence turns,
  each turn's speaker name and role included (`is_grounded`); a memory with no content word is not.
- state made of labels: a `query_states` state whose text is mostly memory ids and labels ("M1 -> M1"):
  of its words, at least half are labels, or it has fewer than 3 content words (`state_made_of_labels`).
  A state with no text at all is counted apart, as empty (`state_is_empty`).
"""

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import polars as pl

STOP_WORDS = frozenset("""
about above after again against all also although among another any anyone anything are aren around
because been before being below between both but can cannot could did does doing done down during each
either else even ever every from further had has have having here hers herself him himself his how however
into its itself just like made make many might more most much must myself near neither never none nor not
now off once one only onto other others otherwise ought our ours ourselves out over own per quite rather
really same shall she should since some something such than that the their theirs them themselves then
there these they this those though through thus till too under until upon very was were what whatever when
where whether which while who whom whose why will with within without would yet you your yours yourself
yourselves also etc into onto
""".split())

_LETTERS = re.compile(r"[a-z]+")
_WORDS = re.compile(r"[a-z0-9]+")
# [user_name] / {name} / <user>: a closed bracket around an identifier-like label (letters, digits, _, -, space)
_CLOSED_SLOT = re.compile(r"[\[{<]\s*[A-Za-z_][A-Za-z0-9_ \-]{0,40}\s*[\]}>]")
# "[depth_depth…": an opening bracket run straight into a snake_case word (a slot cut before it closed)
_OPEN_SLOT = re.compile(r"[\[{<][A-Za-z0-9]*_[A-Za-z0-9_]*")
# a memory alias or id as states cite them: M1, m12, #3, 12
_ALIAS = re.compile(r"^[a-z]{0,3}\d+$")
LABEL_WORDS = frozenset({"fact", "facts", "preference", "preferences", "insight", "insights", "memory", "memories",
                         "memory_id", "memory_ids", "none", "null", "unknown", "earlier", "current", "aspect",
                         "statement", "label", "id", "ids"})
# the text fields of a user state Z_q (USER_STATE_SCHEMA and AdaMem's extension); memory_ids lists are not text
STATE_TEXT_KEYS = ("statement", "aspect", "earlier", "current", "applies_now_because", "insight", "summary", "text")


def content_words(text: str | None) -> list[str]:
    """Lowercase runs of 4+ letters that are not stop words, in order (repeats kept)."""
    return [w for w in _LETTERS.findall((text or "").lower()) if len(w) >= 4 and w not in STOP_WORDS]


def has_template_slot(text: str | None) -> bool:
    t = text or ""
    return bool(_CLOSED_SLOT.search(t) or _OPEN_SLOT.search(t))


def is_near_empty(text: str | None) -> bool:
    return len(content_words(text)) < 3


def has_repeated_phrase(text: str | None, min_words: int = 2, min_times: int = 3) -> bool:
    words = _WORDS.findall((text or "").lower())
    grams = Counter(tuple(words[i:i + min_words]) for i in range(len(words) - min_words + 1))
    return any(n >= min_times for n in grams.values())


def evidence_vocabulary(turns: Iterable[dict[str, Any]]) -> set[str]:
    """The words of `turns` (text, speaker name and role), lowercased letters only."""
    vocab: set[str] = set()
    for t in turns:
        for part in (t.get("text"), t.get("speaker"), t.get("role")):
            vocab.update(_LETTERS.findall(str(part or "").lower()))
    return vocab


def is_grounded(text: str | None, vocab: set[str], min_share: float = 0.5) -> bool:
    words = content_words(text)
    if not words:
        return False
    return sum(w in vocab for w in words) >= min_share * len(words)


def state_texts(state_json: str | None) -> list[str]:
    """Every text value of a state Z_q's items (facts, preference trajectory, insights, any extra list)."""
    try:
        state = json.loads(state_json or "{}")
    except (TypeError, ValueError):
        return [str(state_json or "")]
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, str) and (k in STATE_TEXT_KEYS or not k.endswith("ids")):
                    out.append(v)
                elif isinstance(v, (dict, list)) and not k.endswith("ids"):
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, str):
            out.append(node)

    walk(state)
    return [t for t in out if t.strip()]


def _is_label(word: str, memory_ids: set[str]) -> bool:
    return bool(_ALIAS.match(word)) or word in LABEL_WORDS or word in memory_ids


def state_is_empty(state_json: str | None) -> bool:
    return not state_texts(state_json)


def state_made_of_labels(state_json: str | None, memory_ids: Iterable[str] = ()) -> bool:
    """Mostly memory ids / labels ("M1 -> M1"): at least half its words are labels, or < 3 content words.
    An empty state is not counted here (`state_is_empty`)."""
    texts = state_texts(state_json)
    if not texts:
        return False
    ids = {str(m).lower() for m in memory_ids}
    words = [w for t in texts for w in re.findall(r"[a-z0-9_]+", t.lower())]
    labels = sum(_is_label(w, ids) for w in words)
    content = [w for t in texts for w in content_words(t) if not _is_label(w, ids)]
    return labels * 2 >= len(words) or len(content) < 3


# -- tables -----------------------------------------------------------------------------------------
def _rate(n: int, d: int) -> float | None:
    return None if d == 0 else round(n / d, 4)


def memory_rates(memories: pl.DataFrame, turns: pl.DataFrame) -> dict[str, Any]:
    """Per-memory rates over `memories` (content, user_id, evidence_turn_ids) with evidence looked up in
    `turns` (user_id, turn_index, text, speaker, role). Counts, rates and one example of each failure."""
    by_turn: dict[tuple[str, int], dict] = {
        (r["user_id"], int(r["turn_index"])): r
        for r in turns.select([c for c in ("user_id", "turn_index", "text", "speaker", "role") if c in turns.columns])
        .iter_rows(named=True)
    }
    n = slots = empty = repeats = grounded = missing_evidence = 0
    examples: dict[str, str] = {}
    for m in memories.iter_rows(named=True):
        text = m.get("content") or ""
        n += 1
        ev = [by_turn.get((m["user_id"], int(i))) for i in (m.get("evidence_turn_ids") or [])]
        missing_evidence += sum(e is None for e in ev)
        checks = {
            "template_slot": has_template_slot(text),
            "near_empty": is_near_empty(text),
            "repeated_phrase": has_repeated_phrase(text),
            "ungrounded": not is_grounded(text, evidence_vocabulary(e for e in ev if e is not None)),
        }
        slots += checks["template_slot"]
        empty += checks["near_empty"]
        repeats += checks["repeated_phrase"]
        grounded += not checks["ungrounded"]
        for k, bad in checks.items():
            if bad and k not in examples:
                examples[k] = text[:200]
    return {
        "memories": n,
        "template_slot_rate": _rate(slots, n),
        "near_empty_rate": _rate(empty, n),
        "repeated_phrase_rate": _rate(repeats, n),
        "grounded_rate": _rate(grounded, n),
        "evidence_ids_not_found": missing_evidence,
        "examples": examples,
    }


def state_rates(states: pl.DataFrame, memory_ids_by_user: dict[str, set[str]] | None = None) -> dict[str, Any]:
    """Share of `query_states` rows whose state is made of labels, of empty ones, and of those citing evidence
    (a memory, turn or profile: a state that cites nothing cannot be checked against what the user said)."""
    ids = memory_ids_by_user or {}
    n = labels = empty = citing = 0
    example = None
    for s in states.iter_rows(named=True):
        n += 1
        citing += bool(s.get("cited_memory_ids"))
        known = set(ids.get(s["user_id"], set())) | set(s.get("cited_memory_ids") or [])
        if state_is_empty(s.get("state")):
            empty += 1
        elif state_made_of_labels(s.get("state"), known):
            labels += 1
            example = example or " | ".join(state_texts(s.get("state")))[:200]
    return {"states": n, "label_state_rate": _rate(labels, n), "empty_state_rate": _rate(empty, n),
            "citing_state_rate": _rate(citing, n), "label_state_example": example}


def schema_valid_rate(ledger: pl.DataFrame | None, quarantine: pl.DataFrame | None) -> dict[str, Any]:
    """Decomposition calls (distinct request ids of stage decompose, or no stage: rows written before the
    column) and how many ended in `memory_quarantine`."""
    calls = 0
    if ledger is not None and ledger.height:
        led = ledger
        if "stage" in led.columns:
            led = led.filter(pl.col("stage").is_null() | (pl.col("stage") == "decompose"))
        calls = led.select(pl.col("request_id").n_unique()).item() if led.height else 0
    bad = 0 if quarantine is None else quarantine.select(pl.col("request_id").n_unique()).item() if quarantine.height else 0
    return {"decompose_calls": calls, "quarantined_calls": bad, "schema_valid_rate": _rate(calls - bad, calls)}


def rates(memories: pl.DataFrame, turns: pl.DataFrame, states: pl.DataFrame | None = None,
          ledger: pl.DataFrame | None = None, quarantine: pl.DataFrame | None = None) -> dict[str, Any]:
    """All readability figures of one run's tables (module doc)."""
    out = {**schema_valid_rate(ledger, quarantine), **memory_rates(memories, turns)}
    if states is not None:
        by_user: dict[str, set[str]] = {}
        for u, mid in memories.select("user_id", "memory_id").iter_rows():
            by_user.setdefault(u, set()).add(str(mid).lower())
        out.update(state_rates(states, by_user))
    return out


TARGETS = {"template_slot_rate": ("<=", 0.02), "near_empty_rate": ("<=", 0.05), "repeated_phrase_rate": ("<=", 0.05),
           "grounded_rate": (">=", 0.70), "label_state_rate": ("<=", 0.10)}


def misses(figures: dict[str, Any]) -> dict[str, float]:
    """Each target the figures miss, with its distance (positive: how far off)."""
    out = {}
    for k, (op, bound) in TARGETS.items():
        v = figures.get(k)
        if v is None:
            continue
        gap = v - bound if op == "<=" else bound - v
        if gap > 0:
            out[k] = round(gap, 4)
    return out


def checkpoint_memories(checkpoints: pl.DataFrame) -> pl.DataFrame:
    """Memory rows (user_id, episode_id, type, content, evidence_turn_ids) from `memory_checkpoints`' parsed
    outputs: what a run had decomposed before it stopped (a run killed mid-stage still has them)."""
    rows = []
    for c in checkpoints.filter(pl.col("status") == "ok").iter_rows(named=True):
        for i, m in enumerate((json.loads(c["output"] or "{}") or {}).get("memories") or []):
            rows.append({"memory_id": f"{c['key'][:12]}-{i}", "user_id": c["user_id"], "episode_id": c["episode_id"],
                         "type": c["type"], "content": str(m.get("content") or ""),
                         "evidence_turn_ids": [int(x) for x in m.get("evidence_turn_ids") or []]})
    schema = {"memory_id": pl.String, "user_id": pl.String, "episode_id": pl.String, "type": pl.String,
              "content": pl.String, "evidence_turn_ids": pl.List(pl.Int64)}
    return pl.DataFrame(rows, schema=schema)


def read_run(data_root: str, users: Sequence[str] | None = None) -> dict[str, Any]:
    """`rates` of the tables under a run's data root (placeholder rows dropped)."""
    from qumem_pipeline.storage.table_store import TableStore

    store = TableStore(data_root)

    def table(name: str) -> pl.DataFrame | None:
        df = store.read(name, users)
        if df is None:
            return None
        if "user_placeholder" in df.columns:
            df = df.filter(~pl.col("user_placeholder").fill_null(False))
        return df

    mem, turns = table("memories"), table("turns")
    if mem is None or turns is None:
        raise FileNotFoundError(f"{data_root}: no memories or turns table (has `qumem run` finished there?)")
    return rates(mem, turns, table("query_states"), table("llm_ledger"), table("memory_quarantine"))
