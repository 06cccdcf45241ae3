"""Views for an outside reader of the Delta tables: what a stage wrote, without the store's own parts.

Why: every table carries three store-only columns (`user_key`: the row's user, the partition key of
tables keyed by another column such as the quarantine's `owner_id`; `user_bucket`: the hash bucket the
table is partitioned by; `user_placeholder`: true on the one empty row that records "this user has
no rows here" for users whose stage ran and produced nothing). An engine reading the tables directly
(DuckDB's delta extension, Spark, Trino) sees those columns and rows; the views below drop them, so
a view returns what `DataLayout.read_table` returns. Read-only: the views never write. The forget
registry and the warehouse/export location tables are the store's bookkeeping and get no view.

    .venv/bin/python -m qumem_pipeline.storage.outside_views --data-root ROOT > views.sql
    duckdb -c "LOAD delta; .read views.sql; SELECT * FROM turns LIMIT 5"
"""

import argparse
import sys

from qumem_pipeline.storage.table_store import PLACEHOLDER, STORE_COLUMNS, TableStore
from qumem_pipeline.storage.tombstones import REGISTRY_TABLE
from qumem_pipeline.storage.warehouse_locations import EXPORT_LOCATIONS, WAREHOUSE_LOCATIONS

BOOKKEEPING = (REGISTRY_TABLE, WAREHOUSE_LOCATIONS, EXPORT_LOCATIONS)


def view_sql(store: TableStore, prefix: str = "") -> str:
    """One `CREATE OR REPLACE VIEW <prefix><table>` per data table of the root, over `delta_scan`."""
    out = []
    for table in store.tables():
        if table in BOOKKEEPING:
            continue
        uri = store.uri(table).replace("'", "''")
        out.append(f'CREATE OR REPLACE VIEW "{prefix}{table}" AS SELECT * EXCLUDE ({", ".join(STORE_COLUMNS)}) '
                   f"FROM delta_scan('{uri}') WHERE {PLACEHOLDER} IS NOT TRUE;")
    return "\n".join(out) + ("\n" if out else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-root", required=True, help="local path or s3://, gs://, az:// URI")
    p.add_argument("--prefix", default="", help="prefix of every view name")
    args = p.parse_args(argv)
    sys.stdout.write(view_sql(TableStore(args.data_root), args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
