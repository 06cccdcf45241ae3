"""Which users does the archive hold, and whose content changed since we last looked?

With a layout, discovery first brings the tables up to date with the archive (`sync_archive`:
only new or changed files are read) and then takes every user's fingerprint from the
fingerprints table, so a check costs O(changed files), not O(archive). With `sync=False` (the
nightly schedule's and the discovery sensor's ticks) it reads the fingerprints table only, as the
last sync left it: the sync runs in a Dagster run of its own (assets/archive_sync.py), not inside
a tick and its evaluation timeout. Without a layout it reads and validates the whole archive in
memory (the old path, kept for tools and tests).
"""

from dataclasses import dataclass

from qumem_pipeline.storage.forget import ForgetRegistry
from qumem_pipeline.ingest.archive import ArchiveConfig, load_archive, user_fingerprints


@dataclass(frozen=True)
class Discovery:
    fingerprints: dict[str, str]  # user -> content fingerprint, for users with >= 1 valid turn
    new: list[str]
    changed: list[str]
    removed: list[str]  # known before, absent now (kept: deleting data is `forget`'s job)
    # With a layout: the fingerprints table's content state (its data files), read before its rows
    fingerprints_state: str | None = None


def discover(cfg: ArchiveConfig, known: dict[str, str], forgotten: ForgetRegistry | None = None, layout=None,
             progress=None, unless_state: str | None = None, sync: bool = True) -> Discovery | None:
    """`progress(stage, done, total)`: the sync's progress (`sync_archive`), when there is a layout.
    `sync=False`: no archive file is listed or read, the fingerprints table is taken as it stands.

    `unless_state` (with a layout): None, and no fingerprint read, when after the sync the
    fingerprints table still holds the same data files (`TableStore.content_state`): no fingerprint
    can have changed, so an unchanged archive costs a tick the sync's look at the files, not a read
    of every user. The state is taken before the rows are read, so a later change always shows."""
    state = None
    if layout is not None:
        from qumem_pipeline.ingest.sync import stored_fingerprints, sync_archive

        if sync:
            sync_archive(cfg, layout, forgotten=forgotten, progress=progress)
        state = layout.store.content_state("fingerprints")
        if unless_state is not None and state == unless_state:
            return None
        fps = stored_fingerprints(layout, forgotten)
    else:
        fps = user_fingerprints(load_archive(cfg, forgotten=forgotten).turns)
    new = sorted(u for u in fps if u not in known)
    changed = sorted(u for u in fps if u in known and known[u] != fps[u])
    removed = sorted(u for u in known if u not in fps)
    return Discovery(fingerprints=fps, new=new, changed=changed, removed=removed, fingerprints_state=state)
