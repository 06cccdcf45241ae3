"""ui_load_s: how long the asset page of a partitioned asset takes to open in headless Chromium.

    python bench/ui_load.py [--users 100000] [--scheme users|user_buckets] [--instance sqlite|postgres] [--json]

The page is the asset's Partitions view (`/assets/<asset>?view=partitions`), the page that lists and
colours every partition: the one reported to freeze at tens of thousands of partitions. It is
opened in Debian's Chromium through Playwright (the harness of tests/test_ui_browser.py) against
`dagster-webserver -w workspace.yaml` (the product's definitions, in the partition scheme of
QUMEM_PARTITION_SCHEME) on the given DAGSTER_HOME. The clock starts at navigation, after the
server answers and its code location is loaded, and stops when the page shows the asset's
partition count (the partition health computed over every partition of the asset); a fresh
browser each time, so the JS bundle is fetched too. `load_s` is the first open, `reload_s` a second.

bench/scale.py calls `asset_page_load` on the instance its rebuild just wrote (every user
materialized). Run alone, this script makes a fresh instance and registers --users users
(dynamic partitions `users`, as `qumem`/the sensors do) with no materializations: in the `users`
scheme the asset then has --users partitions, in `user_buckets` QUMEM_BUCKETS (64) whatever the
user count.
"""

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
# Importing these reads no partition scheme (main sets it from --scheme before the webserver loads the assets).
from qumem_pipeline.runtime.processes import free_port, stop_process_group  # noqa: E402
from tests.browser_harness import CHROMIUM, headless_page  # noqa: E402
from bench._instance import drop_instance, product_instance  # noqa: E402

SERVER_START_S = 300
PAGE_TIMEOUT_MS = 300_000


def _graphql(url: str, query: str) -> dict:
    req = urllib.request.Request(url + "/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _wait_until_loaded(proc: subprocess.Popen, url: str, log: Path) -> float:
    """Server answers and the code location is loaded; returns the seconds that took."""
    t0, deadline = time.perf_counter(), time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dagster-webserver exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            got = _graphql(url, "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus "
                                "locationOrLoadError { __typename } } } } }")
            entries = got["data"]["workspaceOrError"]["locationEntries"]
            if entries and all(e["loadStatus"] == "LOADED" for e in entries):
                bad = [e for e in entries if e["locationOrLoadError"]["__typename"] != "RepositoryLocation"]
                if bad:
                    raise RuntimeError(f"code location failed to load: {bad}\n{log.read_text()[-3000:]}")
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"dagster-webserver not ready within {SERVER_START_S}s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def webserver(home: Path, archive: Path, data_root: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUMEM_") or k in (
        "QUMEM_PARTITION_SCHEME", "QUMEM_BUCKETS", "QUMEM_USERS_PER_RUN")}
    env.update(DAGSTER_HOME=str(home), QUMEM_ARCHIVE=str(archive), QUMEM_DATA_ROOT=str(data_root),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "webserver.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("dagster-webserver")), "-w", "workspace.yaml",
             "-h", "127.0.0.1", "-p", str(port)],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start_s = _wait_until_loaded(proc, url, log)
        yield url, start_s
    finally:
        stop_process_group(proc)


def _open_once(url: str, asset: str, shot: Path | None) -> tuple[float, str]:
    """Seconds from navigation to the partition count on screen, in a fresh browser; and that text."""
    with headless_page(PAGE_TIMEOUT_MS) as page:
        t = time.perf_counter()
        page.goto(f"{url}/assets/{asset}?view=partitions")
        count = page.get_by_text(PARTITION_COUNT).first
        count.wait_for(state="visible")
        status = page.get_by_text(MATERIALIZED_COUNT).first
        status.wait_for(state="visible")
        page.locator("a,div,span").get_by_text(PARTITION_KEY).first.wait_for(state="visible")
        took = time.perf_counter() - t
        text = f"{count.inner_text()}; {status.inner_text()}"
        if shot:
            page.screenshot(path=str(shot))
        return took, text


# What the Partitions view shows once the partition health is in: "100,000 Partitions Selected", the
# status filters with their counts ("Materialized (99000)") and the first rows of the partition list.
PARTITION_COUNT = re.compile(r"^[1-9][\d,]* Partitions? Selected$")
MATERIALIZED_COUNT = re.compile(r"^Materialized \(\d+\)$")
PARTITION_KEY = re.compile(r"^(user|b)\w*\d$")


def asset_page_load(home: Path, archive: Path, data_root: Path, asset: str = "turns", shots: Path | None = None) -> dict:
    if not os.access(CHROMIUM, os.X_OK):
        return {"load_s": None, "skipped": f"{CHROMIUM} missing (scripts/install_system_deps.sh)"}
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    with webserver(home, archive, data_root) as (url, start_s):
        try:
            first, text = _open_once(url, asset, shots / "ui_asset_partitions.png" if shots else None)
        except PlaywrightTimeout:  # a page that never shows its partitions is a result, not a crash
            return {"load_s": None, "timed_out_after_s": PAGE_TIMEOUT_MS / 1000, "server_ready_s": round(start_s, 2),
                    "asset": asset, "scheme": os.environ.get("QUMEM_PARTITION_SCHEME") or "users"}
        again, _ = _open_once(url, asset, None)
    return {"load_s": round(first, 2), "reload_s": round(again, 2), "server_ready_s": round(start_s, 2),
            "partition_count_text": text, "asset": asset,
            "scheme": os.environ.get("QUMEM_PARTITION_SCHEME") or "users"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--scheme", choices=["users", "user_buckets"])
    ap.add_argument("--instance", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--shots", help="write a screenshot of the page here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.scheme:
        os.environ["QUMEM_PARTITION_SCHEME"] = args.scheme
    with tempfile.TemporaryDirectory(prefix="qumem-ui-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        instance = product_instance(home, args.instance)
        t = time.perf_counter()
        users = [f"user{u:06d}" for u in range(args.users)]
        for i in range(0, len(users), 10_000):
            instance.add_dynamic_partitions("users", users[i:i + 10_000])
        register_s = time.perf_counter() - t
        try:
            out = asset_page_load(home, Path(tmp) / "archive", Path(tmp) / "data",
                                  shots=Path(args.shots) if args.shots else None)
        finally:
            drop_instance(instance, home)
    out.update(users=args.users, instance=args.instance, register_s=round(register_s, 2), materialized=False)
    print(f"[{out['scheme']}] {args.users} users: asset page {out['load_s']}s (again {out.get('reload_s')}s), "
          f"shows {out.get('partition_count_text')!r}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
