"""Which users does a nightly rebuild need, and how are they packed into runs?

Pure decisions (no Dagster), so they are unit-tested on their own:

* a user needs a rebuild when it is new (no partition yet), was never materialized, its archive
  fingerprint differs from the one recorded at its last `turns` materialization, or its last run
  stopped part-way (the job's final asset is older than its `turns`);
* a registered user that left the archive (every source file holding their rows was withdrawn, or
  all their rows are now quarantined) is rebuilt too, once: the run writes them as present and
  empty in every downstream table and the warehouse, and records the empty fingerprint, so the
  next night sees them as unchanged (deleting the user and their partition is `qumem forget`'s job);
* Dagster schedules can launch one partition or one contiguous partition *range* per run
  (`dagster/asset_partition_range_start|end`), so the users to rebuild are packed into maximal
  ranges of the partition order that contain only those users, each at most `max_per_run` long.
  An unchanged user inside the order splits a range: it is never rebuilt as a side effect.
"""

from dataclasses import dataclass, field

from qumem_pipeline.ingest.archive import EMPTY_FINGERPRINT

# Fingerprints are recorded in run metadata as this many hex characters (64 bits): enough to tell
# content apart, small enough that a run's metadata stays small.
RECORDED_FINGERPRINT_CHARS = 16


def recorded_form(fingerprint: str) -> str:
    return fingerprint[:RECORDED_FINGERPRINT_CHARS]


@dataclass(frozen=True)
class RebuildPlan:
    new: list[str]  # in the archive, no partition yet (sorted)
    changed: list[str]  # partition exists; content differs or never materialized (sorted)
    unchanged: list[str]  # includes users that left the archive and were already emptied
    removed: list[str] = field(default_factory=list)  # registered, gone from the archive, not yet emptied (sorted)

    @property
    def to_rebuild(self) -> set[str]:
        return set(self.new) | set(self.changed) | set(self.removed)


def unfinished(turns_ids: dict[str, int], final_ids: dict[str, int]) -> set[str]:
    """Users whose final asset was last materialized before their `turns` (event-log storage ids).

    A run that wrote `turns` and then failed leaves downstream assets older than the recorded
    fingerprint; without this the next night would see "unchanged" and never finish the user.
    """
    return {u for u, sid in turns_ids.items() if final_ids.get(u, -1) < sid}


def plan_rebuild(
    current: dict[str, str], registered: list[str], recorded: dict[str, str], incomplete: set[str] = frozenset()
) -> RebuildPlan:
    """Compare archive fingerprints (`current`, full) with those recorded at the last materialization.

    `recorded` maps user -> recorded fingerprint (`recorded_form`); a registered user missing from it
    was never materialized (or its run failed) and is rebuilt, as is every user in `incomplete`.
    A registered user absent from `current` left the archive: it is `removed` (rebuilt as empty)
    unless its last finished materialization already recorded the empty fingerprint. Pass
    `registered` without forgotten users: they are `qumem forget`'s, never rebuilt.
    """
    known = set(registered)
    new = sorted(u for u in current if u not in known)
    changed, unchanged, removed = [], [], []
    for u in sorted(u for u in current if u in known):
        same = recorded.get(u) == recorded_form(current[u]) and u not in incomplete
        (unchanged if same else changed).append(u)
    emptied = recorded_form(EMPTY_FINGERPRINT)
    for u in sorted(known - set(current)):
        done = recorded.get(u) == emptied and u not in incomplete
        (unchanged if done else removed).append(u)
    return RebuildPlan(new=new, changed=changed, unchanged=sorted(unchanged), removed=removed)


def contiguous_ranges(order: list[str], selected: set[str], max_per_run: int) -> list[list[str]]:
    """Split `order` into maximal runs of consecutive selected keys, each at most `max_per_run` long.

    Every selected key in `order` lands in exactly one range; no unselected key lands in any.
    """
    if max_per_run < 1:
        raise ValueError(f"max_per_run must be >= 1, got {max_per_run}")
    missing = selected - set(order)
    if missing:
        raise ValueError(f"users to rebuild are not in the partition order: {sorted(missing)[:5]}")
    ranges: list[list[str]] = []
    current: list[str] = []
    for key in order:
        if key in selected:
            current.append(key)
            if len(current) == max_per_run:
                ranges.append(current)
                current = []
        elif current:
            ranges.append(current)
            current = []
    if current:
        ranges.append(current)
    return ranges
