"""The API docs (/docs: Swagger UI, /redoc: ReDoc) render in a browser that can reach no host
but the server: their scripts and styles come with the package."""

from __future__ import annotations

from urllib.parse import urlparse

from playwright.sync_api import expect

from tests.ui.ui_support import LiveServer


def test_the_api_docs_render_without_internet(page, server: LiveServer) -> None:
    local = urlparse(server.url).netloc
    refused: list[str] = []

    def only_local(route) -> None:
        if urlparse(route.request.url).netloc == local:
            route.continue_()
        else:
            refused.append(route.request.url)
            route.abort()

    page.route("**/*", only_local)
    blocked: list[str] = []  # what the pages' Content-Security-Policy kept them from loading
    page.on("console", lambda message: blocked.append(message.text)
            if "Content Security Policy" in message.text else None)
    page.goto(f"{server.url}/docs")
    expect(page.get_by_text("/v1/chat/completions", exact=True)).to_be_visible()
    expect(page.get_by_text("Answer a conversation").first).to_be_visible()
    page.goto(f"{server.url}/redoc")
    expect(page.locator("h2", has_text="Answer a conversation")).to_be_visible()
    page.wait_for_load_state("networkidle")
    assert refused == []
    assert not [b for b in blocked if "script" in b or "stylesheet" in b], blocked  # the pages' own code ran
