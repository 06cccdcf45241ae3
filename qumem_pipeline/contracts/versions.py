"""Versions stamped on every output row, so any row can be traced to the code that made it."""

from qumem_pipeline import __version__

CODE_VERSION = __version__
# Bump when the canonical turn contract or its validation rules change.
TURN_SCHEMA_VERSION = "turns-v1"
