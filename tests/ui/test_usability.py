"""Keyboard use, labels and narrow windows: a skip link first, a visible focus, every control
labelled with its errors wired to it, and at 400 px a collapsed menu and no sideways scrolling."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.ui.ui_support import NARROW, LiveServer, go_to, screenshot, sign_in

PAGES = {"adapters": "Adapters", "tenants": "Tenants", "keys": "API keys", "prompts": "System prompts",
         "documents": "Documents", "usage": "Usage", "engine": "Engine"}

# Controls with no accessible name, aria-describedby pointing nowhere, and repeated ids.
FIND_PROBLEMS = """() => {
  const problems = [];
  const visible = (el) => el.getClientRects().length > 0;
  for (const el of document.querySelectorAll("input, select, textarea")) {
    if (!visible(el)) continue;
    const named = el.labels.length > 0 || el.getAttribute("aria-label") || el.getAttribute("aria-labelledby");
    if (!named) problems.push(`unlabelled ${el.tagName} ${el.name}`);
  }
  for (const el of document.querySelectorAll("button, a[href]")) {
    const named = el.textContent.trim() || el.getAttribute("aria-label");
    if (visible(el) && !named) problems.push(`nameless ${el.outerHTML}`);
  }
  for (const el of document.querySelectorAll("[aria-describedby], [aria-labelledby]")) {
    const ids = `${el.getAttribute("aria-describedby") || ""} ${el.getAttribute("aria-labelledby") || ""}`;
    for (const id of ids.split(/\\s+/).filter(Boolean)) {
      if (!document.getElementById(id)) problems.push(`${el.tagName} refers to missing #${id}`);
    }
  }
  const ids = [...document.querySelectorAll("[id]")].map((el) => el.id);
  for (const id of new Set(ids)) {
    if (ids.filter((x) => x === id).length > 1) problems.push(`repeated id ${id}`);
  }
  return problems;
}"""


def _focused(page) -> str:
    return page.evaluate("""() => {
      const el = document.activeElement;
      const label = el.labels && el.labels[0]?.textContent;
      return (label || el.getAttribute("aria-label") || el.textContent).trim();
    }""")


def _wait_loaded(page, title: str) -> None:
    expect(page.get_by_role("heading", name=title, level=1)).to_be_visible()
    expect(page.locator("[aria-busy]")).to_have_count(0)
    expect(page.get_by_text("Loading…")).to_have_count(0)


def test_keyboard_skip_link_tab_order_and_visible_focus(admin_page):
    page = admin_page
    page.reload()
    _wait_loaded(page, "Adapters")
    page.keyboard.press("Tab")
    assert _focused(page) == "Skip to main content"
    box = page.get_by_role("link", name="Skip to main content").bounding_box()
    assert box is not None and box["y"] >= 0  # shown when focused
    order = []
    for _ in range(len(PAGES) + 3):
        page.keyboard.press("Tab")
        order.append(_focused(page))
    assert order == ["loraplex admin", "Sign out", *PAGES.values(), "Tenant"]

    page.reload()
    _wait_loaded(page, "Adapters")
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    assert page.url.endswith("#/adapters")  # the skip link does not change the route
    page.keyboard.press("Tab")
    focused = page.locator(":focus")
    expect(focused).to_have_attribute("name", "tenant")
    style, width = focused.evaluate("el => [getComputedStyle(el).outlineStyle, "
                                    "getComputedStyle(el).outlineWidth]")
    assert style != "none" and float(width.removesuffix("px")) >= 2


@pytest.mark.parametrize("route", list(PAGES))
def test_every_control_is_labelled_on_every_page(admin_page, route: str):
    page = admin_page
    page.get_by_role("link", name=PAGES[route], exact=True).click()
    _wait_loaded(page, PAGES[route])
    assert page.evaluate(FIND_PROBLEMS) == []


def test_errors_are_tied_to_their_field(admin_page):
    page = admin_page
    go_to(page, "Tenants")
    name = page.get_by_label("Name", exact=True)
    name.press("Enter")  # Enter submits; the empty required name is refused before any call
    expect(name).to_have_attribute("aria-invalid", "true")
    expect(name).to_be_focused()
    expect(name).to_have_accessible_description("1 to 64 letters, digits, dots, dashes or underscores. "
                                                "This field is required.")
    name.type("acme")
    expect(name).not_to_have_attribute("aria-invalid", "true")


def test_narrow_window_collapses_the_menu_and_never_scrolls_sideways(narrow_page, server: LiveServer,
                                                                    screenshot_dir: Path):
    page = sign_in(narrow_page, server)
    menu = page.get_by_role("button", name="Menu")
    nav = page.get_by_role("navigation", name="Main")
    expect(menu).to_be_visible()
    expect(menu).to_have_attribute("aria-expanded", "false")
    expect(nav).to_be_hidden()
    _wait_loaded(page, "Adapters")
    row = page.locator('tr[data-key="demo/pirate"]')
    tenant_cell = row.locator('td[data-label="Tenant"]').bounding_box()
    name_cell = row.locator('td[data-label="Name"]').bounding_box()
    assert name_cell["y"] >= tenant_cell["y"] + tenant_cell["height"]  # the row stacks as a card
    page.get_by_role("heading", name="All adapters").evaluate(
        "heading => window.scrollTo(0, heading.getBoundingClientRect().top + window.scrollY - 72)")
    screenshot(page, "narrow-adapters", screenshot_dir)
    page.evaluate("window.scrollTo(0, 0)")

    for route, title in PAGES.items():
        menu.click()
        expect(menu).to_have_attribute("aria-expanded", "true")
        nav.get_by_role("link", name=title, exact=True).click()
        _wait_loaded(page, title)
        expect(nav).to_be_hidden()  # choosing a page closes the menu
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= NARROW["width"], f"{route} is {width} px wide at {NARROW['width']} px"
    menu.click()
    screenshot(page, "narrow-menu", screenshot_dir)
    page.keyboard.press("Escape")
    expect(nav).to_be_hidden()
    expect(menu).to_be_focused()
