"""Headless Debian Chromium through Playwright, shared by the UI test and bench/ui_load.py."""

import contextlib

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@contextlib.contextmanager
def headless_page(timeout_ms: int):
    """A fresh browser's page (1600x1000, default timeout `timeout_ms`); the browser is closed whatever happens."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(timeout_ms)
            yield page
        finally:
            browser.close()
