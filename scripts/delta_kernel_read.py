"""Read Delta tables with delta-kernel-rs (DuckDB's delta extension), for comparing with delta-rs.

Runs in the reader's own venv (scripts/install_delta_reader.sh: DuckDB 1.4.4 and the extension
files from the registry packages `duckdb-ext-delta` / `duckdb-ext-httpfs`); stdlib and duckdb only.
The extensions are loaded from their files; nothing is downloaded (autoinstall off).

    python delta_kernel_read.py --check
    python delta_kernel_read.py --out DIR NAME=URI [NAME=URI ...]   # DIR/NAME.parquet per table
    python delta_kernel_read.py --views views.sql --out DIR NAME=view:VIEW ...  # through the views
                                                  # (qumem_pipeline/storage/outside_views.py)

An s3:// URI uses AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION (a loopback
endpoint such as moto's: path-style, no TLS). Prints one JSON object last: rows per table.
"""

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path
from urllib.parse import urlparse

import duckdb


def extension_file(name: str) -> Path:
    base = Path(sysconfig.get_paths()["purelib"]) / "duckdb_ext" / "extensions" / f"v{duckdb.__version__}"
    found = sorted(base.glob(f"*/{name}.duckdb_extension"))
    if not found:
        raise SystemExit(f"delta_kernel_read: no {name}.duckdb_extension under {base} "
                         f"(run scripts/install_delta_reader.sh)")
    return found[0]


def connect() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    for ext in ("httpfs", "delta"):
        con.execute(f"LOAD '{extension_file(ext)}'")
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        parts = ["TYPE s3", f"KEY_ID '{os.environ['AWS_ACCESS_KEY_ID']}'",
                 f"SECRET '{os.environ.get('AWS_SECRET_ACCESS_KEY', '')}'",
                 f"REGION '{os.environ.get('AWS_REGION') or os.environ.get('AWS_DEFAULT_REGION') or 'us-east-1'}'"]
        if endpoint:
            u = urlparse(endpoint)
            parts += [f"ENDPOINT '{u.netloc}'", "URL_STYLE 'path'", f"USE_SSL {'true' if u.scheme == 'https' else 'false'}"]
        con.execute(f"CREATE SECRET qumem_s3 ({', '.join(parts)})")
    return con


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="load the extensions and print their versions")
    p.add_argument("--out", help="folder for NAME.parquet files")
    p.add_argument("--views", help="SQL file run first (CREATE VIEW ...)")
    p.add_argument("tables", nargs="*", help="NAME=URI, or NAME=view:VIEW")
    args = p.parse_args(argv)
    con = connect()
    if args.check:
        rows = con.execute("SELECT extension_name, extension_version FROM duckdb_extensions() "
                           "WHERE loaded ORDER BY 1").fetchall()
        print(json.dumps({"duckdb": duckdb.__version__, "extensions": dict(rows)}))
        return 0
    if args.views:
        con.execute(Path(args.views).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for spec in args.tables:
        name, _, uri = spec.partition("=")
        target = out / f"{name}.parquet"
        source = f'"{uri[5:]}"' if uri.startswith("view:") else f"delta_scan('{uri}')"
        con.execute(f"COPY (SELECT * FROM {source}) TO '{target}' (FORMAT parquet)")
        counts[name] = con.execute(f"SELECT count(*) FROM read_parquet('{target}')").fetchone()[0]
    print(json.dumps({"rows": counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
