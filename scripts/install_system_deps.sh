#!/usr/bin/env bash
# Debian packages the slow end-to-end tests need, and the local PostgreSQL they write to.
# Idempotent; run as root (CI and the dev machines are root; `sudo` may not exist).
#   chromium + chromium-driver  - headless browser for tests/test_ui_browser.py (Playwright drives it)
#   postgresql                  - instance storage for tests/test_postgres_instance.py
# Prints `export DAGSTER_PG_...` lines on stdout: `eval "$(bash scripts/install_system_deps.sh)"`.
set -euo pipefail
log() { echo "[system-deps] $*" >&2; }

missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium chromium-driver fonts-liberation)  # fonts: a recommends we skip otherwise
command -v pg_ctlcluster >/dev/null 2>&1 || missing+=(postgresql)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "not root: cannot apt-get install ${missing[*]}; the tests that need them will skip"
  else
    log "installing ${missing[*]}"
    # A fresh machine has no package lists yet; `apt-get install` alone would find nothing.
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
  fi
fi

# PostgreSQL: start the Debian cluster (it refuses to run as root, pg_ctlcluster switches to the
# postgres user), then make a login role that may create databases (each test makes its own).
PG_USER=${DAGSTER_PG_USER:-qumem}
PG_PASSWORD=${DAGSTER_PG_PASSWORD:-qumem-ci}
PG_DB=${DAGSTER_PG_DB:-qumem_dagster}
if command -v pg_lsclusters >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  read -r ver name port _ < <(pg_lsclusters --no-header | head -n1) || true
  if [ -z "${ver:-}" ]; then
    ver=$(ls /usr/lib/postgresql | sort -V | tail -n1); name=main
    pg_createcluster "$ver" "$name" >&2
    port=$(pg_lsclusters --no-header | awk -v v="$ver" -v n="$name" '$1==v && $2==n {print $3}')
  fi
  pg_ctlcluster "$ver" "$name" start >&2 2>/dev/null || true  # already running is fine
  pg_ctlcluster "$ver" "$name" status >/dev/null
  psql_su() { runuser -u postgres -- psql -p "$port" -v ON_ERROR_STOP=1 -qtA "$@"; }
  if [ -z "$(psql_su -c "SELECT 1 FROM pg_roles WHERE rolname = '$PG_USER'")" ]; then
    psql_su -c "CREATE ROLE \"$PG_USER\" LOGIN CREATEDB PASSWORD '$PG_PASSWORD'" >&2
  fi
  if [ -z "$(psql_su -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'")" ]; then
    psql_su -c "CREATE DATABASE \"$PG_DB\" OWNER \"$PG_USER\"" >&2
  fi
  log "postgresql $ver/$name on 127.0.0.1:$port, role $PG_USER, database $PG_DB"
  echo "export DAGSTER_PG_HOST=127.0.0.1 DAGSTER_PG_PORT=$port DAGSTER_PG_USER=$PG_USER DAGSTER_PG_PASSWORD=$PG_PASSWORD DAGSTER_PG_DB=$PG_DB"
fi
