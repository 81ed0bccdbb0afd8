"""Screenshots of every page at 1280x800, for the README with `--update-screenshots`
(`python -m pytest tests/ui/test_screenshots.py tests/ui/test_usability.py --update-screenshots`
rewrites docs/screenshots/; otherwise they go to a temporary folder), taken on data this
test sets up: two more tenants with adapters, keys and a system prompt (admin API), requests
through the openai client (this hour's usage, and generation while the Engine page is shown),
and usage of the previous 23 hours written to the registry directly, so that the usage charts
show a day rather than one bar."""

from __future__ import annotations

import math
import re
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

from playwright.sync_api import expect

from loraplex.demo import DEMO_PROMPT
from loraplex.registry import Registry, RegistryConfig
from tests.options import UPDATE_SCREENSHOTS
from tests.ui.ui_support import (
    REPO,
    SCREENSHOT_DIR,
    LiveServer,
    copy_adapter,
    go_to,
    screenshot,
    upload_adapter,
)

TENANTS = {"acme": {"weight": 2, "max_concurrent_requests": 8, "max_tokens_per_minute": 20000},
           "globex": {"weight": 1, "max_requests_per_minute": 120}}
ADAPTERS = {("acme", "support-bot"): "butler", ("acme", "pirate-chat"): "pirate",
            ("globex", "terse"): "robot"}
"""(tenant, name): the demo adapter uploaded under that name."""
NUM_STREAMS = 4


def _seed(server: LiveServer, admin) -> dict[str, str]:
    keys = {}
    for name, settings in TENANTS.items():
        assert admin.post("/tenants", json={"name": name, **settings}).status_code == 201
        keys[name] = admin.post("/keys", json={"tenant": name}).json()["secret"]
    for (tenant, name), source in ADAPTERS.items():
        upload_adapter(server, tenant, name, server.demo_adapters / source)
    assert admin.post("/prompts", json={
        "tenant": "acme", "name": "support", "adapter": "support-bot",
        "text": "You are Acme's support assistant. Answer in two sentences and never promise refunds.",
    }).status_code == 201
    for (tenant, name) in ADAPTERS:
        client = server.openai(keys[tenant])
        for _ in range(3 if tenant == "acme" else 2):
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": DEMO_PROMPT}],
                                           max_tokens=24)
    server.openai(keys["globex"]).completions.create(model="loraplex-demo", prompt=DEMO_PROMPT, max_tokens=16)
    return keys


def _seed_history(server: LiveServer) -> None:
    """Usage of the previous 23 hours: a daily curve per adapter (deterministic)."""
    now = datetime.now(timezone.utc)
    with Registry.open(RegistryConfig(data_dir=server.data_dir), migrate=False) as registry:
        for hours_ago in range(1, 24):
            at = now - timedelta(hours=hours_ago)
            daytime = 1 + math.sin((at.hour - 8) / 24 * 2 * math.pi)  # 0..2, busiest mid-afternoon
            for index, (tenant, name) in enumerate(ADAPTERS):
                requests = round((3 - index) * (1 + 2 * daytime))
                registry.usage.record(tenant, name, prompt_tokens=40 * requests, at=at,
                                      completion_tokens=(90 - 20 * index) * requests, num_requests=requests)
            registry.usage.record("globex", None, prompt_tokens=30, completion_tokens=60, num_requests=2,
                                  at=at)


def _generate_until(stop: threading.Event, server: LiveServer, key: str, model: str) -> None:
    """Stream a long answer until `stop` is set (closing the stream aborts the request)."""
    client = server.openai(key)
    while not stop.is_set():
        stream = client.completions.create(model=model, prompt=DEMO_PROMPT, max_tokens=1500, stream=True,
                                           extra_body={"ignore_eos": True})
        with stream:
            for _ in stream:
                if stop.is_set():
                    break


def test_screenshots_of_every_page(page, server: LiveServer, admin, tmp_path: Path, screenshot_dir: Path):
    keys = _seed(server, admin)
    _seed_history(server)

    page.goto(f"{server.url}/admin/")
    expect(page.get_by_label("Admin API key")).to_be_focused()
    screenshot(page, "sign-in", screenshot_dir)
    page.get_by_label("Admin API key").fill(server.admin_key)
    page.get_by_role("button", name="Sign in").click()

    expect(page.locator('tr[data-key="globex/terse"]')).to_be_visible()
    screenshot(page, "adapters", screenshot_dir)
    bad = copy_adapter(server.demo_adapters / "pirate", tmp_path / "bad", r=4096, lora_alpha=8192)
    page.get_by_label("Tenant", exact=True).first.select_option("acme")
    page.get_by_label("Adapter name").fill("too-big")
    page.get_by_label("adapter_config.json").set_input_files(bad / "adapter_config.json")
    page.get_by_label("adapter_model.safetensors").set_input_files(bad / "adapter_model.safetensors")
    page.get_by_role("button", name="Upload adapter").click()
    expect(page.get_by_text("exceeds the limit")).to_be_visible()
    screenshot(page, "adapters-upload-error", screenshot_dir)

    go_to(page, "Tenants")
    expect(page.locator('tr[data-key="globex"]')).to_be_visible()
    screenshot(page, "tenants", screenshot_dir)

    go_to(page, "API keys")
    expect(page.locator("tbody tr").first).to_be_visible()
    screenshot(page, "keys", screenshot_dir)
    page.get_by_label("Tenant", exact=True).first.select_option("acme")
    page.get_by_role("button", name="Create key").click()
    expect(page.get_by_role("dialog", name="New API key")).to_be_visible()
    screenshot(page, "keys-created", screenshot_dir)
    page.keyboard.press("Escape")

    go_to(page, "System prompts")
    expect(page.locator('tr[data-key="acme/support"]')).to_be_visible()
    screenshot(page, "prompts", screenshot_dir)

    go_to(page, "Usage")
    expect(page.locator('#usage-by-adapter-card .legend li[data-series="acme/support-bot"]')).to_be_visible()
    screenshot(page, "usage", screenshot_dir)

    go_to(page, "Engine")
    expect(page.locator('[data-stat="running"]')).to_have_text("0")
    page.wait_for_timeout(4000)  # some idle history on the charts first
    stop = threading.Event()
    models = [*ADAPTERS, ("globex", "loraplex-demo")]
    threads = [threading.Thread(target=_generate_until, args=(stop, server, keys[tenant], model), daemon=True)
               for tenant, model in models[:NUM_STREAMS]]
    for thread in threads:
        thread.start()
    try:
        expect(page.locator('[data-stat="running"]')).to_have_text(str(NUM_STREAMS), timeout=15_000)
        expect(page.locator('[data-stat="tokens-per-second"]')).not_to_have_text(re.compile(r"^0(\.0)?$"),
                                                                                  timeout=15_000)
        page.wait_for_timeout(6000)
        screenshot(page, "engine", screenshot_dir)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)


def test_screenshots_go_outside_the_checkout_unless_asked(request, screenshot_dir: Path):
    """Running the tests leaves the checkout as it was (tests/conftest.py fails a run that
    changes it); `--update-screenshots` is the one way to rewrite docs/screenshots/."""
    is_updating = request.config.getoption(UPDATE_SCREENSHOTS)
    assert (screenshot_dir == SCREENSHOT_DIR) == is_updating
    assert is_updating or not screenshot_dir.resolve().is_relative_to(REPO)
