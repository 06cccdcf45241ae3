"""Where the shared public datasets live (never copied into the repo).

Resolution order: the ``QUMEM_SHARED_DATASETS`` environment variable, else
``<repo root>/../shared/datasets`` (the repo root is the parent of the ``qumem_pipeline`` package).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "QUMEM_SHARED_DATASETS"
TIAGE_SPLITS = ("train", "dev", "test")


def shared_datasets_dir() -> Path:
    """The shared datasets directory (may not exist: callers check and skip with a reason)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    repo_root = Path(__file__).resolve().parents[2]
    return repo_root.parent / "shared" / "datasets"


def tiage_dir() -> Path:
    return shared_datasets_dir() / "tiage"


def tiage_path(split: str) -> Path:
    """Path of TIAGE ``anno_<split>.json`` (train, dev or test)."""
    if split not in TIAGE_SPLITS:
        raise ValueError(f"unknown TIAGE split {split!r}; expected one of {TIAGE_SPLITS}")
    return tiage_dir() / f"anno_{split}.json"


def tiage_available(*splits: str) -> bool:
    """True when all requested TIAGE splits (default: all three) exist."""
    return all(tiage_path(s).is_file() for s in (splits or TIAGE_SPLITS))


def missing_reason(path: Path) -> str:
    return (
        f"dataset file {path} not found; set {ENV_VAR} to the shared datasets directory "
        f"(expected layout: <dir>/tiage/anno_*.json)"
    )
