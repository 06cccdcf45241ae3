"""The turns asset's blocking schema check reads the table's schema, not the run users' turns."""

import polars as pl

from qumem_pipeline.ingest.stage import turns_schema as _turns_schema
from qumem_pipeline.contracts import checks
from qumem_pipeline.ingest.validate import TURN_POLARS_SCHEMA
from qumem_pipeline.storage.layout import DataLayout


def _turn_rows(user: str, n: int) -> pl.DataFrame:
    rows = pl.DataFrame({c: [None] * n for c in TURN_POLARS_SCHEMA}, schema=TURN_POLARS_SCHEMA)
    return rows.with_columns(user_id=pl.lit(user), turn_index=pl.int_range(n, dtype=pl.Int64), text=pl.lit("hi"))


def test_the_check_sees_the_stored_schema_without_reading_rows(tmp_path):
    layout = DataLayout(tmp_path / "data")
    # no turns table yet: the contract's schema, which conforms
    assert checks.schema_conforms(_turns_schema(layout), dict(TURN_POLARS_SCHEMA), "turns").passed

    layout.replace_users("turns", ["alice"], _turn_rows("alice", 3))
    stored = _turns_schema(layout)
    assert stored.height == 0 and dict(stored.schema) == dict(TURN_POLARS_SCHEMA)  # store columns left out
    assert checks.schema_conforms(stored, dict(TURN_POLARS_SCHEMA), "turns").passed


def test_a_stored_column_of_the_wrong_type_fails_the_check(tmp_path):
    layout = DataLayout(tmp_path / "data")
    bad = _turn_rows("bob", 2).with_columns(pl.col("turn_index").cast(pl.String))
    layout.replace_users("turns", ["bob"], bad)
    outcome = checks.schema_conforms(_turns_schema(layout), dict(TURN_POLARS_SCHEMA), "turns")
    assert not outcome.passed and "turn_index" in outcome.description


def test_count_user_rows_counts_rows_not_placeholders(tmp_path):
    layout = DataLayout(tmp_path / "data")
    assert layout.count_user_rows("turns", "alice") == 0  # no table yet
    layout.replace_users("turns", ["alice", "bob"], _turn_rows("alice", 3))  # bob: written empty
    assert (layout.count_user_rows("turns", "alice"), layout.count_user_rows("turns", "bob")) == (3, 0)
    assert layout.read_user_table("turns", "bob").height == 0  # present, empty: a placeholder row
