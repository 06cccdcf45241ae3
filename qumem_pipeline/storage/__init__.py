"""Where tables live and how they are erased: the Delta table store (table_store: one Delta table per
table under a local or object-store root, bucketed by user, one commit per replace), the per-user
interface over it that stages use (layout), the DuckDB warehouse loaded from it, full deletion of a
user (forget) and the move from the old per-user Parquet layout (migrate)."""
