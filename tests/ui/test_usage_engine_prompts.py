"""The Usage charts count the requests made through the openai client; the Engine page
refreshes live while it is open (and stops polling when left); system prompts are added and
viewed with their token count."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from loraplex.demo import DEMO_PROMPT
from tests.ui.ui_support import LiveServer, go_to, upload_adapter

NUM_ADAPTER_REQUESTS = 3
NUM_BASE_REQUESTS = 2


def _legend(page, chart: str, series: str):
    return page.locator(f'#usage-by-{chart}-card .legend li[data-series="{series}"]')


def _bar_values(page, chart: str, series: str) -> list[int]:
    return page.locator(f'#usage-by-{chart}-card rect[data-series="{series}"]').evaluate_all(
        "bars => bars.map(bar => Number(bar.dataset.value))")


def test_usage_charts_count_the_requests(admin_page, server: LiveServer, admin):
    assert admin.post("/tenants", json={"name": "ui-usage"}).status_code == 201
    upload_adapter(server, "ui-usage", "counter", server.demo_adapters / "butler")
    secret = admin.post("/keys", json={"tenant": "ui-usage"}).json()["secret"]
    client = server.openai(secret)
    completion_tokens = {"counter": 0, "base": 0}
    for i in range(NUM_ADAPTER_REQUESTS):
        reply = client.chat.completions.create(
            model="counter", messages=[{"role": "user", "content": f"{DEMO_PROMPT} ({i})"}], max_tokens=8)
        completion_tokens["counter"] += reply.usage.completion_tokens
    for _ in range(NUM_BASE_REQUESTS):
        reply = client.completions.create(model="loraplex-demo", prompt=DEMO_PROMPT, max_tokens=5)
        completion_tokens["base"] += reply.usage.completion_tokens

    page = admin_page
    go_to(page, "Usage")
    page.get_by_label("Show").select_option("num_requests")
    total = NUM_ADAPTER_REQUESTS + NUM_BASE_REQUESTS
    expect(_legend(page, "tenant", "ui-usage")).to_have_attribute("data-total", str(total))
    expect(_legend(page, "tenant", "ui-usage")).to_contain_text(f"ui-usage{total} requests")
    assert sum(_bar_values(page, "tenant", "ui-usage")) == total
    chart = page.locator("#usage-by-tenant-card").get_by_role("img")
    expect(chart).to_have_accessible_name(re.compile("Requests per hour, by tenant"))

    page.get_by_label("Tenant", exact=True).select_option("ui-usage")  # this tenant's adapters only
    expect(_legend(page, "adapter", "ui-usage/counter")).to_have_attribute(
        "data-total", str(NUM_ADAPTER_REQUESTS))
    expect(_legend(page, "adapter", "ui-usage/(base model)")).to_have_attribute(
        "data-total", str(NUM_BASE_REQUESTS))
    assert sum(_bar_values(page, "adapter", "ui-usage/counter")) == NUM_ADAPTER_REQUESTS
    stats = page.get_by_role("definition")
    expect(stats.nth(0)).to_have_text(str(total))

    page.get_by_label("Show").select_option("completion_tokens")
    expect(_legend(page, "adapter", "ui-usage/counter")).to_have_attribute(
        "data-total", str(completion_tokens["counter"]))
    expect(_legend(page, "adapter", "ui-usage/(base model)")).to_have_attribute(
        "data-total", str(completion_tokens["base"]))
    expect(stats.nth(2)).to_have_text(str(sum(completion_tokens.values())))
    row = page.locator('#usage-table-title ~ .table-wrap tr[data-key="ui-usage/counter"]')
    expect(row.locator('td[data-label="Requests"]')).to_have_text(str(NUM_ADAPTER_REQUESTS))


def test_engine_page_refreshes_live_and_stops_when_left(admin_page, server: LiveServer):
    page = admin_page
    polls: list[str] = []

    def count_polls(request) -> None:
        if request.url.endswith("/admin/api/engine"):
            polls.append(request.url)

    page.on("request", count_polls)
    go_to(page, "Engine")
    generated = page.locator('[data-stat="generated"]')
    expect(generated).to_have_text(re.compile(r"^[\d,]+$"))
    before = int(generated.inner_text().replace(",", ""))

    client = server.openai(server.demo_key)
    reply = client.completions.create(model="pirate", prompt=DEMO_PROMPT, max_tokens=12,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 12
    expect(generated).to_have_text(f"{before + 12:,}", timeout=10_000)  # no reload: it polls
    expect(page.locator('[data-stat="kv"]')).to_have_text(re.compile(r"^[\d,]+$"))
    expect(page.get_by_role("cell", name="demo/pirate")).to_be_visible()
    assert len(polls) >= 2
    # The engine's options, as the server's flags set them (the test server runs with
    # --max-num-seqs and --max-loras of its own), and what start-up made of them.
    options = page.get_by_role("table", name="Engine options (the flags of loraplex serve)")
    expect(options.get_by_role("row", name=re.compile(r"--max-loras"))).to_contain_text(
        str(server.options["max_loras"]))
    expect(options.get_by_role("row", name=re.compile(r"--block-size"))).to_contain_text("16")
    expect(page.locator('[data-role="startup"]')).to_contain_text(
        f'up to {server.options["max_loras"]} adapter slots')

    page.get_by_role("button", name="Pause updates").click()
    expect(page.get_by_role("button", name="Resume updates")).to_have_attribute("aria-pressed", "true")
    go_to(page, "Tenants")
    expect(page.get_by_role("heading", name="Tenants", level=1)).to_be_visible()
    num_polls = len(polls)
    page.wait_for_timeout(3500)
    assert len(polls) == num_polls  # the page is gone, and so is its polling


def test_add_a_system_prompt_and_view_it_with_its_token_count(admin_page, server: LiveServer, admin):
    page = admin_page
    go_to(page, "System prompts")
    page.get_by_label("Tenant", exact=True).select_option("demo")
    adapter = page.get_by_label("Adapter")
    expect(adapter.locator('option[value="pirate"]')).to_have_count(1)
    page.get_by_label("Name", exact=True).fill("ui-tea")
    adapter.select_option("pirate")
    text = "You are a helpful assistant who answers questions about tea.\nKeep answers short."
    page.get_by_label("Text", exact=True).fill(text)
    page.get_by_role("button", name="Add prompt").click()
    row = page.locator('tr[data-key="demo/ui-tea"]')
    expect(row).to_be_visible()

    stored = admin.get("/prompts/demo/ui-tea").json()
    assert stored["adapter"] == "pirate" and stored["text"] == text and stored["num_tokens"] > 0
    expect(row.locator('td[data-label="Tokens"]')).to_have_text(str(stored["num_tokens"]))
    expect(row.locator('td[data-label="Adapter"]')).to_have_text("pirate")

    view = page.get_by_role("button", name="View system prompt demo/ui-tea")
    view.click()
    dialog = page.get_by_role("dialog", name="System prompt demo/ui-tea")
    expect(dialog.locator("pre")).to_have_text(text)
    expect(dialog.get_by_role("definition").first).to_have_text(str(stored["num_tokens"]))
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()
    expect(view).to_be_focused()

    page.get_by_label("Name", exact=True).fill("ui-tea")
    page.get_by_label("Text", exact=True).fill("again")
    page.get_by_role("button", name="Add prompt").click()
    name = page.get_by_label("Name", exact=True)
    expect(name).to_have_attribute("aria-invalid", "true")
