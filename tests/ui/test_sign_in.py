"""Signing in and out of the admin UI with keys of each kind."""

from __future__ import annotations

from playwright.sync_api import expect

from tests.ui.ui_support import LiveServer, go_to, sign_in


def test_sign_in_refuses_unknown_and_tenant_keys_next_to_the_field(page, server: LiveServer):
    page.goto(f"{server.url}/admin/")
    key = page.get_by_label("Admin API key")
    expect(key).to_be_focused()

    page.get_by_role("button", name="Sign in").click()
    expect(key).to_have_attribute("aria-invalid", "true")
    expect(page.locator(f"#{key.get_attribute('id')}-error")).to_have_text("Enter an admin API key.")

    key.fill("lpx-not-a-key")
    key.press("Enter")
    error = page.locator(f"#{key.get_attribute('id')}-error")
    expect(error).to_contain_text("not accepted")
    assert error.get_attribute("id") in key.get_attribute("aria-describedby").split()

    key.fill(server.demo_key)
    key.press("Enter")
    expect(error).to_contain_text("tenant's key")
    expect(page.get_by_role("navigation", name="Main")).to_be_hidden()
    assert page.evaluate("sessionStorage.length") == 0


def test_sign_in_keeps_the_key_for_the_tab_only_and_sign_out_forgets_it(page, server: LiveServer):
    sign_in(page, server, route="tenants")
    expect(page.get_by_role("heading", name="Tenants", level=1)).to_be_visible()
    expect(page.get_by_text("Admin key #")).to_be_visible()
    assert page.evaluate("Object.values(sessionStorage)") == [server.admin_key]

    page.reload()  # the same tab: still signed in, on the same page
    expect(page.get_by_role("heading", name="Tenants", level=1)).to_be_visible()

    other = page.context.new_page()  # another tab has its own sessionStorage
    other.goto(f"{server.url}/admin/")
    expect(other.get_by_label("Admin API key")).to_be_visible()
    other.close()

    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_label("Admin API key")).to_be_visible()
    assert page.evaluate("sessionStorage.length") == 0
    page.reload()
    expect(page.get_by_label("Admin API key")).to_be_visible()


def test_a_revoked_admin_key_ends_the_session(page, server: LiveServer, admin):
    created = admin.post("/keys", json={"admin": True}).json()
    page.goto(f"{server.url}/admin/")
    page.get_by_label("Admin API key").fill(created["secret"])
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("navigation", name="Main")).to_be_visible()

    go_to(page, "Tenants")
    page.get_by_role("button", name="Edit tenant demo").click()
    dialog = page.get_by_role("dialog", name="Edit tenant demo")
    expect(dialog).to_be_visible()

    assert admin.post(f"/keys/{created['key']['id']}/revoke").status_code == 200
    dialog.get_by_label("Weight").press("Enter")  # the save is refused: back to signing in
    expect(page.get_by_label("Admin API key")).to_be_visible()
    expect(page.get_by_text("no longer accepted")).to_be_visible()
    expect(dialog).to_have_count(0)
    assert page.evaluate("sessionStorage.length") == 0
    assert admin.get("/tenants/demo").json()["weight"] == 1
