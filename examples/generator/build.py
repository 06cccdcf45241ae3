"""Build examples/archive/*.jsonl and examples/queries.jsonl from content.py (deterministic).

    python examples/generator/build.py examples
"""

import json
import random
import sys
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from content import QUERIES, USERS  # noqa: E402

OUT = Path(sys.argv[1])
ARCH = OUT / "archive"
ARCH.mkdir(parents=True, exist_ok=True)


def iso(dt):
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def dumps(obj):
    return json.dumps(obj, ensure_ascii=False)


rng = random.Random(20240101)
rows = []  # (timestamp dt, user, json line str, source_ref)
by_ref = {}
for uid, u in USERS.items():
    idx = 0
    for sn, (start, turns) in enumerate(u["sessions"], start=1):
        assert len(turns) % 2 == 0, (uid, sn)
        t = datetime.fromisoformat(start.replace("Z", "+00:00"))
        for k, text in enumerate(turns, start=1):
            role = "user" if k % 2 == 1 else "assistant"
            ref = f"{uid}-s{sn}-{k:02d}"
            rec = {
                "user_id": uid,
                "conversation_id": f"{uid}-chat-{sn}",
                "session_id": f"{uid}-s{sn}",
                "turn_index": idx,
                "role": role,
                "speaker": u["name"] if role == "user" else "assistant",
                "text": text,
                "timestamp": iso(t),
                "source_ref": ref,
            }
            line = dumps(rec)
            rows.append((t, uid, line, ref))
            by_ref[ref] = (t, rec, line)
            idx += 1
            t += timedelta(seconds=rng.randint(25, 70) if role == "user" else rng.randint(40, 180))
    print(uid, idx, "turns", len(u["sessions"]), "sessions")

rows.sort(key=lambda r: (r[0], r[1]))
files = {"2024-q1.jsonl": [], "2024-q2.jsonl": [], "2024-q3.jsonl": []}
for t, uid, line, ref in rows:
    q = (t.month - 1) // 3 + 1
    files[f"2024-q{q}.jsonl"].append((ref, line.encode("utf-8")))


def ts_after(ref, seconds=20):
    return iso(by_ref[ref][0] + timedelta(seconds=seconds))


def rec(uid, sn, role, ts, ref, **extra):
    r = {
        "user_id": uid,
        "conversation_id": f"{uid}-chat-{sn}",
        "session_id": f"{uid}-s{sn}",
        "role": role,
        "speaker": USERS[uid]["name"] if role == "user" else role,
    }
    r.update(extra)
    r["timestamp"] = ts
    r["source_ref"] = ref
    return r


oversize_head = "Here is my whole field log so you can check it for typos:\n"
log_rows = []
n = 0
while len(oversize_head) + sum(len(x) for x in log_rows) < 100_100:
    n += 1
    log_rows.append(f"PL-{n % 3 + 1},2024-07-{n % 28 + 1:02d},{8 + n % 9},stipes={n * 7 % 41},urchins={n * 13 % 57}\n")
oversize_text = (oversize_head + "".join(log_rows))[:100_100]
assert len(oversize_text) == 100_100

truncated = dumps(rec("dana", 4, "user", ts_after("dana-s4-04"), "dana-s4-x1",
                      text="Sorry, my connection dropped, what was the glmer offset again? I think I need the area in"))
truncated = truncated[: truncated.index("glmer offset") + len("glmer offset")]

bad_utf8 = dumps(rec("chen", 4, "user", ts_after("chen-s4-02"), "chen-s4-x1",
                     text="PLACEHOLDER")).encode("utf-8")
bad_utf8 = bad_utf8.replace(b"PLACEHOLDER", b"Also, is there a good caf\xe9 to work from near Mile End?")

dup_line = by_ref["bob-s3-03"][2]

# (file, insert after source_ref, bytes, what is wrong, expected outcome)
BAD = [
    ("2024-q1.jsonl", "alice-s1-14",
     dumps(rec("alice", 1, "user", ts_after("alice-s1-14", 60), "alice-s1-x1")).encode(),
     "missing text (no `text` key)", "quarantine: field `text`, reason `missing text`"),
    ("2024-q1.jsonl", "bob-s1-06",
     dumps(rec("bob", 1, "robot", ts_after("bob-s1-06"), "bob-s1-x1",
               text="Reminder set: pick up the engraved spoon on Friday.")).encode(),
     "unknown role `robot`", "quarantine: field `role`, reason `unknown role 'robot' (expected one of user, assistant, other)`"),
    ("2024-q1.jsonl", "chen-s1-04", dumps(["chen", "are you there?"]).encode(),
     "a JSON array, not an object", "ParseFailure: field `(line)`, reason `expected a JSON object, got list`"),
    ("2024-q2.jsonl", "chen-s3-02",
     dumps(rec("chen", 3, "user", "sometime in June", "chen-s3-x1",
               text="Can you add the lease dates to the checklist too?")).encode(),
     "unparseable timestamp `sometime in June`", "quarantine: field `timestamp`, reason `unparseable timestamp 'sometime in June'`"),
    ("2024-q2.jsonl", "bob-s3-06", dup_line.encode("utf-8"),
     "exact duplicate of the row for bob-s3-03 (same user_id, turn_index and source_ref)",
     "quarantine: field `turn_index`, reason `duplicate turn id: turn_index {ti} already seen for this user`"),
    ("2024-q2.jsonl", "alice-s3-04",
     dumps({"user_id": "../etc", "conversation_id": "etc-chat-1", "session_id": "etc-s1", "role": "user",
            "speaker": "?", "text": "cat /etc/passwd", "timestamp": "2024-04-24T18:20:00Z",
            "source_ref": "etc-1"}).encode(),
     "invalid user id `../etc`", "quarantine (unattributed): field `user_id`, reason `invalid user id (allowed: ...)`"),
    ("2024-q2.jsonl", "dana-s3-04",
     dumps(rec("dana", 3, "user", ts_after("dana-s3-04"), "dana-s3-x1", text="   ")).encode(),
     "whitespace-only text", "quarantine: field `text`, reason `missing text`"),
    ("2024-q3.jsonl", "dana-s4-04", truncated.encode(),
     "truncated JSON line (cut off mid-string)", "ParseFailure: field `(line)`, reason `invalid JSON: ...`"),
    ("2024-q3.jsonl", "chen-s4-02", bad_utf8,
     "invalid UTF-8: a Latin-1 byte 0xE9 in the text", "ParseFailure: field `(line)`, reason `not valid UTF-8 at byte N`"),
    ("2024-q3.jsonl", "dana-s4-10",
     dumps(rec("dana", 4, "user", ts_after("dana-s4-10"), "dana-s4-x2", text=oversize_text)).encode(),
     "oversize text: 100,100 characters", "quarantine: field `text`, reason `oversize text: 100100 chars > limit 100000`"),
]

inserted = {f: {} for f in files}
for fname, after, data, what, expect in BAD:
    inserted[fname].setdefault(after, []).append((data, what, expect))

table = []
for fname, lines in files.items():
    out = []
    for ref, data in lines:
        out.append(data)
        for bdata, what, expect in inserted[fname].get(ref, []):
            out.append(bdata)
            if "{ti}" in expect:
                expect = expect.format(ti=by_ref["bob-s3-03"][1]["turn_index"])
            table.append((fname, len(out), what, expect))
    (ARCH / fname).write_bytes(b"\n".join(out) + b"\n")
    print(fname, len(out), "lines")

with open(OUT / "queries.jsonl", "w", encoding="utf-8") as f:
    for qid, uid, q, as_of, expected in QUERIES:
        f.write(dumps({"query_id": qid, "user_id": uid, "query": q, "as_of": as_of, "expected": expected}) + "\n")

for row in table:
    print(" | ".join(str(x) for x in row))
print(json.dumps([list(r) for r in table], indent=1))  # the planted bad rows (see archive/README.md)
