"""Browser tests of the admin UI: one `loraplex serve` on the demo and one Chromium for the
session; a fresh browser context (own sessionStorage) per test. A failing test leaves a
screenshot of its page in its tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.options import UPDATE_SCREENSHOTS
from tests.ui.ui_support import (
    DESKTOP,
    FAILED,
    NARROW,
    SCREENSHOT_DIR,
    LiveServer,
    launch_chromium,
    open_page,
    prepare_demo,
    run_server,
    sign_in,
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if report.when == "call":
        item.stash[FAILED] = report.failed
    return report


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("ui-server")
    data_dir = root / "data"
    data_dir.mkdir()
    prepare_demo(data_dir)
    with run_server(data_dir, root / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Chromium for one test module. Not for the session: Playwright's sync API keeps an event
    loop running in the main thread while it is open, and under pytest-xdist (scripts/test.sh)
    a worker runs other modules after the UI ones, whose asyncio.run() would then refuse."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        try:
            chromium = launch_chromium(playwright)
        except Exception as exc:  # a missing browser fails the tests; it never skips them
            pytest.fail(f"could not start Chromium for the UI tests: {exc}", pytrace=False)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A page in a fresh context at 1280x800."""
    yield from open_page(browser, request.node, tmp_path, DESKTOP)


@pytest.fixture
def narrow_page(browser: Any, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A page in a fresh context at 400x800."""
    yield from open_page(browser, request.node, tmp_path, NARROW)


@pytest.fixture
def admin_page(page: Any, server: LiveServer) -> Any:
    """A page signed in with the admin key, on the Adapters page."""
    return sign_in(page, server)


@pytest.fixture(scope="session")
def screenshot_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docs/screenshots/ with --update-screenshots (the README's pictures), else a temporary
    folder: tests do not change the checkout."""
    if request.config.getoption(UPDATE_SCREENSHOTS):
        return SCREENSHOT_DIR
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture
def admin(server: LiveServer) -> Iterator[Any]:
    """An httpx client of the admin API (to set things up and to check what the UI did)."""
    with server.admin() as client:
        yield client
