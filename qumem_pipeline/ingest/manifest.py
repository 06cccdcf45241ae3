"""The ingest manifest: which archive files are in the tables, and in what state.

One row per ingested file: its id (path relative to the archive root), the path it was read
from, size, mtime, content digest (BLAKE3, in the column `sha256`) and the ingest version. A file is *unchanged* when size and mtime
equal the manifest's (nothing is read), or when they moved but the content hash did not; it is
*changed* when the hash differs or it was ingested under another ingest version (the
validation rules changed), *new* when the manifest has no row for it, *gone* when the manifest
has a row and the archive no longer has the file.

Stored through DataLayout as the table `ingest_manifest` under the unattributed key (it
belongs to no user). Which users each file holds is a per-user table (`ingest_file_users`), so
forgetting a user removes that too.

A file id or path may name its user (`archive/alice/history.jsonl`, `alice.jsonl`). A file whose
users were all forgotten is listed under a keyed id instead (`forgotten-file:<key id>:<HMAC of
the file id under the tombstone secret>`, as its path too): the forget keys it
(`ingest.sync.key_forgotten_files`), the sync recognises it (`plan_files(keyed=...)`) and keeps
it keyed while its rows stay all forgotten, so the manifest names no forgotten user's file and an
unchanged file is still not read again.
"""

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from qumem_pipeline.contracts.schema import UNATTRIBUTED
from qumem_pipeline.ingest.importers import WHOLE_FILE_FORMATS
from qumem_pipeline.ingest.stream import file_format, hash_file, stat_key

MANIFEST_TABLE = "ingest_manifest"
FILE_USERS_TABLE = "ingest_file_users"
MANIFEST_SCHEMA = {
    "file_id": pl.String,
    "path": pl.String,
    "format": pl.String,
    "size": pl.Int64,
    "mtime_ns": pl.Int64,
    "sha256": pl.String,  # the file's content digest, "blake3:<hex>" (the column keeps its first name)
    "ingest_version": pl.String,
    "rows": pl.Int64,
    "quarantined": pl.Int64,
}
FILE_USERS_SCHEMA = {"user_id": pl.String, "file_id": pl.String}
FORGOTTEN_FILE_PREFIX = "forgotten-file:"


def keyed_file_ids(tombstones, file_id: str) -> list[str]:
    """The keyed ids a file whose users were all forgotten is listed under, one per tombstone key in
    use (the current key's first): `tombstones` is the root's `storage.tombstones.Tombstones`."""
    out = []
    for key in tombstones.keys:
        kid, digest = tombstones.digest("file:" + file_id, key)
        out.append(f"{FORGOTTEN_FILE_PREFIX}{kid}:{digest}")
    return out


def is_keyed(file_id: str | None) -> bool:
    return bool(file_id) and file_id.startswith(FORGOTTEN_FILE_PREFIX)


@dataclass(frozen=True)
class ArchiveFile:
    file_id: str
    path: Path
    format: str
    size: int
    mtime_ns: int


@dataclass
class FilePlan:
    files: list[ArchiveFile]  # every file of the archive now, in archive order (= history tie order)
    new: list[ArchiveFile] = field(default_factory=list)
    changed: list[ArchiveFile] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)  # file ids
    unchanged: list[ArchiveFile] = field(default_factory=list)
    hashes: dict[str, str] = field(default_factory=dict)  # file_id -> content digest of files hashed this run
    old: dict[str, dict] = field(default_factory=dict)  # the manifest as read
    keyed: dict[str, str] = field(default_factory=dict)  # file_id -> the keyed id its manifest row has

    @property
    def to_read(self) -> list[ArchiveFile]:
        return self.new + self.changed

    @property
    def replaced_ids(self) -> set[str]:
        """Files whose old rows must leave the tables: changed and gone ones."""
        return {f.file_id for f in self.changed} | set(self.gone)

    @property
    def touched(self) -> bool:
        return bool(self.new or self.changed or self.gone)


def _root_of(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        return p
    if p.is_file():
        return p.parent
    static = []  # a glob: the part before the first wildcard
    for part in p.parts:
        if any(ch in part for ch in "*?["):
            break
        static.append(part)
    return Path(*static) if static else Path(".")


def list_archive(path: str, archive_format: str | None) -> list[ArchiveFile]:
    """Every file of the archive with its size and mtime (a stat each, no read)."""
    from qumem_pipeline.ingest.importers import detect_format
    from qumem_pipeline.ingest.importers.canonical import expand_paths

    if not os.path.exists(path) and not any(ch in path for ch in "*?["):
        raise FileNotFoundError(f"archive not found: {path}")
    fmt = archive_format or detect_format(path)
    if fmt in WHOLE_FILE_FORMATS:
        paths = [Path(path)] if Path(path).is_file() else sorted(Path(m) for m in glob.glob(path) if Path(m).is_file())
    else:
        paths = expand_paths(path)
    root = _root_of(path)
    out = []
    for p in paths:
        size, mtime = stat_key(p)
        out.append(ArchiveFile(Path(os.path.relpath(p, root)).as_posix(), p, file_format(p, fmt), size, mtime))
    return out


def read_manifest(layout) -> dict[str, dict]:
    df = layout.read_user_table(MANIFEST_TABLE, UNATTRIBUTED)
    return {} if df is None else {r["file_id"]: r for r in df.iter_rows(named=True)}


def plan_files(files: list[ArchiveFile], manifest: dict[str, dict], ingest_version: str, keyed=None,
               hash_moved: bool = True) -> FilePlan:
    """Sort the archive's files into new / changed / unchanged / gone; hash only those whose
    size or mtime moved (an unchanged archive is not read at all). `keyed(file_id)`: the keyed ids
    a file of forgotten users may be listed under (`keyed_file_ids`), tried only when some are.
    `hash_moved=False` (a tick's look: no file is opened) counts a moved file as changed unhashed."""
    plan = FilePlan(files=files, old=manifest)
    any_keyed = keyed is not None and any(is_keyed(k) for k in manifest)
    for f in files:
        row = manifest.get(f.file_id)
        if row is None and any_keyed:
            for k in keyed(f.file_id):
                if k in manifest:
                    row, plan.keyed[f.file_id] = manifest[k], k
                    break
        if row is None:
            plan.new.append(f)
        elif row["ingest_version"] != ingest_version:
            plan.changed.append(f)
        elif (row["size"], row["mtime_ns"]) == (f.size, f.mtime_ns):
            plan.unchanged.append(f)
        elif not hash_moved:
            plan.changed.append(f)
        else:
            digest = hash_file(f.path)
            plan.hashes[f.file_id] = digest
            (plan.unchanged if digest == row["sha256"] else plan.changed).append(f)
    here = {f.file_id for f in files} | set(plan.keyed.values())
    plan.gone = sorted(fid for fid in manifest if fid not in here)
    return plan


def manifest_frame(rows: list[dict]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=MANIFEST_SCHEMA) if rows else pl.DataFrame(schema=MANIFEST_SCHEMA)
