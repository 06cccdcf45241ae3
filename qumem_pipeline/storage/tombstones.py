"""The forget registry: one keyed tombstone row per forget, read fresh by every commit.

Why keyed: an unsalted sha256 of a user id lets anyone holding the table test whether a given id
was forgotten. A tombstone is HMAC-SHA256(deployment secret, user_id): without the secret a row
confirms nothing. The secret comes from `QUMEM_TOMBSTONE_KEY`; production (`QUMEM_ENV=production`)
and object-store data roots refuse to run without it. A local data root without it gets a key
generated once under `<root>/_secrets/tombstone.key` (mode 0600; fine on one machine, not on a
shared store). Rotation: set the new secret in `QUMEM_TOMBSTONE_KEY` and list the old ones in
`QUMEM_TOMBSTONE_OLD_KEYS` (comma-separated): new tombstones use the new key, lookups try every
key (each row records its key's id, a digest of the key, so a lookup computes one HMAC per key in
use). A local root's generated key, when its file exists, is always held too: setting
`QUMEM_TOMBSTONE_KEY` later carries it instead of orphaning the tombstones made with it.

Why a process refuses to run without every key in use (`TombstoneKeyOrphaned`): a tombstone whose
key is not held matches no one, so its user would silently come back on the next ingest. A key id
that some forgotten (or erased) tombstone names must be held, or every registry read raises one
line naming the id and `QUMEM_TOMBSTONE_OLD_KEYS`. A digest cannot be turned back into an id, so a
tombstone is never re-keyed: an old key is kept for as long as a tombstone made with it holds.
An event about a user (readmit, erased, forget) is also written under every held old key whose
tombstone of the user holds, so a readmit after a rotation is not outvoted by the old key's forget.
Rows of the pre-HMAC registry (key id NULL: plain sha256) need no key and still match.

Why one row per event (append, never read-modify-write): concurrent forgets from many hosts all
land (Delta appends do not conflict). A user's state is its latest event (forget / erased / readmit).
`erased` is a forget's last step: every table's delete of the user has committed. Only then may a
cleanup remove an unreferenced file holding the user's rows; before it, such a file may belong to a
commit still in flight (storage/table_store.py, `remove_dead_files`).
"""

import hashlib
import hmac
import os
import secrets
import threading
from datetime import datetime, timezone
from pathlib import Path

import polars as pl

REGISTRY_TABLE = "forgotten_users"
REGISTRY_KEY = "_registry"  # the registry is one partition key, not a user
KEY_ENV, OLD_KEYS_ENV = "QUMEM_TOMBSTONE_KEY", "QUMEM_TOMBSTONE_OLD_KEYS"
LEGACY_KEY_ID = ""  # rows written before keyed tombstones: sha256(user_id)
FORGET, ERASED, READMIT = "forget", "erased", "readmit"
# `seq`: the registry version the appender saw, plus one. A user's latest event is the one with the
# highest `seq` (then `at`): an event appended after another was seen is ordered after it whatever the
# hosts' clocks say (a forget on a host whose clock is behind the one that readmitted the user must
# still win); only events appended concurrently share a `seq`. Rows from before it have none (first).
SCHEMA = {"digest": pl.String, "key_id": pl.String, "action": pl.String, "at": pl.Datetime("us", "UTC"),
          "seq": pl.Int64}


class TombstoneKeyMissing(RuntimeError):
    """Production (or a shared object store) without a tombstone secret."""


class TombstoneKeyOrphaned(TombstoneKeyMissing):
    """The registry holds tombstones made with a key this process does not hold."""


def key_id(secret: bytes) -> str:
    """The id a tombstone row records for its key: a domain-separated digest, never the key."""
    return hashlib.sha256(b"qumem-tombstone-key:" + secret).hexdigest()[:12]


_key_id = key_id


def _local_key_path(root: str) -> Path | None:
    if "://" in root and not root.startswith("file://"):
        return None
    return Path(root.removeprefix("file://")) / "_secrets" / "tombstone.key"


def _local_key(root: str) -> bytes:
    path = _local_key_path(root)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # first writer wins; others read its key
        except FileExistsError:
            pass
        tmp.unlink(missing_ok=True)
    return path.read_text().strip().encode()


def tombstone_keys(root: str) -> list[bytes]:
    """[current key, old keys...] for this deployment (see the module docstring)."""
    current = os.environ.get(KEY_ENV, "").strip()
    if not current:
        remote = "://" in root and not root.startswith("file://")
        if os.environ.get("QUMEM_ENV") == "production" or remote:
            raise TombstoneKeyMissing(
                f"{KEY_ENV} is not set: forget tombstones are keyed digests and this deployment "
                f"({'production' if not remote else 'object-store data root ' + root}) must provide the secret "
                f"from its environment (any long random string; keep it with the deployment's other secrets)")
        keys = [_local_key(root)]
    else:
        keys = [current.encode()]
    keys += [k.strip().encode() for k in os.environ.get(OLD_KEYS_ENV, "").split(",") if k.strip()]
    local = _local_key_path(root)
    if current and local is not None and local.exists():  # carried: the key before QUMEM_TOMBSTONE_KEY
        keys.append(local.read_text().strip().encode())
    return list(dict.fromkeys(keys))


# (root, registry table id, its version) -> (forgotten, erased) digests by key id, parsed once per process
_PARSED: dict[tuple[str, str, int], tuple[dict[str, set[str]], dict[str, set[str]]]] = {}
_PARSED_LOCK = threading.Lock()
_PARSED_MAX = 8


class Tombstones:
    """Membership test against the registry as of its latest version (re-read only when it changed)."""

    def __init__(self, store, keys: list[bytes] | None = None):
        # its own handle on the root (same store class: no import back into table_store), bucket
        # count taken from the table: one key, any deployment's N
        self.store = store.plain_handle()
        self.store.n_buckets = None
        self._keys = keys
        self._ident: tuple[str, int] | None = ("", -1)  # (table id, version) of the sets held; none yet
        self._forgotten: dict[str, set[str]] = {}  # key id -> digests whose latest event is forget/erased
        self._erased: dict[str, set[str]] = {}  # key id -> digests whose latest event is erased
        self._lock = threading.Lock()

    @property
    def keys(self) -> list[bytes]:
        if self._keys is None:
            self._keys = tombstone_keys(self.store.root)
        return self._keys

    def digest(self, user_id: str, key: bytes | None = None) -> tuple[str, str]:
        key = self.keys[0] if key is None else key
        return _key_id(key), hmac.new(key, user_id.encode("utf-8"), hashlib.sha256).hexdigest()

    def refresh(self) -> int | None:
        """Bring the in-memory set to the registry's latest version; returns that version. A version
        another handle of this process has read already is not read again (`_PARSED`): a step opens
        several handles, and the registry grows with every forget ever made."""
        with self._lock:
            ident = self.store.identity(REGISTRY_TABLE)
            version = None if ident is None else ident[1]
            if ident == self._ident:  # the table's id too: a registry created again at the same path is new
                return version
            cached = _PARSED.get((self.store.root, *ident)) if ident is not None else None
            if cached is not None:
                self._check_keys(cached[0])  # before the sets are taken: a refused read stays refused
                self._forgotten, self._erased, self._ident = *cached, ident
                return version
            df = self.store.read(REGISTRY_TABLE, [REGISTRY_KEY])
            forgotten: dict[str, set[str]] = {}
            erased: dict[str, set[str]] = {}
            if df is not None and df.height:
                df = df.filter(~pl.col("user_placeholder"))
                for c, t in SCHEMA.items():
                    if c not in df.columns:
                        df = df.with_columns(pl.lit(None, t).alias(c))
                df = df.with_columns(pl.col("key_id").fill_null(LEGACY_KEY_ID),
                                     pl.col("action").fill_null(FORGET)).with_row_index("_i")
                latest = df.sort(["seq", "at", "_i"], nulls_last=False).group_by(["key_id", "digest"]).last()
                for kid, dig, action in latest.select("key_id", "digest", "action").iter_rows():
                    if action in (FORGET, ERASED):
                        forgotten.setdefault(kid, set()).add(dig)
                    if action == ERASED:
                        erased.setdefault(kid, set()).add(dig)
            if ident is not None:  # a version's rows never change: its sets are shared, read-only
                with _PARSED_LOCK:
                    if len(_PARSED) >= _PARSED_MAX:
                        _PARSED.pop(next(iter(_PARSED)))
                    _PARSED[(self.store.root, *ident)] = (forgotten, erased)
            self._check_keys(forgotten)
            self._forgotten, self._erased, self._ident = forgotten, erased, ident
            return version

    def _check_keys(self, forgotten: dict[str, set[str]]) -> None:
        """Raise `TombstoneKeyOrphaned` when a holding tombstone's key is not among ours (module docstring)."""
        used = {k for k, d in forgotten.items() if d and k != LEGACY_KEY_ID}
        if not used:
            return
        missing = sorted(used - {key_id(k) for k in self.keys})
        if missing:
            raise TombstoneKeyOrphaned(
                f"the forget registry {self.store.root}/{REGISTRY_TABLE} holds tombstones made with tombstone key "
                f"id(s) {', '.join(missing)}, which this process does not hold (it holds "
                f"{', '.join(key_id(k) for k in self.keys)}): running now would let those forgotten users back in; "
                f"supply the old secret(s) in {OLD_KEYS_ENV} (comma-separated, beside {KEY_ENV}; a key's id is "
                f"sha256('qumem-tombstone-key:' + key)[:12]; docs/erasure.md)")

    def __len__(self) -> int:
        return sum(len(v) for v in self._forgotten.values())

    def forgotten_among(self, users, refresh: bool = True) -> set[str]:
        """Which of `users` are forgotten as of the registry's latest version."""
        if refresh:
            self.refresh()
        return self._members(users, self._forgotten)

    def erasure_pending(self) -> bool:
        """Whether a forget is under way as of the last refresh: a user forgotten and not yet erased
        (their forget has not finished deleting and scrubbing; or it died and awaits its rerun)."""
        return any(d - self._erased.get(k, set()) for k, d in self._forgotten.items())

    def erased_among(self, users, refresh: bool = True) -> set[str]:
        """Which of `users` are forgotten and erased from every table (their forget finished)."""
        if refresh:
            self.refresh()
        return self._members(users, self._erased)

    def _members(self, users, digests_by_key: dict[str, set[str]]) -> set[str]:
        if not digests_by_key:
            return set()
        out = set()
        legacy = digests_by_key.get(LEGACY_KEY_ID, set())
        keyed = [(k, digests_by_key.get(_key_id(k), set())) for k in self.keys]
        for u in users:
            if u is None:
                continue
            if legacy and hashlib.sha256(u.encode("utf-8")).hexdigest() in legacy:
                out.add(u)
                continue
            for key, digests in keyed:
                if digests and hmac.new(key, u.encode("utf-8"), hashlib.sha256).hexdigest() in digests:
                    out.add(u)
                    break
        return out

    def contains(self, user_id: str | None) -> bool:
        return user_id is not None and bool(self.forgotten_among([user_id]))

    def record(self, user_ids: list[str], action: str = FORGET) -> None:
        """Append one row per user under the current key, plus one under each held old key whose
        tombstone of the user holds (module docstring); no read-modify-write: concurrent forgets all
        land. Refused (`TombstoneKeyOrphaned`) while a key in use is not held."""
        rows = []
        now = datetime.now(timezone.utc)
        self.refresh()
        ident = self.store.identity(REGISTRY_TABLE)
        seq = 0 if ident is None else ident[1] + 1  # after every event this host has seen (SCHEMA)
        for u in user_ids:
            kid, dig = self.digest(u)
            rows.append({"digest": dig, "key_id": kid, "action": action, "at": now, "seq": seq})
            for key in self.keys[1:]:
                okid, odig = self.digest(u, key)
                if okid != kid and odig in self._forgotten.get(okid, ()):
                    rows.append({"digest": odig, "key_id": okid, "action": action, "at": now, "seq": seq})
        df = pl.DataFrame(rows, schema=SCHEMA).with_columns(pl.lit(REGISTRY_KEY).alias("_owner"))
        self.store.append(REGISTRY_TABLE, df, key_column="_owner", guarded=False)
