"""The built docs site in a real browser: Debian's headless Chromium (Playwright) opens the home page and the
API reference of ``rlkit``, served on loopback, and checks that each renders: its title, the navigation, a code
block and an image, with nothing fetched from anywhere but the site itself. Screenshots go to reports/browser/.

Runs after ``make docs`` (``make test`` builds the site, then runs this); skips, saying so, without a build.
"""

from __future__ import annotations

import functools
import os
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "build" / "docs" / "html"
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "reports" / "browser"

pytestmark = [
    pytest.mark.docs,
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"no {CHROMIUM}: apt-get install chromium"),
    pytest.mark.skipif(not (SITE / "index.html").exists(), reason=f"no site in {SITE}: run `make docs` first"),
]


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


@pytest.fixture(scope="module")
def site():
    """The built site over HTTP on 127.0.0.1 (a free port); yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (no browser download)")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


def open_page(browser, url: str):
    """A page at ``url`` whose requests beyond loopback are refused and recorded in ``page.outside``."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.outside = []

    def only_loopback(route) -> None:
        host = urlparse(route.request.url).hostname
        if route.request.url.startswith("data:") or host == "127.0.0.1":
            route.continue_()
        else:
            page.outside.append(route.request.url)
            route.abort()

    page.route("**/*", only_loopback)
    page.goto(url, wait_until="load")
    return page


def check_renders(page, title: str, screenshot: str) -> None:
    assert title in page.title()
    navigation = page.locator(".bd-header nav a.nav-link, nav.bd-docs-nav a.reference")
    assert navigation.count() >= 4, "the header's and the sidebar's navigation list the site's pages"
    assert page.locator("div.highlight pre").first.is_visible(), "a highlighted code block"
    images = page.locator("img")
    assert images.count() >= 1
    drawn = page.evaluate("() => [...document.images].filter(i => i.complete && i.naturalWidth > 0).length")
    assert drawn == images.count(), "every image loads"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / screenshot))
    assert page.outside == [], f"requests beyond the site: {page.outside}"


def test_the_home_page_renders(site, browser):
    page = open_page(browser, f"{site}/index.html")
    check_renders(page, "rlkit", "docs-home.png")
    assert page.locator("img[src*='dashboard']").is_visible(), "the dashboard's picture"
    page.close()


def test_an_api_page_renders(site, browser):
    page = open_page(browser, f"{site}/reference/api/rlkit.html")
    check_renders(page, "rlkit", "docs-api.png")
    trainer = page.locator("dt[id='rlkit.Trainer']")
    assert trainer.is_visible() and "cluster" in trainer.inner_text(), "rlkit.Trainer's signature"
    page.close()
