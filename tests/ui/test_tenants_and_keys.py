"""The Tenants and API keys pages: create and edit a tenant, create a key (shown once, copied),
use it with the official openai client, revoke it and see the client get 401."""

from __future__ import annotations

import openai
import pytest
from playwright.sync_api import expect

from tests.ui.ui_support import LiveServer, go_to


def _error_of(page, control):
    return page.locator(f"#{control.get_attribute('id')}-error")


def test_create_and_edit_a_tenant(admin_page, server: LiveServer, admin):
    page = admin_page
    go_to(page, "Tenants")
    expect(page.get_by_role("heading", name="Tenants", level=1)).to_be_focused()

    name = page.get_by_label("Name", exact=True)
    weight = page.get_by_label("Weight")
    name.fill("ui tenant")  # a space is not allowed in names
    weight.fill("0")
    name.press("Enter")
    expect(name).to_have_attribute("aria-invalid", "true")
    expect(_error_of(page, name)).to_contain_text("Not a valid name")

    name.fill("ui-acme")
    name.press("Enter")
    expect(weight).to_have_attribute("aria-invalid", "true")
    expect(_error_of(page, weight)).to_have_text("Enter a number above 0.")
    expect(weight).to_be_focused()

    weight.fill("2.5")
    page.get_by_label("Max concurrent requests").fill("4")
    page.get_by_role("button", name="Create tenant").click()
    row = page.locator('tr[data-key="ui-acme"]')
    expect(row.locator('td[data-label="Weight"]')).to_have_text("2.5")
    expect(row.locator('td[data-label="Concurrent"]')).to_have_text("4")
    expect(row.locator('td[data-label="Requests/min"]')).to_have_text("unlimited")
    expect(name).to_have_value("")  # the form is ready for the next one
    expect(weight).to_have_value("1")
    created = admin.get("/tenants/ui-acme").json()
    assert created["weight"] == 2.5
    assert (created["max_concurrent_requests"], created["max_requests_per_minute"]) == (4, None)

    name.fill("ui-acme")
    page.get_by_role("button", name="Create tenant").click()
    expect(_error_of(page, name)).to_contain_text("already exists")

    page.get_by_role("button", name="Edit tenant ui-acme").click()
    dialog = page.get_by_role("dialog", name="Edit tenant ui-acme")
    expect(dialog.get_by_label("Weight")).to_have_value("2.5")
    dialog.get_by_label("Max concurrent requests").fill("")  # empty: unlimited
    rpm = dialog.get_by_label("Max requests per minute")
    rpm.fill("-3")
    rpm.press("Enter")
    expect(_error_of(page, rpm)).to_contain_text("whole number of at least 1")
    rpm.fill("120")
    rpm.press("Enter")  # Enter saves
    expect(dialog).to_be_hidden()
    expect(row.locator('td[data-label="Requests/min"]')).to_have_text("120")
    expect(row.locator('td[data-label="Concurrent"]')).to_have_text("unlimited")
    saved = admin.get("/tenants/ui-acme").json()
    assert (saved["max_concurrent_requests"], saved["max_requests_per_minute"]) == (None, 120)


def test_create_a_key_shown_once_use_it_revoke_it_and_get_401(admin_page, server: LiveServer, admin):
    assert admin.post("/tenants", json={"name": "ui-keys"}).status_code == 201
    page = admin_page
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    go_to(page, "API keys")
    page.get_by_label("Kind of key").select_option("tenant")
    page.get_by_label("Tenant", exact=True).first.select_option("ui-keys")
    page.get_by_role("button", name="Create key").click()

    dialog = page.get_by_role("dialog", name="New API key")
    expect(dialog.get_by_text("only time the key is shown")).to_be_visible()
    secret = dialog.get_by_role("textbox").input_value()
    assert secret.startswith("lpx-")
    dialog.get_by_role("button", name="Copy").click()
    expect(dialog.get_by_text("Copied to the clipboard.")).to_be_visible()
    assert page.evaluate("navigator.clipboard.readText()") == secret
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()
    assert secret not in page.content()  # shown once: gone with the dialog

    key = next(k for k in admin.get("/keys", params={"tenant": "ui-keys"}).json())
    row = page.locator(f'tr[data-key="{key["id"]}"]')
    expect(row.locator('td[data-label="Prefix"]')).to_have_text(f"{key['prefix']}…")
    assert secret.startswith(key["prefix"])
    expect(row.locator('td[data-label="Status"]')).to_have_text("active")

    client = server.openai(secret)
    assert [m.id for m in client.models.list()] == ["loraplex-demo"]  # the tenant has no adapters
    reply = client.completions.create(model="loraplex-demo", prompt="Tea", max_tokens=3)
    assert reply.usage.completion_tokens >= 1

    page.get_by_role("button", name=f"Revoke key #{key['id']}").click()
    confirm = page.get_by_role("dialog", name=f"Revoke key #{key['id']}?")
    confirm.get_by_role("button", name="Revoke key").click()
    expect(row).to_have_count(0)  # revoked keys are hidden by default
    page.get_by_label("Show revoked keys").check()
    expect(row.locator('td[data-label="Status"]')).to_have_text("revoked")
    expect(row.get_by_role("button")).to_have_count(0)

    with pytest.raises(openai.AuthenticationError) as raised:
        client.models.list()
    assert raised.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="loraplex-demo", prompt="Tea", max_tokens=3)


def test_an_admin_key_needs_no_tenant(admin_page, server: LiveServer, admin):
    page = admin_page
    go_to(page, "API keys")
    page.get_by_label("Kind of key").select_option("admin")
    expect(page.get_by_label("Tenant", exact=True).first).to_be_disabled()
    page.get_by_role("button", name="Create key").click()
    secret = page.get_by_role("dialog", name="New API key").get_by_role("textbox").input_value()
    page.get_by_role("button", name="Done").click()
    me = admin.get("/me", headers={"Authorization": f"Bearer {secret}"}).json()
    assert me["role"] == "admin"
    expect(page.locator(f'tr[data-key="{me["key_id"]}"] td[data-label="Role"]')).to_have_text("admin")
