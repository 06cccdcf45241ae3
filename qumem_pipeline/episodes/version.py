"""The episodes stage's version: what it declares (`SPECS`, with the turns stage's it reads) and the
continuity classifier artifact's version, one of its inputs.

`qumem_pipeline.contracts.stage_versions` hashes the declaration; `qumem_pipeline/code_versions.py`
gathers every stage's. Never followed by the source digests."""

import functools
import json
import os
from pathlib import Path

from qumem_pipeline.contracts.stage_versions import StageSpec, full_version
from qumem_pipeline.ingest.version import SPECS as UPSTREAM_SPECS

DEFAULT_CLASSIFIER_DIR = Path(__file__).resolve().parents[1] / "artifacts" / "continuity"


def classifier_version(artifact_dir: str | None = None) -> str:
    """The classifier artifact's version, derived from its config.json (weights version + decision rule,
    checked against the stored `version`): a rule change moves it without anyone typing a version."""
    adir = Path(artifact_dir or os.environ.get("QUMEM_CLASSIFIER_DIR") or DEFAULT_CLASSIFIER_DIR)
    cfg = adir / "config.json"
    try:
        st = cfg.stat()
        version = _read_version_field(str(cfg), st.st_mtime_ns, st.st_size)
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError(f"continuity classifier artifact {cfg}: cannot read its `version` ({e})") from e
    from qumem_pipeline.episodes.continuity.decoding import version_with_precision  # numpy + json only

    return version_with_precision(version)


@functools.lru_cache(maxsize=64)
def _read_version_field(path: str, mtime_ns: int, size: int) -> str:
    """Cached per (file, mtime, size): rows call this per row, the file changes only on retraining."""
    from qumem_pipeline.episodes.continuity.decoding import version_of_config  # numpy + json only

    return version_of_config(json.loads(Path(path).read_text()))


SPECS: dict[str, StageSpec] = {
    **UPSTREAM_SPECS,
    "episodes": StageSpec(
        entries=("episodes.stage", "episodes.segmentation", "episodes.continuity.inference"),
        upstream=("turns",),
        inputs=lambda: (classifier_version(),),
    ),
}


def stage_version(stage: str = "episodes") -> str:
    """The `code_version` every episodes row carries (equal to the asset's code_version)."""
    return full_version(stage, SPECS)
