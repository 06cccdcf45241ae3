"""A fresh Dagster instance set up the way `qumem` sets one up, and its teardown: shared by
bench/scale.py and bench/ui_load.py (so neither imports the other).

Importing this module reads no partition scheme: it imports no asset module.
"""

import os
import uuid
from pathlib import Path

import dagster as dg

from qumem_pipeline.runtime.instance_config import install_instance_config

REPO_ROOT = Path(__file__).resolve().parent.parent


def _pg_connect(dbname: str):
    import psycopg2

    return psycopg2.connect(host=os.environ["DAGSTER_PG_HOST"], port=int(os.environ.get("DAGSTER_PG_PORT", "5432")),
                            user=os.environ["DAGSTER_PG_USER"], password=os.environ.get("DAGSTER_PG_PASSWORD", ""),
                            dbname=dbname)


def _pg_admin(sql: str) -> None:
    admin = _pg_connect(os.environ["DAGSTER_PG_DB"])
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(sql)
    finally:
        admin.close()


def product_instance(home: Path, kind: str = "sqlite") -> dg.DagsterInstance:
    """A fresh DAGSTER_HOME set up the way `qumem` sets one up: the repository's dagster.yaml, or
    (kind="postgres") deploy/postgres/dagster.yaml on a fresh database of the DAGSTER_PG_* server."""
    os.environ["DAGSTER_HOME"] = str(home)
    if kind == "sqlite":
        install_instance_config(home / "dagster.yaml")
        return dg.DagsterInstance.local_temp(str(home))
    name = f"qumem_scale_{uuid.uuid4().hex[:10]}"
    _pg_admin(f'CREATE DATABASE "{name}"')
    (home / "pg_db").write_text(name)
    os.environ.setdefault("QUMEM_SCALE_PG_ADMIN_DB", os.environ["DAGSTER_PG_DB"])
    os.environ["DAGSTER_PG_DB"] = name
    install_instance_config(home / "dagster.yaml", source=REPO_ROOT / "deploy" / "postgres" / "dagster.yaml")
    return dg.DagsterInstance.from_config(str(home))


def drop_instance(instance: dg.DagsterInstance, home: Path) -> None:
    instance.dispose()
    if (home / "pg_db").is_file():
        os.environ["DAGSTER_PG_DB"] = os.environ["QUMEM_SCALE_PG_ADMIN_DB"]
        _pg_admin(f'DROP DATABASE IF EXISTS "{(home / "pg_db").read_text()}" WITH (FORCE)')
