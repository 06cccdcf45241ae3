"""A small two-participant history (LoCoMo-shaped) shared by the AdaMem tests.

Turn i is said by Caroline (the user) when i is even, Melanie (the other speaker) when odd; three
episodes of four turns; memories cite evidence turns inside their episode. Memory positions are
their latest evidence turn, as the decomposer writes them.
"""

from datetime import datetime, timedelta, timezone

import polars as pl

USER = "conv-1-caroline"
TEXTS = [
    # episode e0 (turns 0-3): adoption plans
    "I went to the adoption agency meeting on Monday, it was really moving.",
    "That's wonderful, Caroline! Are you still planning to adopt?",
    "Yes, adoption is my dream, I want to give a kid a loving home.",
    "Your kids will be lucky. I took my family camping at the lake last weekend.",
    # episode e1 (turns 4-7): pottery and painting
    "I signed up for a pottery class, the clay wheel is harder than it looks.",
    "I painted a sunrise over the lake last week, painting relaxes me.",
    "Pottery and painting both need patience, I love that.",
    "My dog Snorlaxia finally came home, the stitches came out fine.",
    # episode e2 (turns 8-11): adoption again, counseling
    "The adoption agency called back, my application moved forward.",
    "Great news! Will you keep working in counseling?",
    "Yes, counseling for trans youth matters a lot to me.",
    "The vet clinic downtown treats dogs after surgery, very caring people.",
]
EPISODES = [("e0", [0, 1, 2, 3]), ("e1", [4, 5, 6, 7]), ("e2", [8, 9, 10, 11])]
MEMORIES = [
    ("m-adopt", "fact", "Caroline attended an adoption agency meeting.", "e0", [0]),
    ("m-dream", "preference", "Caroline wants to adopt a child and give a kid a loving home.", "e0", [2]),
    ("m-camp", "fact", "Melanie took her family camping at the lake.", "e0", [3]),
    ("m-pottery", "fact", "Caroline signed up for a pottery class.", "e1", [4]),
    ("m-paint", "fact", "Melanie painted a sunrise over the lake.", "e1", [5]),
    ("m-patience", "insight", "Caroline values activities that need patience.", "e1", [6]),
    ("m-app", "fact", "Caroline's adoption application moved forward.", "e2", [8]),
    ("m-counsel", "preference", "Caroline is committed to counseling trans youth.", "e2", [10]),
]
T0 = datetime(2023, 5, 1, 9, 0, tzinfo=timezone.utc)


def turns() -> pl.DataFrame:
    n = len(TEXTS)
    return pl.DataFrame({
        "user_id": [USER] * n, "conversation_id": ["conv-1"] * n,
        "session_id": [f"s{i // 4}" for i in range(n)], "turn_index": list(range(n)),
        "role": ["user" if i % 2 == 0 else "other" for i in range(n)],
        "speaker": ["Caroline" if i % 2 == 0 else "Melanie" for i in range(n)], "text": TEXTS,
        "timestamp": [T0 + timedelta(days=7 * (i // 4), minutes=i) for i in range(n)],
        "source_ref": [f"D{i // 4 + 1}:{i % 4 + 1}" for i in range(n)],
    })


def episodes() -> pl.DataFrame:
    return pl.DataFrame({
        "episode_id": [e for e, _ in EPISODES], "user_id": [USER] * len(EPISODES),
        "episode_index": list(range(len(EPISODES))), "first_turn_index": [t[0] for _, t in EPISODES],
        "last_turn_index": [t[-1] for _, t in EPISODES], "turn_ids": [t for _, t in EPISODES],
    }, schema_overrides={"turn_ids": pl.List(pl.Int64)})


def memories() -> pl.DataFrame:
    return pl.DataFrame({
        "memory_id": [m[0] for m in MEMORIES], "user_id": [USER] * len(MEMORIES), "type": [m[1] for m in MEMORIES],
        "content": [m[2] for m in MEMORIES], "episode_id": [m[3] for m in MEMORIES],
        "evidence_turn_ids": [m[4] for m in MEMORIES], "position": [max(m[4]) for m in MEMORIES],
        "valid_from": [T0 + timedelta(days=7 * (max(m[4]) // 4)) for m in MEMORIES],
    }, schema_overrides={"evidence_turn_ids": pl.List(pl.Int64), "valid_from": pl.Datetime("us", "UTC")})
