"""Per-user, per-type FAISS indexes over memory embeddings, with temporal (as_of) filtering.

Persistence: two user-keyed tables of the table store (no per-user files; forgetting a user
deletes their rows like any other table's)::

    indexes     user_id, type, ntotal, faiss (bytes of faiss.serialize_index: IndexIDMap2(IndexFlatIP(dim)))
    index_ids   id (int64) -> memory_id, type, position

Ids are stable: the first 8 bytes of sha256(memory_id), big-endian, masked to 63 bits (always a
non-negative int64). The same memory keeps the same id across rebuilds; two memory ids of one user
that collide raise :class:`IdCollisionError` (never silently merged).

Exact inner product (= cosine on unit-norm vectors) is right at per-user sizes. The build runs on
the GPU (one ``StandardGpuResources`` reused, ``index_cpu_to_gpu`` ... ``index_gpu_to_cpu``) when
faiss has GPU support and a GPU is visible, else on the CPU; a run's users are written in one
transaction per table; the id map is written last and the loader checks it against every index,
so a half-written rebuild is detected, not served.

Search never returns a memory whose position is after ``as_of_position``: the eligible ids are
passed to faiss as an ``IDSelectorBatch`` (exact: the best eligible memories, however many future
ones score higher), and results are checked again afterwards. Where a selector cannot be used
(``use_selector=False``, e.g. a GPU-resident index), the search over-fetches, drops future
memories and widens (doubling k) until k eligible results or the index is exhausted.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import faiss
import numpy as np
import polars as pl

from qumem_pipeline.index.embeddings import embeddings_matrix
from qumem_pipeline.index.faiss_build import build_index, gpu_available, gpu_resources, new_index
from qumem_pipeline.runtime.faults import fault_point
from qumem_pipeline.index.version import stage_version
from qumem_pipeline.storage.layout import DataLayout

MEMORY_TYPES = ("fact", "preference", "insight")
TYPE_ALIASES = {"f": "fact", "fact": "fact", "facts": "fact", "factual": "fact",
                "p": "preference", "preference": "preference", "preferences": "preference",
                "i": "insight", "insight": "insight", "insights": "insight"}
INDEX_TABLE = "indexes"
IDMAP_TABLE = "index_ids"
ID_MASK = (1 << 63) - 1

IDMAP_SCHEMA = pl.Schema(
    {
        "id": pl.Int64,
        "memory_id": pl.String,
        "user_id": pl.String,
        "type": pl.String,
        "position": pl.Int64,
        "embedding_model": pl.String,
    }
)


class IdCollisionError(ValueError):
    """Two different memory ids of one user hash to the same int64 id."""


class StaleIndexError(RuntimeError):
    """An index file and the id map disagree (e.g. a rebuild was interrupted): rebuild the user."""


def normalize_type(t: str) -> str:
    """'F'/'fact'/'facts' -> 'fact', etc.; anything else raises ValueError."""
    key = str(t).strip().lower()
    if key not in TYPE_ALIASES:
        raise ValueError(f"unknown memory store {t!r}; expected one of {MEMORY_TYPES} (or F/P/I)")
    return TYPE_ALIASES[key]


def stable_id(memory_id: str) -> int:
    """int64 id of a memory: sha256(memory_id)[:8] big-endian, masked to 63 bits (non-negative)."""
    return int.from_bytes(hashlib.sha256(memory_id.encode("utf-8")).digest()[:8], "big") & ID_MASK


def assign_ids(memory_ids: Sequence[str]) -> np.ndarray:
    """Stable ids for the memory ids, raising IdCollisionError on a collision between distinct ids."""
    ids = np.fromiter((stable_id(m) for m in memory_ids), dtype=np.int64, count=len(memory_ids))
    seen: dict[int, str] = {}
    for i, m in zip(ids.tolist(), memory_ids):
        other = seen.setdefault(i, m)
        if other != m:
            raise IdCollisionError(f"memory ids {other!r} and {m!r} both map to int64 id {i}")
    return ids


# ---------------------------------------------------------------------------------------- index

@dataclass
class TypeIndex:
    """One user's index for one memory type, with positions aligned to its ids."""

    type: str
    index: faiss.Index
    ids: np.ndarray  # int64, in index order
    memory_ids: list[str]
    positions: np.ndarray  # int64, aligned with ids
    _by_id: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._by_id = {int(i): k for k, i in enumerate(self.ids.tolist())}

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)


@dataclass
class UserIndexes:
    """All of one user's per-type indexes."""

    user_id: str
    dim: int
    embedding_model: str | None
    by_type: dict[str, TypeIndex]
    built_on: str = "cpu"

    def idmap_frame(self) -> pl.DataFrame:
        rows = []
        for t in MEMORY_TYPES:
            ti = self.by_type.get(t)
            if ti is None:
                continue
            for i, m, p in zip(ti.ids.tolist(), ti.memory_ids, ti.positions.tolist()):
                rows.append((i, m, self.user_id, t, p, self.embedding_model))
        return pl.DataFrame(rows, schema=IDMAP_SCHEMA, orient="row").with_columns(
            code_version=pl.lit(stage_version("memory_indexes"), pl.String))

    def search(self, mem_type: str, query_vecs: np.ndarray, k: int,
               as_of_position: int | None = None, use_selector: bool = True) -> list[list[tuple[str, float, int]]]:
        return search_type_index(self.by_type[normalize_type(mem_type)], query_vecs, k, as_of_position, use_selector)


def build_user_indexes(embeddings: pl.DataFrame, user_id: str | None = None, *, dim: int | None = None,
                       use_gpu: bool | None = None) -> UserIndexes:
    """Per-type indexes from one user's rows of the embeddings table (memory_id, type, position, embedding)."""
    if user_id is None:
        users = embeddings["user_id"].unique().to_list() if embeddings.height else []
        if len(users) != 1:
            raise ValueError(f"build_user_indexes needs one user's rows (got users {users[:5]}); pass user_id")
        user_id = users[0]
    df = embeddings.filter(pl.col("user_id") == user_id) if "user_id" in embeddings.columns else embeddings
    models = df["embedding_model"].unique().to_list() if df.height and "embedding_model" in df.columns else []
    if len(models) > 1:
        raise ValueError(f"user {user_id}: embeddings from several models {models}; re-embed first")
    mat = embeddings_matrix(df)
    if dim is None:
        dim = mat.shape[1] if df.height else 384
    unknown = set(df["type"].to_list()) - set(MEMORY_TYPES) if df.height else set()
    if unknown:
        raise ValueError(f"user {user_id}: unknown memory types {sorted(unknown)}")
    mids_all = df["memory_id"].to_list() if df.height else []
    if len(set(mids_all)) != len(mids_all):
        raise ValueError(f"user {user_id}: duplicate memory_id rows in the embeddings table")
    assign_ids(mids_all)  # collision check across all of the user's types
    by_type: dict[str, TypeIndex] = {}
    built_on = "cpu"
    types = df["type"].to_list() if df.height else []
    positions_all = df["position"].to_list() if df.height else []
    for t in MEMORY_TYPES:
        sel = [i for i, x in enumerate(types) if x == t]
        mids = [mids_all[i] for i in sel]
        ids = assign_ids(mids)
        pos = np.asarray([positions_all[i] for i in sel], dtype=np.int64)
        index, where = build_index(mat[sel] if sel else np.zeros((0, dim), np.float32), ids, dim, use_gpu)
        built_on = "gpu" if where == "gpu" else built_on
        by_type[t] = TypeIndex(t, index, ids, mids, pos)
    return UserIndexes(user_id, dim, models[0] if models else None, by_type, built_on)


# ---------------------------------------------------------------------------------------- files

INDEX_ROWS_SCHEMA = pl.Schema({"user_id": pl.String, "type": pl.String, "ntotal": pl.Int64, "faiss": pl.Binary,
                               "code_version": pl.String})


def index_frame(ux: UserIndexes) -> pl.DataFrame:
    """One row per memory type: the serialized index (faiss.serialize_index; built on GPU -> CPU copy)."""
    rows = []
    for t in MEMORY_TYPES:
        index = ux.by_type[t].index
        rows.append((ux.user_id, t, int(index.ntotal), faiss.serialize_index(index).tobytes(), stage_version("memory_indexes")))
        fault_point("index.write")  # crash tests: indexes serialized, nothing committed yet
    return pl.DataFrame(rows, schema=INDEX_ROWS_SCHEMA, orient="row")


def write_users_indexes(layout: DataLayout, uxs: Sequence[UserIndexes]) -> list[int]:
    """All of a run's users: the index rows in one commit, then the id maps (last: the loader checks
    the indexes against them) in one more."""
    if not uxs:
        return []
    users = [ux.user_id for ux in uxs]
    indexes = pl.concat([index_frame(ux) for ux in uxs])
    idmaps = pl.concat([ux.idmap_frame() for ux in uxs])
    return [layout.replace_users(INDEX_TABLE, users, indexes), layout.replace_users(IDMAP_TABLE, users, idmaps)]


def write_user_indexes(layout: DataLayout, ux: UserIndexes) -> list[int]:
    return write_users_indexes(layout, [ux])


def build_and_write_user_indexes(layout: DataLayout, embeddings: pl.DataFrame, user_id: str,
                                 use_gpu: bool | None = None) -> tuple[UserIndexes, list[int]]:
    ux = build_user_indexes(embeddings, user_id, use_gpu=use_gpu)
    return ux, write_user_indexes(layout, ux)


def load_user_indexes(layout: DataLayout, user_id: str) -> UserIndexes | None:
    """A user's indexes from the store (None when the user has no id map); StaleIndexError on mismatch."""
    return _user_indexes(user_id, layout.read_user_table(IDMAP_TABLE, user_id), layout.read_user_table(INDEX_TABLE, user_id))


def load_users_indexes(layout: DataLayout, users: Iterable[str]) -> dict[str, UserIndexes | None]:
    """`load_user_indexes` for many users in one read per table (a read per user lists the
    tables' files each time: a run of thousands of users paid that thousands of times)."""
    users = list(dict.fromkeys(users))
    idmaps, stored = layout.read_users(IDMAP_TABLE, users), layout.read_users(INDEX_TABLE, users)
    return {u: _user_indexes(u, idmaps.get(u), stored.get(u)) for u in users}


def _user_indexes(user_id: str, idmap: pl.DataFrame | None, stored_rows: pl.DataFrame | None) -> UserIndexes | None:
    if idmap is None:
        return None
    rows_by_type = {}
    if stored_rows is not None:
        rows_by_type = {r["type"]: r["faiss"] for r in stored_rows.iter_rows(named=True)}
    models = [m for m in idmap["embedding_model"].unique().to_list() if m is not None] if idmap.height else []
    by_type: dict[str, TypeIndex] = {}
    dim = None
    for t in MEMORY_TYPES:
        blob = rows_by_type.get(t)
        rows = idmap.filter(pl.col("type") == t)
        if blob is None:
            if rows.height:
                raise StaleIndexError(f"user {user_id}: no {t} index but the id map lists {rows.height} {t} memories")
            continue
        index = faiss.deserialize_index(np.frombuffer(blob, dtype=np.uint8))
        dim = index.d
        stored = faiss.vector_to_array(faiss.downcast_index(index).id_map).astype(np.int64) if index.ntotal else np.zeros(0, np.int64)
        by_id = dict(zip(rows["id"].to_list(), zip(rows["memory_id"].to_list(), rows["position"].to_list())))
        if len(stored) != rows.height or any(int(i) not in by_id for i in stored.tolist()):
            raise StaleIndexError(
                f"user {user_id}: the {t} index holds {len(stored)} ids but the id map has {rows.height} {t} rows "
                f"that do not match; rebuild this user's indexes"
            )
        mids = [by_id[int(i)][0] for i in stored.tolist()]
        pos = np.asarray([by_id[int(i)][1] for i in stored.tolist()], dtype=np.int64)
        by_type[t] = TypeIndex(t, index, stored, mids, pos)
    for t in MEMORY_TYPES:  # a type with no index and no rows: an empty index
        if t not in by_type:
            by_type[t] = TypeIndex(t, new_index(dim or 384), np.zeros(0, np.int64), [], np.zeros(0, np.int64))
    return UserIndexes(user_id, dim or 384, models[0] if models else None, by_type)


# ---------------------------------------------------------------------------------------- search

Hit = tuple[str, float, int]  # (memory_id, score, position)


def _eligible(ti: TypeIndex, as_of: int | None) -> np.ndarray:
    return np.ones(len(ti.ids), dtype=bool) if as_of is None else ti.positions <= int(as_of)


def _collect(ti: TypeIndex, D: np.ndarray, I: np.ndarray, as_of: int | None, k: int) -> list[Hit]:
    out: list[Hit] = []
    for d, i in zip(D.tolist(), I.tolist()):
        if i < 0:
            continue
        j = ti._by_id.get(int(i))
        if j is None:
            continue
        p = int(ti.positions[j])
        if as_of is not None and p > as_of:  # never a future memory, whatever faiss returned
            continue
        out.append((ti.memory_ids[j], float(d), p))
        if len(out) == k:
            break
    return out


# Below this many (queries x vectors), an exact search is microseconds of work and OpenMP's thread
# start-up/spin-wait dominates (x10-x100 on a busy machine): search on the calling thread only.
SMALL_SEARCH_WORK = 4_000_000


class _omp_threads:
    """Temporarily set faiss's OpenMP thread count for the calling thread."""

    def __init__(self, n: int | None):
        self.n = n
        self.prev = None

    def __enter__(self):
        if self.n is not None:
            self.prev = faiss.omp_get_max_threads()
            faiss.omp_set_num_threads(self.n)

    def __exit__(self, *exc):
        if self.prev is not None:
            faiss.omp_set_num_threads(self.prev)


def search_type_index(ti: TypeIndex, query_vecs: np.ndarray, k: int, as_of_position: int | None = None,
                      use_selector: bool = True) -> list[list[Hit]]:
    """Top-k (memory_id, score, position) per query row among memories at or before as_of_position.

    ``as_of_position``: None, one int for all rows, or a sequence with one int/None per row.
    """
    q = np.asarray(query_vecs, dtype=np.float32)
    nq = 1 if q.ndim == 1 else q.shape[0]
    with _omp_threads(1 if nq * ti.ntotal < SMALL_SEARCH_WORK else None):
        return _search_type_index(ti, query_vecs, k, as_of_position, use_selector)


def _search_type_index(ti: TypeIndex, query_vecs: np.ndarray, k: int, as_of_position,
                       use_selector: bool) -> list[list[Hit]]:
    if as_of_position is not None and not isinstance(as_of_position, (int, np.integer)):
        return _search_per_query_as_of(ti, query_vecs, k, [None if a is None else int(a) for a in as_of_position])
    q = np.ascontiguousarray(query_vecs, dtype=np.float32)
    if q.ndim == 1:
        q = q[None, :]
    nq = q.shape[0]
    if k <= 0 or ti.ntotal == 0 or nq == 0:
        return [[] for _ in range(nq)]
    mask = _eligible(ti, as_of_position)
    n_ok = int(mask.sum())
    if n_ok == 0:
        return [[] for _ in range(nq)]
    kk = min(k, n_ok)
    if use_selector:
        if n_ok == len(mask):
            D, I = ti.index.search(q, kk)
        else:
            sel = faiss.IDSelectorBatch(ti.ids[mask])
            D, I = ti.index.search(q, kk, params=faiss.SearchParameters(sel=sel))
        return [_collect(ti, D[r], I[r], as_of_position, kk) for r in range(nq)]
    # over-fetch, drop future memories, widen until k eligible or the index is exhausted
    results: list[list[Hit] | None] = [None] * nq
    pending = list(range(nq))
    fetch = min(ti.ntotal, 2 * kk if n_ok < len(mask) else kk)
    while pending:
        D, I = ti.index.search(q[pending], fetch)
        still = []
        for r, qi in enumerate(pending):
            hits = _collect(ti, D[r], I[r], as_of_position, kk)
            if len(hits) >= kk or fetch >= ti.ntotal:
                results[qi] = hits
            else:
                still.append(qi)
        pending = still
        fetch = min(ti.ntotal, fetch * 2)
    return results  # type: ignore[return-value]


def _search_per_query_as_of(ti: TypeIndex, query_vecs: np.ndarray, k: int, as_ofs: list[int | None]) -> list[list[Hit]]:
    """One search for rows with different as_of: fetch k + (future memories of the earliest as_of), filter per row.

    Exact: a row with as_of a has at most n_future(a) <= n_future(min as_of) ineligible memories
    ahead of its k-th eligible one, so the fetched list always holds its top-k eligible memories.
    """
    q = np.ascontiguousarray(query_vecs, dtype=np.float32)
    if q.ndim == 1:
        q = q[None, :]
    if len(as_ofs) != q.shape[0]:
        raise ValueError(f"{len(as_ofs)} as_of positions for {q.shape[0]} query rows")
    if k <= 0 or ti.ntotal == 0 or q.shape[0] == 0:
        return [[] for _ in as_ofs]
    bounded = [a for a in as_ofs if a is not None]
    n_future = int((ti.positions > min(bounded)).sum()) if bounded else 0
    fetch = min(ti.ntotal, k + n_future)
    D, I = ti.index.search(q, fetch)
    return [_collect(ti, D[r], I[r], a, k) for r, a in enumerate(as_ofs)]


class VectorStore:
    """Loads users' indexes from a data root on demand (cached) and searches them."""

    def __init__(self, root_or_layout, preload: dict[str, UserIndexes] | None = None):
        self.layout = root_or_layout if isinstance(root_or_layout, DataLayout) else DataLayout(root_or_layout)
        self._cache: dict[str, UserIndexes | None] = dict(preload or {})
        self._lock = threading.Lock()

    @classmethod
    def in_memory(cls, users: Iterable[UserIndexes]) -> "VectorStore":
        return cls(DataLayout(os.devnull), {u.user_id: u for u in users})

    def user(self, user_id: str) -> UserIndexes | None:
        with self._lock:
            if user_id not in self._cache:
                self._cache[user_id] = load_user_indexes(self.layout, user_id)
            return self._cache[user_id]

    def preload(self, users: Iterable[str]) -> None:
        """Load the indexes of every user not cached yet, in one read per table (`load_users_indexes`)."""
        with self._lock:
            missing = [u for u in dict.fromkeys(users) if u not in self._cache]
        if missing:
            loaded = load_users_indexes(self.layout, missing)
            with self._lock:
                for u, ux in loaded.items():
                    self._cache.setdefault(u, ux)

    def invalidate(self, user_id: str | None = None) -> None:
        with self._lock:
            if user_id is None:
                self._cache.clear()
            else:
                self._cache.pop(user_id, None)

    def search(self, user_id: str, mem_type: str, query_vecs: np.ndarray, k: int,
               as_of_position=None, use_selector: bool = True) -> list[list[Hit]]:
        """Top-k per query row; a user without indexes gets empty results.

        ``as_of_position``: None (no limit), one int for every row, or a sequence with one per row.
        """
        q = np.asarray(query_vecs, dtype=np.float32)
        nq = 1 if q.ndim == 1 else q.shape[0]
        ux = self.user(user_id)
        if ux is None:
            return [[] for _ in range(nq)]
        return ux.search(mem_type, q, k, as_of_position, use_selector)


__all__ = [
    "MEMORY_TYPES", "INDEX_TABLE", "IDMAP_TABLE", "IDMAP_SCHEMA", "IdCollisionError", "StaleIndexError",
    "normalize_type", "stable_id", "assign_ids", "gpu_available", "gpu_resources", "build_index",
    "TypeIndex", "UserIndexes", "build_user_indexes", "write_user_indexes", "build_and_write_user_indexes",
    "load_user_indexes", "load_users_indexes", "search_type_index", "VectorStore", "index_frame", "write_users_indexes",
]
