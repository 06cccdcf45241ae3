"""The Dagster UI in a real browser: `dagster dev` as the README starts it, a backfill of two users
launched by clicking through the asset graph in headless Debian Chromium, its runs awaited to success.

Needs /usr/bin/chromium (Debian's `chromium`, installed by scripts/install_system_deps.sh, which
.ci/run calls) and the `playwright` wheel (the `test` extra). Playwright's own browser download
(`playwright install`) is never used: the test launches Debian's binary.
"""

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import dagster as dg
import pytest

from qumem_pipeline.runtime.instance_config import install_instance_config
from qumem_pipeline.runtime.processes import free_port, stop_process_group
from tests.browser_harness import CHROMIUM, headless_page
from tests.conftest import REPO_ROOT, conversation, write_jsonl

SERVER_START_S = 240
BACKFILL_DONE_S = 300
UI_TIMEOUT_MS = 60_000
ARTIFACTS = REPO_ROOT / ".ci" / "artifacts"


def _playwright_missing() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright wheel is not installed (pip install -e '.[test]')"
    return ""


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                       reason=f"{CHROMIUM} missing: apt-get install chromium (scripts/install_system_deps.sh)"),
    pytest.mark.skipif(bool(_playwright_missing()), reason=_playwright_missing() or "playwright present"),
]


def _wait_for_server(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"dagster dev exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/server_info", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"dagster dev did not answer on {url} within {SERVER_START_S}s:\n{log.read_text()[-3000:]}")


def _dismiss_first_visit_dialog(page) -> None:
    """A fresh instance greets its first visitor with a 'Join the Dagster community' dialog."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    skip = page.get_by_role("button", name="Skip")
    try:
        skip.wait_for(state="visible", timeout=10_000)
    except PlaywrightTimeout:
        return
    skip.click()
    skip.wait_for(state="hidden")


@contextlib.contextmanager
def _page(url: str):
    """A page of headless Debian Chromium at ``url``; the browser is closed whatever happens."""
    with headless_page(UI_TIMEOUT_MS) as page:
        page.goto(url)
        yield page


def _launch_backfill_in_ui(base_url: str, users: list[str], shots: Path) -> None:
    """Asset graph -> select `turns` -> Materialize selected -> two users -> Launch backfill."""
    from playwright.sync_api import expect

    expect.set_options(timeout=UI_TIMEOUT_MS)  # a busy 2-core machine: the 5 s default is too short
    with _page(base_url + "/asset-groups") as page:
        page.get_by_text("Materialize all").wait_for()
        _dismiss_first_visit_dialog(page)
        page.get_by_placeholder("Jump to").fill("turns")
        page.get_by_role("menuitem", name="turns").or_(
            page.locator("a,li,div[role=option]").filter(has_text="turns")).first.click()
        page.get_by_role("button", name="Materialize selected").click()
        dialog = page.get_by_role("dialog").filter(has_text="Launch runs to materialize turns")
        expect(dialog).to_be_visible()
        dialog.get_by_text("Select a partition or create one").click()
        for user in users:
            page.locator("span").get_by_text(user, exact=True).first.click()
        page.keyboard.press("Escape")  # closes the partition picker, not the dialog
        expect(dialog).to_contain_text(f"{len(users)} partitions")
        page.wait_for_timeout(500)  # let the picker fade out of the picture
        page.screenshot(path=str(shots / "ui_backfill_dialog.png"))
        dialog.get_by_role("button", name="Launch backfill").click()
        expect(dialog).to_have_count(0)
        page.screenshot(path=str(shots / "ui_backfill_launched.png"))


def _runs_page_screenshot(base_url: str, path: Path) -> None:
    with _page(base_url + "/runs") as page:
        page.get_by_text("Created at").wait_for()  # the runs table (its rows follow in one query)
        page.wait_for_timeout(2000)
        page.screenshot(path=str(path))


def _wait_for_backfill(home: Path) -> tuple:
    """Poll the instance (the same SQLite files the server writes) until the backfill's runs finish."""
    deadline = time.monotonic() + BACKFILL_DONE_S
    last = "no backfill yet"
    while time.monotonic() < deadline:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            backfills = instance.get_backfills()
            if backfills:
                bf = backfills[0]
                runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": bf.backfill_id}))
                statuses = sorted(r.status.value for r in runs)
                last = f"backfill {bf.backfill_id} {bf.status.value}, runs {statuses}"
                if bf.status.value not in ("REQUESTED", "CANCELING") and all(r.is_finished for r in runs):
                    return bf, runs  # done, for better or worse: the test's assertions judge it
        time.sleep(3)
    pytest.fail(f"backfill not finished within {BACKFILL_DONE_S}s: {last}")


def test_backfill_of_two_users_from_the_ui(tmp_path, monkeypatch):
    archive = tmp_path / "archive"
    write_jsonl(archive / "a.jsonl",
                conversation("alice", "c1", ["I'm planning a trip to Lisbon.", "Great!"])
                + conversation("bob", "c2", ["My dog is sick.", "Sorry to hear."])
                + conversation("chen", "c3", ["I started learning piano.", "Nice!"]))
    data_root = tmp_path / "data"
    home = tmp_path / "dagster_home"
    home.mkdir()
    install_instance_config(home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # dagster.yaml's event log storage reads it, as in the README
    with dg.DagsterInstance.from_config(str(home)) as instance:  # what `qumem`/the sensor would register
        instance.add_dynamic_partitions("users", ["alice", "bob", "chen"])

    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUMEM_", "DAGSTER_"))}
    env.update(
        DAGSTER_HOME=str(home), QUMEM_ARCHIVE=str(archive), QUMEM_DATA_ROOT=str(data_root),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", QUMEM_USERS_PER_RUN="50",
    )
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = tmp_path / "dagster_dev.log"
    dagster_bin = Path(sys.executable).with_name("dagster")
    with open(log, "wb") as out:
        # README: `export DAGSTER_HOME=... && .venv/bin/dagster dev -w workspace.yaml`, here on loopback.
        proc = subprocess.Popen(
            [str(dagster_bin), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        _wait_for_server(proc, base_url, log)
        _launch_backfill_in_ui(base_url, ["alice", "bob"], tmp_path)
        backfill, runs = _wait_for_backfill(home)
        final_shot = tmp_path / "ui_backfill_runs.png"
        _runs_page_screenshot(base_url, final_shot)
    finally:
        stop_process_group(proc)

    assert backfill.status.value == "COMPLETED_SUCCESS", (backfill.status, log.read_text()[-3000:])
    # Both users fit one run (QUMEM_USERS_PER_RUN=50 in the shared backfill policy): one range run, not two.
    assert len(runs) == 1 and runs[0].status == dg.DagsterRunStatus.SUCCESS
    assert (runs[0].tags.get("dagster/asset_partition_range_start"),
            runs[0].tags.get("dagster/asset_partition_range_end")) == ("alice", "bob")
    from qumem_pipeline.storage.layout import DataLayout

    # the archive sync ingests each new file once for every user it holds; the run range above is alice..bob
    assert DataLayout(data_root).users_in("turns") == ["alice", "bob", "chen"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for shot in ("ui_backfill_dialog.png", "ui_backfill_runs.png"):
        shutil.copy(tmp_path / shot, ARTIFACTS / shot)
    print(f"screenshots: {tmp_path} (copied to {ARTIFACTS})")
