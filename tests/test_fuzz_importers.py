"""Fuzzed archives into every importer and through validation: nothing lost, nothing crashes.

Each generated record carries the classification the test gave it when it built it (valid, or
invalid with the field that must be named), plus a unique marker in its text. The properties:

- every valid record arrives in the turn table exactly once (found by its marker), under its user;
- every invalid record is in quarantine with a field and a reason, under its source row;
- valid + quarantined == input records (blank lines are not records);
- nothing escapes but the documented user-facing errors (StrictValidationError in strict mode,
  naming file, row and field).

Seeds are fixed (``derandomize=True``) and examples bounded, so the module runs in about a minute.
"""

import json
import string
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from qumem_pipeline.ingest.importers import import_archive
from qumem_pipeline.ingest.importers.chatgpt import import_chatgpt
from qumem_pipeline.ingest.importers.locomo import import_locomo
from qumem_pipeline.ingest.sync import validate_streamed
from qumem_pipeline.ingest.validate import StrictValidationError, validate

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
MAX_TEXT = 1000
FUZZ = settings(
    derandomize=True,
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------- building blocks

VALID_USER_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,15}", fullmatch=True).filter(lambda s: ".." not in s)
# Path separators, traversal, quotes, NUL, control characters, unicode look-alikes, length.
BAD_USER_IDS = [
    "a/b", "a\\b", "..", "../etc", "a..b", "al'ice", 'al"ice', "al\x00ice", "alice\n", " alice", "-alice",
    ".hidden", "", "x" * 129, "\u0430lice",  # Cyrillic а
    "alice\uff0fbob",  # fullwidth ／
    "\uff41\uff4c\uff49\uff43\uff45",  # fullwidth ａｌｉｃｅ
    "ali\u0441e",  # Cyrillic с
    "a;drop table turns",
]
# Free text: any unicode scalar except surrogates (not representable in UTF-8).
FREE_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=60)
VALID_TIMESTAMPS = st.sampled_from(
    [None, "2024-03-01T10:00:00Z", "2024-03-01T10:00:00.123Z", "2024-03-01 10:00:00", "2024-03-01",
     "2024-03-01T10:00:00+02:00", "1700000000", "1700000000.5"]
)
BAD_TIMESTAMPS = ["yesterday", "2024-13-45T00:00:00Z", "not a date", "12/31/2024", "2024-03-01T25:61:00Z", "∞"]
FUTURE_TIMESTAMPS = ["2999-01-01T00:00:00Z", "4102444800"]  # 2100-01-01 as epoch seconds
BLANK_TEXTS = [None, "", "   ", "\t\n "]
SIDE = "\u2063side-branch-text\u2063"


@dataclass
class Rec:
    """One generated source record and what must become of it."""

    row: dict | None  # the JSON object (None for a raw line)
    raw: bytes | None = None  # a raw JSONL line instead of an object
    valid: bool = True
    field: str | None = None  # the field quarantine must name, when the test can know it
    marker: str | None = None
    owner: str | None = None  # the user a broken line must still be attributed to


@st.composite
def canonical_records(draw, *, allow_raw_lines: bool) -> list[Rec]:
    """A list of canonical rows; ``allow_raw_lines`` adds broken lines (JSONL only)."""
    n = draw(st.integers(0, 25))
    users = draw(st.lists(VALID_USER_IDS, min_size=1, max_size=3, unique=True))
    kinds = ["valid"] * 6 + ["bad_user", "bad_role", "no_role", "blank_text", "oversize", "bad_ts", "future_ts",
                             "no_conv", "negative_ti", "dup"]
    if allow_raw_lines:
        kinds += ["truncated", "non_utf8", "random_bytes", "not_object", "wrong_type", "nested_text"]
    recs: list[Rec] = []
    valid_so_far: list[Rec] = []
    for i in range(n):
        kind = draw(st.sampled_from(kinds))
        marker = f"#m{i}#"
        ti = draw(st.one_of(st.none(), st.just((n - i) * 3)))  # descending: out of order
        row = {
            "user_id": draw(st.sampled_from(users)),
            "conversation_id": draw(st.sampled_from(["c1", "c2", "conv 'quoted'", "ко"])),
            "session_id": draw(st.one_of(st.none(), st.just("s1"))),
            "turn_index": ti,
            "role": draw(st.sampled_from(["user", "assistant", "other"])),
            "speaker": draw(st.one_of(st.none(), FREE_TEXT)),
            "text": draw(FREE_TEXT) + marker,
            "timestamp": draw(VALID_TIMESTAMPS),
            "source_ref": draw(st.one_of(st.none(), st.just(f"ref-{i}"))),
        }
        rec = Rec(row=row, marker=marker)
        if kind == "bad_user":
            row["user_id"], rec.valid, rec.field = draw(st.sampled_from(BAD_USER_IDS)), False, "user_id"
        elif kind == "bad_role":
            row["role"], rec.valid, rec.field = draw(st.sampled_from(["robot", "USER", "user ", "system", ""])), False, "role"
        elif kind == "no_role":
            row["role"], rec.valid, rec.field = None, False, "role"
        elif kind == "blank_text":
            row["text"], rec.valid, rec.field, rec.marker = draw(st.sampled_from(BLANK_TEXTS)), False, "text", None
        elif kind == "oversize":
            row["text"], rec.valid, rec.field = "x" * (MAX_TEXT + 1) + marker, False, "text"
        elif kind == "bad_ts":
            row["timestamp"], rec.valid, rec.field = draw(st.sampled_from(BAD_TIMESTAMPS)), False, "timestamp"
        elif kind == "future_ts":
            row["timestamp"], rec.valid, rec.field = draw(st.sampled_from(FUTURE_TIMESTAMPS)), False, "timestamp"
        elif kind == "no_conv":
            row["conversation_id"], rec.valid, rec.field = draw(st.sampled_from([None, "", "  "])), False, "conversation_id"
        elif kind == "negative_ti":
            row["turn_index"], rec.valid, rec.field = -1 - i, False, "turn_index"
        elif kind == "dup":
            keyed = [r for r in valid_so_far if r.row["turn_index"] is not None or r.row["source_ref"] is not None]
            if not keyed:
                continue
            first = draw(st.sampled_from(keyed))
            row.update({k: first.row[k] for k in ("user_id", "conversation_id", "turn_index", "source_ref")})
            rec.valid = False
            rec.field = "turn_index" if first.row["turn_index"] is not None else "source_ref"
        elif kind == "truncated":
            full = json.dumps(row, ensure_ascii=False).encode()
            raw = full[: draw(st.integers(1, len(full) - 1))]
            uid_part = json.dumps({"user_id": row["user_id"]}, ensure_ascii=False)[1:-1].encode() + b","
            rec = Rec(row=None, raw=raw, valid=False, field="(line)",
                      owner=row["user_id"] if raw.startswith(b"{" + uid_part) else None)
        elif kind == "non_utf8":
            body = json.dumps(row, ensure_ascii=False).encode()
            cut = body.index(b'"text": "') + 9
            bad = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xe9", b"\xed\xa0\x80"]))  # incl. an encoded surrogate
            rec = Rec(row=None, raw=body[:cut] + bad + body[cut:], valid=False, field="(line)")
        elif kind == "random_bytes":
            raw = draw(st.binary(min_size=1, max_size=80)).replace(b"\n", b"")
            assume(raw.strip())  # a blank line is not a record
            try:
                assume(not isinstance(json.loads(raw), dict))  # (practically never) a real object
            except ValueError:
                pass
            rec = Rec(row=None, raw=raw, valid=False, field="(line)")
        elif kind == "not_object":
            rec = Rec(row=None, raw=draw(st.sampled_from([b"[1, 2]", b'"text"', b"42", b"null", b"true"])), valid=False, field="(line)")
        elif kind == "wrong_type":
            row["turn_index"], rec.valid, rec.field = draw(st.sampled_from(["3", 1.5, True, [1]])), False, "turn_index"
        elif kind == "nested_text":
            row["text"], rec.valid, rec.field = {"nested": marker}, False, "text"
        if rec.valid:
            valid_so_far.append(rec)
        recs.append(rec)
    return recs


def write_records(path: Path, recs: list[Rec], blank_lines: bool = False) -> Path:
    with open(path, "wb") as f:
        for i, r in enumerate(recs):  # alternate escaped and literal unicode
            f.write(r.raw if r.raw is not None else json.dumps(r.row, ensure_ascii=bool(i % 2)).encode())
            f.write(b"\n\n" if blank_lines else b"\n")
    return path


def check_outcome(res, recs: list[Rec], line_of, source_file: str | None = None) -> None:
    """The properties of the module docstring for one file's records."""
    turns, q = res.turns, res.quarantine
    valid = [r for r in recs if r.valid]
    invalid = {line_of(i): r for i, r in enumerate(recs) if not r.valid}
    # conservation
    assert turns.height + q.height == len(recs), (turns.height, q.height, len(recs))
    # every valid record exactly once, under its own user and conversation
    found = {}
    for row in turns.iter_rows(named=True):
        marks = [r for r in valid if r.marker and row["text"].endswith(r.marker)]
        assert len(marks) == 1, f"turn {row['text']!r} matches {len(marks)} valid records"
        assert marks[0].marker not in found, f"{marks[0].marker} arrived twice"
        found[marks[0].marker] = row
        src = marks[0].row
        assert (row["user_id"], row["conversation_id"], row["role"], row["text"]) == (
            src["user_id"], src["conversation_id"], src["role"], src["text"])
    assert sorted(found) == sorted(r.marker for r in valid)
    # every invalid record quarantined, under its row, with the field the test expects and a reason
    got = {r["source_row"]: r for r in q.iter_rows(named=True)}
    assert sorted(got) == sorted(invalid), (sorted(got), sorted(invalid))
    for row_no, rec in invalid.items():
        qrow = got[row_no]
        assert qrow["reason"] and qrow["field"], qrow
        assert qrow["field"] == rec.field, (row_no, rec.row or rec.raw, qrow["field"], qrow["reason"])
        if rec.field in ("turn_index", "source_ref") and rec.row and type(rec.row.get("turn_index")) is int and rec.row["turn_index"] >= 0:
            assert qrow["reason"].startswith("duplicate turn id"), qrow
        if source_file is not None:
            assert qrow["source_file"] == source_file
        if rec.owner is not None:  # forget must be able to find a user's broken lines
            assert qrow["user_id"] == rec.owner, (rec.raw, qrow)
    # histories: explicit turn_index in ascending order first, then the rest by time (unstamped: the
    # next stamped turn of its conversation in source order; none: last), then source order
    ok = [(i, r) for i, r in enumerate(recs) if r.valid]
    when = {r.marker: _when(r.row["timestamp"]) or next(
        (_when(x.row["timestamp"]) for j, x in ok if j > i and _when(x.row["timestamp"])
         and (x.row["user_id"], x.row["conversation_id"]) == (r.row["user_id"], r.row["conversation_id"])), None)
        for i, r in ok}
    for uid, df in turns.group_by("user_id"):
        assert df["turn_index"].sort().to_list() == list(range(df.height))
        order = [found_marker for found_marker in
                 (next(m for m in found if t.endswith(m)) for t in df.sort("turn_index")["text"].to_list())]
        src = {r.marker: (i, r.row["turn_index"]) for i, r in enumerate(recs) if r.valid}
        expected = sorted(order, key=lambda m: (src[m][1] is None, src[m][1] if src[m][1] is not None else 0,
                                                when[m] is None, when[m] or datetime.min.replace(tzinfo=timezone.utc), src[m][0]))
        assert order == expected, uid


def _when(ts: str | None) -> datetime | None:
    """The test's own reading of VALID_TIMESTAMPS (naive = UTC, bare number = epoch seconds)."""
    if ts is None:
        return None
    try:
        return datetime.fromtimestamp(float(ts), timezone.utc)
    except ValueError:
        d = datetime.fromisoformat(ts)
        return d if d.tzinfo else d.replace(tzinfo=timezone.utc)


Q_ORDER = ["source_file", "source_row", "field", "reason", "raw"]


def assert_streaming_matches(path, res, fmt=None, drop=(), **kw):
    """The bounded-memory reader in tiny blocks / batches gives the whole-file path's rows."""
    chunk, limit = kw.pop("chunk_bytes", 53), kw.pop("max_text_chars", MAX_TEXT)
    for reader in ("auto", "blocks"):  # polars' streaming scan (with its fallback), and the blocks
        streamed = validate_streamed(str(path), fmt, chunk_bytes=chunk, batch_rows=3, max_text_chars=limit, now=NOW,
                                     reader=reader)
        assert streamed.turns.select(res.turns.columns).equals(res.turns), reader
        order = [c for c in Q_ORDER if c not in drop]
        assert streamed.quarantine.drop(*drop).sort(order, nulls_last=True).equals(
            res.quarantine.drop(*drop).sort(order, nulls_last=True)), reader


# ---------------------------------------------------------------- canonical JSONL / Parquet


@FUZZ
@given(recs=canonical_records(allow_raw_lines=True), blank_lines=st.booleans())
def test_fuzzed_jsonl(tmp_path_factory, recs, blank_lines):
    path = write_records(tmp_path_factory.mktemp("jsonl") / "archive.jsonl", recs, blank_lines)
    res = validate(import_archive(path), max_text_chars=MAX_TEXT, now=NOW)
    check_outcome(res, recs, (lambda i: 2 * i + 1) if blank_lines else (lambda i: i + 1), str(path))
    assert_streaming_matches(path, res)


@FUZZ
@given(recs=canonical_records(allow_raw_lines=False))
def test_fuzzed_parquet(tmp_path_factory, recs):
    schema = {"user_id": pl.String, "conversation_id": pl.String, "session_id": pl.String, "turn_index": pl.Int64,
              "role": pl.String, "speaker": pl.String, "text": pl.String, "timestamp": pl.String, "source_ref": pl.String}
    path = tmp_path_factory.mktemp("pq") / "archive.parquet"
    pl.DataFrame([r.row for r in recs], schema=schema, orient="row").write_parquet(path)
    res = validate(import_archive(path), max_text_chars=MAX_TEXT, now=NOW)
    check_outcome(res, recs, lambda i: i + 1, str(path))
    assert_streaming_matches(path, res)


@FUZZ
@given(recs=canonical_records(allow_raw_lines=True))
def test_fuzzed_jsonl_strict_mode_fails_naming_file_row_field(tmp_path_factory, recs):
    path = write_records(tmp_path_factory.mktemp("strict") / "archive.jsonl", recs)
    bad = [i + 1 for i, r in enumerate(recs) if not r.valid]
    if not bad:
        res = validate(import_archive(path), max_text_chars=MAX_TEXT, now=NOW, strict=True)
        assert res.turns.height == len(recs)
        return
    with pytest.raises(StrictValidationError) as err:
        validate(import_archive(path), max_text_chars=MAX_TEXT, now=NOW, strict=True)
    msg = str(err.value)
    assert f"{len(bad)} bad row(s)" in msg and str(path) in msg and "field " in msg
    assert any(f"{path}:{n} " in msg for n in bad), msg


def test_ten_megabyte_turn_is_quarantined_and_neighbours_arrive(tmp_path):
    """A 10 MB turn (default limit 100k chars) is quarantined as oversize; the rows around it arrive."""
    ok = {"user_id": "alice", "conversation_id": "c1", "role": "user", "text": "hello"}
    big = dict(ok, text="é" * 10_000_000)
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"\n".join(json.dumps(r, ensure_ascii=False).encode() for r in (ok, big, dict(ok, text="bye"))) + b"\n")
    res = validate(import_archive(path))
    assert res.turns["text"].to_list() == ["hello", "bye"]
    assert_streaming_matches(path, res, chunk_bytes=1 << 20, max_text_chars=100_000)  # the line is 20x a block
    [q] = res.quarantine.rows(named=True)
    assert (q["source_row"], q["field"]) == (2, "text") and "10000000 chars" in q["reason"]
    assert len(q["raw"]) <= 4096, "quarantine keeps a bounded excerpt, not the 10 MB"


def test_garbage_parquet_file_is_a_file_level_failure(tmp_path):
    """A file that is not Parquet is quarantined as one failure naming the file; other files still import."""
    good = tmp_path / "a.parquet"
    pl.DataFrame({"user_id": ["alice"], "conversation_id": ["c1"], "role": ["user"], "text": ["hi"]}).write_parquet(good)
    (tmp_path / "b.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 8)
    (tmp_path / "c.parquet").write_bytes(b"")
    res = validate(import_archive(tmp_path))
    assert res.turns["text"].to_list() == ["hi"]
    q = res.quarantine.sort("source_file").rows(named=True)
    assert [Path(r["source_file"]).name for r in q] == ["b.parquet", "c.parquet"]
    assert all(r["field"] == "(file)" and "Parquet" in r["reason"] for r in q)


# ---------------------------------------------------------------- LoCoMo


@st.composite
def locomo_samples(draw):
    """(samples, expected): expected = valid turn markers and the number of quarantine rows."""
    samples, markers, n_bad = [], [], 0
    for s in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["ok", "ok", "ok", "not_object", "no_id", "no_conversation", "no_speakers"]))
        if kind == "not_object":
            samples.append(draw(st.sampled_from([None, 3, "conv", [1]])))
            n_bad += 1
            continue
        sample_id = draw(st.sampled_from([f"conv-{s}", f"conv/{s}", f"conv '{s}'", f"conv..{s}", f"кон-{s}"]))
        conv = {"speaker_a": draw(st.sampled_from(["Ann", "Zoë", "Ωμέγα"])), "speaker_b": draw(st.sampled_from(["Bo", "Ann ", "\u0410nn"]))}
        sample = {"sample_id": sample_id, "conversation": conv}
        if kind == "no_id":
            sample["sample_id"] = draw(st.sampled_from([None, "", True, {"x": 1}]))
            n_bad += 1
        elif kind == "no_conversation":
            sample["conversation"] = draw(st.sampled_from([None, [], "text"]))
            n_bad += 1
        elif kind == "no_speakers":
            conv["speaker_b"] = draw(st.sampled_from([None, "", 7]))
            n_bad += 1
        for k in range(1, draw(st.integers(0, 3)) + 1):
            when_kind = draw(st.sampled_from(["ok", "ok", "missing", "bad"]))
            if when_kind == "ok":
                conv[f"session_{k}_date_time"] = "1:56 pm on 8 May, 2023"
            elif when_kind == "bad":
                conv[f"session_{k}_date_time"] = draw(st.sampled_from(["sometime", "99:99 on 40 Smarch, 2023"]))
            if draw(st.integers(0, 9)) == 0:
                conv[f"session_{k}"] = {"not": "a list"}
                n_bad += kind == "ok"
                continue
            turns = []
            for t in range(draw(st.integers(0, 4))):
                marker = f"#s{s}k{k}t{t}#"
                tk = draw(st.sampled_from(["ok", "ok", "ok", "not_dict", "bad_text", "no_speaker", "empty", "photo"]))
                speaker = draw(st.sampled_from([conv["speaker_a"], conv["speaker_b"]]))
                turn = {"speaker": speaker, "dia_id": f"D{k}:{t + 1}", "text": draw(FREE_TEXT) + marker}
                if tk == "not_dict":
                    turn = draw(st.sampled_from([None, "hi", 5]))
                elif tk == "bad_text":
                    turn["text"] = {"t": marker}
                elif tk == "no_speaker":
                    turn.pop("speaker")
                elif tk == "empty":
                    turn["text"] = ""
                elif tk == "photo":
                    turn["text"], turn["blip_caption"] = "", f"a cat {marker}"
                turns.append(turn)
                if kind != "ok":
                    continue
                if tk in ("ok", "photo") and when_kind != "bad":
                    markers.append(marker)
                else:
                    n_bad += 2  # one quarantine row per user
            conv[f"session_{k}"] = turns
        samples.append(sample)
    return samples, markers, n_bad


@FUZZ
@given(data=locomo_samples(), wrap=st.booleans())
def test_fuzzed_locomo(tmp_path_factory, data, wrap):
    samples, markers, n_bad = data
    path = tmp_path_factory.mktemp("locomo") / "locomo.json"
    path.write_text(json.dumps(samples if wrap or len(samples) != 1 else samples[0], ensure_ascii=False))
    if not (wrap or len(samples) != 1) and not isinstance(samples[0], dict):
        return  # a bare non-object is a whole-file failure, covered by test_random_bytes_into_json_importers
    res = validate(import_locomo(str(path)), now=NOW)
    # each valid turn arrives once per speaker-user: twice, under two different users
    for m in markers:
        hits = res.turns.filter(pl.col("text").str.contains(m, literal=True))
        assert hits.height == 2 and hits["user_id"].n_unique() == 2, (m, hits)
    assert res.turns.height == 2 * len(markers)
    assert res.quarantine.height == n_bad
    assert res.quarantine["reason"].is_not_null().all() and res.quarantine["field"].is_not_null().all()
    # no turn of one conversation under another conversation's user
    owners = res.turns.group_by("user_id").agg(pl.col("conversation_id").n_unique().alias("n"))
    assert (owners["n"] == 1).all()


# ---------------------------------------------------------------- ChatGPT export


@st.composite
def chatgpt_export(draw):
    """(conversations, valid markers, invalid markers -> field, n conversation failures)."""
    convs, valid, invalid, n_failed = [], [], {}, 0
    t0 = 1_700_000_000
    for c in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["ok", "ok", "ok", "not_object", "no_id", "no_mapping", "bad_current", "cycle", "broken_parent"]))
        if kind == "not_object":
            convs.append(draw(st.sampled_from([None, 1, "x", []])))
            n_failed += 1
            continue
        mapping = {"root": {"id": "root", "message": None, "parent": None, "children": []}}
        parent = "root"
        conv_valid, conv_invalid = [], {}
        for m in range(draw(st.integers(0, 5))):
            nid = f"c{c}m{m}"
            marker = f"#c{c}m{m}#"
            mk = draw(st.sampled_from(["user", "assistant", "tool", "user", "system", "hidden", "empty", "weird_role",
                                       "bad_ts", "future_ts", "code"]))
            role = {"weird_role": "critic", "hidden": "user", "empty": "assistant", "bad_ts": "user",
                    "future_ts": "user", "code": "assistant"}.get(mk, mk)
            ts = {"bad_ts": "soon", "future_ts": 1e10}.get(mk, t0 + c * 100 + m)
            content = {"content_type": "code" if mk == "code" else "text",
                       "parts": [""] if mk == "empty" else [draw(FREE_TEXT) + marker]}
            if mk == "code":
                content = {"content_type": "code", "text": "print(1)"}
            msg = {"id": nid, "author": {"role": role}, "create_time": ts, "content": content,
                   "metadata": {"is_visually_hidden_from_conversation": True} if mk == "hidden" else {}}
            mapping[nid] = {"id": nid, "message": msg, "parent": parent, "children": []}
            mapping[parent]["children"].append(nid)
            if draw(st.booleans()):  # a regenerated side branch, never imported
                side = f"{nid}-side"
                mapping[side] = {"id": side, "parent": parent, "children": [],
                                 "message": dict(msg, id=side, content={"content_type": "text", "parts": [SIDE]})}
            parent = nid
            if mk in ("user", "assistant", "tool"):
                conv_valid.append(marker)
            elif mk in ("weird_role", "bad_ts", "future_ts"):
                conv_invalid[marker] = {"weird_role": "role", "bad_ts": "timestamp", "future_ts": "timestamp"}[mk]
        conv = {"title": f"t{c} \"q\"", "create_time": t0 + c, "conversation_id": f"conv-{c}", "mapping": mapping,
                "current_node": parent}
        if kind == "ok":
            valid += conv_valid
            invalid.update(conv_invalid)
        else:
            n_failed += 1
            if kind == "no_id":
                conv.pop("conversation_id")
            elif kind == "no_mapping":
                conv["mapping"] = draw(st.sampled_from([None, {}, []]))
            elif kind == "bad_current":
                conv["current_node"] = "nope"
            elif kind == "cycle":
                mapping["root"]["parent"] = parent
            elif kind == "broken_parent":
                mapping[parent]["parent"] = "ghost"
        convs.append(conv)
    return convs, valid, invalid, n_failed


@FUZZ
@given(data=chatgpt_export(), user_id=st.one_of(VALID_USER_IDS, st.sampled_from(BAD_USER_IDS)))
def test_fuzzed_chatgpt(tmp_path_factory, data, user_id):
    convs, valid, invalid, n_failed = data
    path = tmp_path_factory.mktemp("chatgpt") / "conversations.json"
    path.write_text(json.dumps(convs, ensure_ascii=False))
    res = validate(import_chatgpt(str(path), user_id=user_id), now=NOW)
    uid_ok = (  # the test's own statement of the id rule, not the code's
        1 <= len(user_id) <= 128 and user_id[0] in string.ascii_letters + string.digits and ".." not in user_id
        and all(ch in string.ascii_letters + string.digits + "_.-" for ch in user_id))
    q = res.quarantine
    assert res.turns.height + q.height == len(valid) + len(invalid) + n_failed
    assert q.filter(pl.col("field").is_in(["(conversation)", "conversation_id", "mapping", "current_node"])).height == n_failed
    if uid_ok:
        assert sorted(res.turns["text"].str.extract(r"(#c\d+m\d+#)$").to_list()) == sorted(valid)
        assert set(res.turns["user_id"]) <= {user_id}
        for m, fld in invalid.items():
            [row] = q.filter(pl.col("raw").str.contains(m, literal=True)).rows(named=True)
            assert row["field"] == fld, (m, row)
    else:
        assert res.turns.height == 0
        assert q.filter(pl.col("field") == "user_id").height == len(valid) + len(invalid)
    assert not res.turns["text"].str.contains(SIDE, literal=True).any()


# ---------------------------------------------------------------- whole-file garbage


@FUZZ
@given(blob=st.binary(max_size=2000), fmt=st.sampled_from(["locomo", "chatgpt", "jsonl"]))
def test_random_bytes_into_every_importer(tmp_path_factory, blob, fmt):
    """Random bytes: the JSON importers record one file-level failure; JSONL one per non-blank line."""
    suffix = ".jsonl" if fmt == "jsonl" else ".json"
    path = tmp_path_factory.mktemp("rand") / f"blob{suffix}"
    path.write_bytes(blob)
    res = validate(import_archive(path, fmt), now=NOW)
    assert_streaming_matches(path, res, fmt, max_text_chars=100_000)
    q = res.quarantine
    assert q["reason"].is_not_null().all() and (q["source_file"] == str(path)).all()
    if fmt == "jsonl":
        lines = [ln for ln in blob.split(b"\n") if ln.strip()]
        assert res.turns.height + q.height == len(lines)
    else:
        try:
            json.loads(blob)
            parsed = True
        except ValueError:
            parsed = False
        if not parsed:
            assert res.turns.height == 0 and q.height == 1 and q["field"][0] == "(file)"
