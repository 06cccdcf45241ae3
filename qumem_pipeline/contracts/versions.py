"""Versions stamped on every output row, so any row can be traced to the code that made it."""

from qumem_pipeline import __version__

CODE_VERSION = __version__
# Bump when the canonical turn contract or its validation rules change.
# v2: content hashes are BLAKE3 (manifest digests, per-user fingerprints; the fingerprint's timestamp
# is epoch microseconds): every recorded fingerprint changes meaning, so every user counts as changed.
TURN_SCHEMA_VERSION = "turns-v2"
