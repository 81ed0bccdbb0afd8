"""Browser tests of the admin UI: one `loraplex serve` on the demo and one Chromium for the
session; a fresh browser context (own sessionStorage) per test. A failing test leaves a
screenshot of its page in its tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ui.ui_support import DESKTOP, LiveServer, launch_chromium, prepare_demo, run_server, sign_in


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


_FAILED = pytest.StashKey[bool]()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("ui-server")
    data_dir = root / "data"
    data_dir.mkdir()
    prepare_demo(data_dir)
    with run_server(data_dir, root / "server.log") as running:
        yield running


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        try:
            chromium = launch_chromium(playwright)
        except Exception as exc:  # a missing browser fails the tests; it never skips them
            pytest.fail(f"could not start Chromium for the UI tests: {exc}", pytrace=False)
        yield chromium
        chromium.close()


def _new_page(browser: Any, request: pytest.FixtureRequest, tmp_path: Path, viewport: dict) -> Iterator[Any]:
    context = browser.new_context(viewport=viewport, locale="en-US", timezone_id="UTC")
    context.set_default_timeout(15_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    if request.node.stash.get(_FAILED, False):
        page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A page in a fresh context at 1280x800."""
    yield from _new_page(browser, request, tmp_path, DESKTOP)


@pytest.fixture
def admin_page(page: Any, server: LiveServer) -> Any:
    """A page signed in with the admin key, on the Adapters page."""
    return sign_in(page, server)


@pytest.fixture
def admin(server: LiveServer) -> Iterator[Any]:
    """An httpx client of the admin API (to set things up and to check what the UI did)."""
    with server.admin() as client:
        yield client
