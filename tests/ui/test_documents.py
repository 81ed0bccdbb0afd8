"""Documents: added from a text file with their token count, viewed, refused with the problem
named (a binary file, a name taken), deleted."""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import expect

from tests.ui.ui_support import LiveServer, go_to

TEXT = "Green tea steeps for two minutes at 80 C.\nBlack tea takes four minutes at 95 C.\n"


def test_add_a_document_from_a_file_view_and_delete_it(admin_page, server: LiveServer, admin,
                                                       tmp_path: Path) -> None:
    page = admin_page
    go_to(page, "Documents")
    page.get_by_label("Tenant", exact=True).select_option("demo")
    binary = tmp_path / "photo.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    page.get_by_label("File").set_input_files(str(binary))
    expect(page.get_by_text("photo.png is not UTF-8 text (a binary file?)")).to_be_visible()
    source = tmp_path / "tea-guide.txt"
    source.write_text(TEXT)
    page.get_by_label("File").set_input_files(str(source))
    expect(page.get_by_label("Text", exact=True)).to_have_value(TEXT)
    expect(page.get_by_label("Name", exact=True)).to_have_value("tea-guide")
    page.get_by_role("button", name="Add document").click()
    row = page.locator('tr[data-key="demo/tea-guide"]')
    expect(row).to_be_visible()
    stored = admin.get("/documents/demo/tea-guide").json()
    assert stored["text"] == TEXT and stored["num_tokens"] > 0
    expect(row.locator('td[data-label="Tokens"]')).to_have_text(str(stored["num_tokens"]))

    view = page.get_by_role("button", name="View document demo/tea-guide")
    view.click()
    dialog = page.get_by_role("dialog", name="Document demo/tea-guide")
    expect(dialog.locator("pre")).to_have_text(TEXT)
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()

    page.get_by_label("Name", exact=True).fill("tea-guide")
    page.get_by_label("Text", exact=True).fill("again")
    page.get_by_role("button", name="Add document").click()
    name = page.get_by_label("Name", exact=True)
    expect(name).to_have_attribute("aria-invalid", "true")
    expect(page.get_by_text("already has a document named 'tea-guide'")).to_be_visible()
    assert admin.get("/documents/demo/tea-guide").json()["text"] == TEXT  # unchanged

    page.get_by_role("button", name="Delete document demo/tea-guide").click()
    page.get_by_role("dialog").get_by_role("button", name="Delete document").click()
    expect(row).to_be_hidden()
    assert admin.get("/documents/demo/tea-guide").status_code == 404
