"""What the browser tests share: a real `loraplex serve` subprocess on the built-in demo (fresh
data dir, free loopback port, CPU), Debian's Chromium driven by Playwright, and helpers to sign
in, take screenshots and write adapter files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loraplex.registry.registry_config import DATABASE_URL_ENV

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT_DIR = REPO / "docs" / "screenshots"
"""Where `--update-screenshots` writes the README's screenshots; without it the tests write
theirs to a temporary folder."""
CHROMIUM = os.environ.get("LORAPLEX_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
DEMO_CACHE = Path(os.environ.get("LORAPLEX_TEST_DEMO_CACHE", Path.home() / ".cache" / "loraplex-tests"))
"""Where the demo model and adapters are built once and copied from into each fresh data dir
(building them takes tens of seconds on two cores). `ensure_demo` rebuilds it when the demo's
recipe changes."""
SERVER_START_TIMEOUT_S = 240
DESKTOP = {"width": 1280, "height": 800}
NARROW = {"width": 400, "height": 800}
FAILED = pytest.StashKey[bool]()
"""Set on each test item by conftest's report hook: whether its call phase failed."""


@dataclass(frozen=True)
class LiveServer:
    url: str
    data_dir: Path
    admin_key: str
    demo_key: str
    log_path: Path
    options: dict[str, int]
    """Engine options it was started with (flags of `loraplex serve`)."""

    @property
    def demo_adapters(self) -> Path:
        """The demo's PEFT adapter folders (pirate, butler, robot)."""
        return self.data_dir / "demo" / "adapters"

    def admin(self) -> httpx.Client:
        """A client of the admin API with the admin key."""
        return httpx.Client(base_url=f"{self.url}/admin/api", timeout=30,
                            headers={"Authorization": f"Bearer {self.admin_key}"})

    def openai(self, key: str) -> openai.OpenAI:
        """The official OpenAI client on /v1 with `key` (no retries: tests see each answer)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def log_tail(self, num_chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-num_chars:]
        return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_demo(data_dir: Path) -> None:
    """Put a built demo into `data_dir/demo` (built into the cache first if needed), so that
    `loraplex serve` finds it and skips its first-start build."""
    from loraplex.demo import ensure_demo

    assets = ensure_demo(DEMO_CACHE)
    shutil.copytree(Path(assets.model_dir).parent, data_dir / "demo")


@contextlib.contextmanager
def run_server(data_dir: Path, log_path: Path) -> Iterator[LiveServer]:
    """`loraplex serve` on the demo in a subprocess; stopped with SIGTERM afterwards."""
    port = free_port()
    command = [sys.executable, "-m", "loraplex.cli", "serve", "--data-dir", str(data_dir),
               "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--demo", "tiny"]
    options = {"max_num_seqs": 32, "max_loras": 6}
    for name, value in options.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(DATABASE_URL_ENV, None)  # the demo server keeps its SQLite registry in the data dir
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url, log_path)
        server = LiveServer(url=url, data_dir=data_dir, log_path=log_path, options=options,
                            admin_key=(data_dir / "admin-api-key").read_text().strip(),
                            demo_key=(data_dir / "demo-api-key").read_text().strip())
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(process: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"loraplex serve exited with {process.returncode}:\n"
                               f"{log_path.read_text(errors='replace')[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"loraplex serve was not ready after {SERVER_START_TIMEOUT_S} s:\n"
                       f"{log_path.read_text(errors='replace')[-4000:]}")


def launch_chromium(playwright: Any) -> Any:
    """Debian's Chromium (Playwright's own browser download cannot work on our machines)."""
    if not Path(CHROMIUM).is_file():
        raise RuntimeError(f"Chromium not found at {CHROMIUM}: install Debian's package "
                           "(`apt-get install -y chromium`; scripts/test.sh does) or set LORAPLEX_CHROMIUM")
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def open_page(browser: Any, item: pytest.Item, tmp_path: Path, viewport: dict) -> Iterator[Any]:
    """A page in a fresh browser context (its own sessionStorage); afterwards a screenshot in
    `tmp_path` if the test failed, and a failure if the page raised JavaScript errors."""
    context = browser.new_context(viewport=viewport, locale="en-US", timezone_id="UTC")
    context.set_default_timeout(15_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    if item.stash.get(FAILED, False):
        page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def sign_in(page: Any, server: LiveServer, route: str = "adapters") -> Any:
    """Open the admin UI and sign in with the admin key through the form."""
    from playwright.sync_api import expect

    page.goto(f"{server.url}/admin/#/{route}")
    page.get_by_label("Admin API key").fill(server.admin_key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("button", name="Sign out")).to_be_visible()
    return page


def go_to(page: Any, title: str) -> None:
    """Follow the navigation link to a page and wait until its heading is shown: the previous
    page stays on screen until the new one has rendered, so acting at once can hit it."""
    from playwright.sync_api import expect

    page.get_by_role("navigation", name="Main").get_by_role("link", name=title, exact=True).click()
    expect(page.get_by_role("heading", level=1, name=title, exact=True)).to_be_visible()


def screenshot(page: Any, name: str, folder: Path) -> Path:
    """Save the viewport as `folder`/<name>.png (the `screenshot_dir` fixture's folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), animations="disabled", caret="hide")
    return path


def copy_adapter(source: Path, target: Path, **config_changes: Any) -> Path:
    """A copy of a PEFT adapter folder with changes to its adapter_config.json."""
    target.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "adapter_config.json").read_text())
    config.update(config_changes)
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2))
    shutil.copyfile(source / "adapter_model.safetensors", target / "adapter_model.safetensors")
    return target


def upload_adapter(server: LiveServer, tenant: str, name: str, folder: Path) -> dict:
    """Upload through the admin API (multipart), for tests that need an adapter in place."""
    with server.admin() as admin:
        files = {field: (file_name, (folder / file_name).read_bytes()) for field, file_name in (
            ("adapter_config", "adapter_config.json"), ("adapter_model", "adapter_model.safetensors"))}
        response = admin.post("/adapters", data={"tenant": tenant, "name": name}, files=files)
    response.raise_for_status()
    return response.json()


def stored_files(data_dir: Path) -> set[str]:
    """Every file in the blob store (content-addressed blobs and temporary files)."""
    root = data_dir / "blobs"
    return {str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()}
