"""The canonical tables, defined once. Every stage reads and writes these schemas."""

import pyarrow as pa

ROLES = ("user", "assistant", "other")

# One row per conversation turn. turn_index is the position in the user's whole history
# (dense 0..N-1 per user) and, with user_id, is the turn's id everywhere downstream.
TURN_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("conversation_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("turn_index", pa.int64(), nullable=False),
        pa.field("role", pa.string(), nullable=False),
        pa.field("speaker", pa.string(), nullable=True),
        pa.field("text", pa.string(), nullable=False),
        pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=True),
        pa.field("source_ref", pa.string(), nullable=True),
        pa.field("source_file", pa.string(), nullable=True),
        pa.field("code_version", pa.string(), nullable=False),
    ]
)

# A row that failed validation: where it came from, which field, why, and the row itself
# (as JSON text, or escaped bytes when it was not even UTF-8), so nothing is lost silently.
QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.string(), nullable=True),
        pa.field("source_file", pa.string(), nullable=True),
        pa.field("source_row", pa.int64(), nullable=True),
        pa.field("field", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("raw", pa.string(), nullable=True),
        pa.field("code_version", pa.string(), nullable=False),
    ]
)

# Quarantined rows whose user id is missing or invalid cannot live under a user partition.
UNATTRIBUTED = "__unattributed__"
