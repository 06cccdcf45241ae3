"""Which users does the archive hold, and whose content changed since we last looked?"""

from dataclasses import dataclass

from qumem_pipeline.storage.forget import ForgetRegistry
from qumem_pipeline.ingest.archive import ArchiveConfig, load_archive, user_fingerprints


@dataclass(frozen=True)
class Discovery:
    fingerprints: dict[str, str]  # user -> content fingerprint, for users with >= 1 valid turn
    new: list[str]
    changed: list[str]
    removed: list[str]  # known before, absent now (kept: deleting data is `forget`'s job)


def discover(cfg: ArchiveConfig, known: dict[str, str], forgotten: ForgetRegistry | None = None) -> Discovery:
    result = load_archive(cfg, forgotten=forgotten)
    fps = user_fingerprints(result.turns)
    new = sorted(u for u in fps if u not in known)
    changed = sorted(u for u in fps if u in known and known[u] != fps[u])
    removed = sorted(u for u in known if u not in fps)
    return Discovery(fingerprints=fps, new=new, changed=changed, removed=removed)
