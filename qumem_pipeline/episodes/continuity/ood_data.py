"""An out-of-domain segmentation set built at run time: LoCoMo excerpts joined at known boundaries.

Why: the continuity classifier is trained and tuned on TIAGE (PersonaChat chit-chat). A held-back set
from another domain showed it learned TIAGE rather than topic continuity, and the project may not
look at that set. This builds a stand-in from data the project may use, never copying its text into
the repo: LoCoMo conversations (``../shared/datasets/locomo/locomo_dev5.json``) are long, multi-day
chats between two people, in normal case and punctuation, with longer turns — a different domain.

Construction (deterministic for a seed):

1. every session of every conversation is cut into consecutive, non-overlapping *chunks* of 4–10
   turns (lengths drawn with the seed; a tail shorter than 4 joins the chunk before it), so no turn
   is used twice and a third of the chunks open a session (greetings) while the rest start mid-chat;
2. sessions are split in two halves by a seeded permutation: ``calib`` (for choosing decision
   parameters) and ``eval`` (for reporting). No session contributes to both;
3. within a split the chunks are shuffled and joined into dialogues of 3–6 chunks, consecutive
   chunks always from *different* conversations (different people), so every join is a real topic
   change and the reference boundary is exactly the join. Topic drifts inside a chunk are not
   boundaries — as in sets built by joining whole dialogues (DialSeg711 and the like).

Output: the common "segments" format (``{"dial_id", "utterances", "segments"}``) that
``qumem eval segmentation`` reads, so ``python -m qumem_pipeline.episodes.continuity.ood_data --out F``
followed by ``qumem eval segmentation F`` works too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qumem_pipeline.episodes.dialogues import Dialogue, parse_segments
from qumem_pipeline.runtime.datasets import shared_datasets_dir

DEFAULT_SEED = 0
CHUNK_LEN = (4, 10)  # inclusive range of turns per joined excerpt
CHUNKS_PER_DIALOGUE = (3, 6)  # inclusive range of excerpts per joined dialogue
SPLITS = ("calib", "eval")
BUILDER_VERSION = "locomo-joined-v1"


def locomo_dev_path() -> Path:
    return shared_datasets_dir() / "locomo" / "locomo_dev5.json"


@dataclass(frozen=True)
class Chunk:
    conv_id: str
    session: int
    start: int  # 0-based turn index within the session
    texts: tuple[str, ...]


def locomo_sessions(path: str | os.PathLike) -> list[tuple[str, int, list[str]]]:
    """(conversation id, session number, turn texts) for every non-empty session, in file order."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a LoCoMo JSON list of conversations")
    out = []
    for ci, conv in enumerate(data):
        sid = str(conv.get("sample_id", ci))
        c = conv.get("conversation")
        if not isinstance(c, dict):
            raise ValueError(f"{path}: conversation {ci} ({sid}) has no 'conversation' object")
        nums = sorted(int(k.split("_")[1]) for k in c
                      if k.startswith("session_") and k.count("_") == 1 and isinstance(c[k], list))
        for s in nums:
            texts = [str(t.get("text", "")).strip() for t in c[f"session_{s}"] if isinstance(t, dict)]
            texts = [t for t in texts if t]
            if texts:
                out.append((sid, s, texts))
    return out


def chunk_session(conv_id: str, session: int, texts: list[str], rng: np.random.Generator,
                  lengths: tuple[int, int] = CHUNK_LEN) -> list[Chunk]:
    lo, hi = lengths
    out, pos = [], 0
    while pos < len(texts):
        n = int(rng.integers(lo, hi + 1))
        if len(texts) - (pos + n) < lo:  # a short tail joins this chunk
            n = len(texts) - pos
        out.append(Chunk(conv_id, session, pos, tuple(texts[pos : pos + n])))
        pos += n
    return out


def join_chunks(chunks: list[Chunk], rng: np.random.Generator, split: str,
                per_dialogue: tuple[int, int] = CHUNKS_PER_DIALOGUE) -> list[dict]:
    """Shuffle, then greedily join; the next chunk is the first left whose conversation differs."""
    pool = [chunks[i] for i in rng.permutation(len(chunks))]
    dialogues = []
    while len(pool) >= 2:
        want = int(rng.integers(per_dialogue[0], per_dialogue[1] + 1))
        parts = [pool.pop(0)]
        while len(parts) < want:
            j = next((i for i, c in enumerate(pool) if c.conv_id != parts[-1].conv_id), None)
            if j is None:
                break
            parts.append(pool.pop(j))
        if len(parts) < 2:
            break  # only chunks of one conversation are left: no join possible
        dialogues.append({
            "dial_id": f"ood-{split}-{len(dialogues):03d}",
            "utterances": [t for c in parts for t in c.texts],
            "segments": [len(c.texts) for c in parts],
            "sources": [f"{c.conv_id}:S{c.session}:{c.start}" for c in parts],
        })
    return dialogues


def _sessions(path: str | os.PathLike | None) -> list[tuple[str, int, list[str]]]:
    path = Path(path) if path is not None else locomo_dev_path()
    if not path.is_file():
        raise FileNotFoundError(f"LoCoMo file not found at {path} (the OOD set is built from it)")
    return locomo_sessions(path)


def build_ood(path: str | os.PathLike | None = None, seed: int = DEFAULT_SEED) -> dict[str, list[dict]]:
    """Both splits, as "segments"-format records (plus ``sources``: conversation:session:first turn)."""
    sessions = _sessions(path)
    rng = np.random.default_rng(seed)
    side = rng.permutation(len(sessions)) % 2  # half the sessions to each split
    chunks: dict[str, list[Chunk]] = {s: [] for s in SPLITS}
    for (cid, s, texts), k in zip(sessions, side):
        chunks[SPLITS[int(k)]].extend(chunk_session(cid, s, texts, rng))
    return {split: join_chunks(chunks[split], rng, split) for split in SPLITS}


def build_ood_train(path: str | os.PathLike | None = None, seed: int = DEFAULT_SEED,
                    rejoin_seed: int = 1) -> list[dict]:
    """Training dialogues for the classifier from the ``calib`` sessions of ``seed`` only, cut and
    joined again with ``rejoin_seed``: other excerpts and other joins than ``calib``'s, and never a
    session of ``eval``, so the eval half stays a clean report for a classifier trained on these."""
    sessions = _sessions(path)
    side = np.random.default_rng(seed).permutation(len(sessions)) % 2  # the same halves as build_ood
    rng = np.random.default_rng([seed, rejoin_seed])
    chunks = [c for (cid, s, texts), k in zip(sessions, side) if SPLITS[int(k)] == "calib"
              for c in chunk_session(cid, s, texts, rng)]
    return join_chunks(chunks, rng, "train")


def ood_dialogues(split: str = "eval", path: str | os.PathLike | None = None,
                  seed: int = DEFAULT_SEED) -> list[Dialogue]:
    if split not in SPLITS:
        raise ValueError(f"unknown OOD split {split!r}; expected one of {SPLITS}")
    return parse_segments(build_ood(path, seed)[split]).dialogues


def ood_train_dialogues(path: str | os.PathLike | None = None, seed: int = DEFAULT_SEED,
                        rejoin_seed: int = 1) -> list[Dialogue]:
    return parse_segments(build_ood_train(path, seed, rejoin_seed)).dialogues


def describe(records: list[dict]) -> dict:
    n_utt = sum(len(r["utterances"]) for r in records)
    n_seg = sum(len(r["segments"]) for r in records)
    return {"n_dialogues": len(records), "n_utterances": n_utt, "n_boundaries": n_seg - len(records),
            "mean_segment_len": round(n_utt / n_seg, 2) if n_seg else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qumem_pipeline.episodes.continuity.ood_data", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--locomo", default=None, help="LoCoMo JSON (default: ../shared/datasets/locomo/locomo_dev5.json)")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--split", choices=SPLITS, default="eval")
    ap.add_argument("--out", default=None, help="write the split here (segments format); default: stats only")
    args = ap.parse_args(argv)
    records = build_ood(args.locomo, args.seed)[args.split]
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=out.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(records, f)
        os.replace(tmp, out)
    print(json.dumps({"builder": BUILDER_VERSION, "seed": args.seed, "split": args.split, **describe(records),
                      **({"out": args.out} if args.out else {})}), file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
