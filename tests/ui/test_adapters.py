"""The Adapters page: upload through the browser (progress bar, validation errors in words next
to the file concerned, nothing stored on failure), the list, delete with confirmation, and the
uploaded adapter answering through the official openai client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from playwright.sync_api import expect

from loraplex.demo import DEMO_PROMPT
from tests.ui.ui_support import LiveServer, copy_adapter, stored_files, upload_adapter

SOURCE_ADAPTER = "robot"


def _answer(client: openai.OpenAI, model: str) -> str:
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": DEMO_PROMPT}], max_tokens=24, temperature=0)
    assert response.model == model
    return response.choices[0].message.content


def _fill_upload(page, tenant: str, name: str, folder: Path) -> None:
    page.get_by_label("Tenant", exact=True).first.select_option(tenant)
    page.get_by_label("Adapter name").fill(name)
    page.get_by_label("adapter_config.json").set_input_files(folder / "adapter_config.json")
    page.get_by_label("adapter_model.safetensors").set_input_files(folder / "adapter_model.safetensors")


def test_upload_a_good_adapter_see_it_listed_and_get_an_answer_from_it(
        admin_page, server: LiveServer, admin, tmp_path: Path):
    page = admin_page
    folder = copy_adapter(server.demo_adapters / SOURCE_ADAPTER, tmp_path / "upload")
    _fill_upload(page, "demo", "ui-upload", folder)
    page.get_by_role("button", name="Upload adapter").click()

    progress = page.get_by_role("progressbar", name="Upload progress")
    expect(page.get_by_text("Uploaded", exact=True)).to_be_visible()
    assert progress.get_attribute("data-phase") == "validating"  # XHR upload events were seen
    assert progress.evaluate("bar => bar.value") == 100
    expect(page.get_by_role("status").filter(has_text="Adapter demo/ui-upload uploaded")).to_be_visible()

    row = page.locator('tr[data-key="demo/ui-upload"]')
    expect(row).to_be_visible()
    source = next(a for a in admin.get("/adapters").json() if a["name"] == SOURCE_ADAPTER)
    expect(row.locator('td[data-label="Rank"]')).to_have_text(str(source["rank"]))
    expect(row.locator('td[data-label="Digest"]')).to_have_text(source["digest"][:16])  # same tensors
    expect(row.locator('td[data-label="Targets"] .tag')).to_have_count(len(source["target_modules"]))
    expect(row.locator('td[data-label="Size"]')).to_contain_text("KiB")
    expect(row.locator('td[data-label="Requests"]')).to_have_text("0")

    client = server.openai(server.demo_key)
    assert "ui-upload" in {model.id for model in client.models.list()}
    answer = _answer(client, "ui-upload")
    assert answer  # the same weights as the demo adapter it was copied from answer as it does,
    assert answer == _answer(client, SOURCE_ADAPTER)
    assert answer != _answer(client, "loraplex-demo")  # and not as the base model does

    page.get_by_role("button", name="Refresh").click()
    expect(row.locator('td[data-label="Requests"]')).to_have_text("1")


@pytest.mark.parametrize(("case", "field", "message"), [
    ("rank", "adapter_config.json", "exceeds the limit"),
    ("type", "adapter_config.json", "peft_type must be 'LORA', 'IA3' or 'FLORA'"),
    ("dora", "adapter_model.safetensors", "has no lora_magnitude_vector tensor"),
    ("weights", "adapter_model.safetensors", "not a safetensors file"),
])
def test_a_bad_adapter_shows_the_error_in_words_and_nothing_is_stored(
        admin_page, server: LiveServer, admin, tmp_path: Path, case: str, field: str, message: str):
    page = admin_page
    source = server.demo_adapters / "pirate"
    folder = {
        "rank": lambda: copy_adapter(source, tmp_path / case, r=4096, lora_alpha=8192),
        "type": lambda: copy_adapter(source, tmp_path / case, peft_type="PREFIX_TUNING"),
        "dora": lambda: copy_adapter(source, tmp_path / case, use_dora=True),
        "weights": lambda: copy_adapter(source, tmp_path / case),
    }[case]()
    if case == "weights":
        (folder / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{nope...")
    adapters_before = admin.get("/adapters").json()
    files_before = stored_files(server.data_dir)

    name = f"bad-{case}"
    _fill_upload(page, "demo", name, folder)
    page.get_by_label("Adapter name").press("Enter")  # Enter submits the form

    control = page.get_by_label(field)
    expect(control).to_have_attribute("aria-invalid", "true")
    error = page.locator(f"#{control.get_attribute('id')}-error")
    expect(error).to_contain_text(message)
    assert error.get_attribute("id") in control.get_attribute("aria-describedby").split()
    expect(page.get_by_role("progressbar", name="Upload progress")).to_be_hidden()
    expect(page.locator(f'tr[data-key="demo/{name}"]')).to_have_count(0)

    assert admin.get("/adapters").json() == adapters_before
    assert admin.get(f"/adapters/demo/{name}").status_code == 404
    assert stored_files(server.data_dir) == files_before

    # Choosing another file clears the error.
    control.set_input_files(server.demo_adapters / "pirate" / field)
    expect(control).not_to_have_attribute("aria-invalid", "true")


def test_a_taken_name_is_reported_next_to_the_name(admin_page, server: LiveServer):
    page = admin_page
    _fill_upload(page, "demo", "pirate", server.demo_adapters / "pirate")
    page.get_by_role("button", name="Upload adapter").click()
    name = page.get_by_label("Adapter name")
    expect(name).to_have_attribute("aria-invalid", "true")
    error = page.locator(f"#{name.get_attribute('id')}-error")
    expect(error).to_contain_text("already has an adapter named 'pirate'")
    expect(name).to_be_focused()


def test_delete_asks_first_and_escape_keeps_the_adapter(admin_page, server: LiveServer, admin):
    upload_adapter(server, "demo", "ui-delete-me", server.demo_adapters / "pirate")
    page = admin_page
    page.get_by_role("button", name="Refresh").click()
    delete = page.get_by_role("button", name="Delete adapter demo/ui-delete-me")

    delete.click()
    dialog = page.get_by_role("dialog", name="Delete adapter demo/ui-delete-me?")
    expect(dialog).to_be_visible()
    expect(dialog.get_by_role("button", name="Cancel")).to_be_focused()
    page.keyboard.press("Escape")
    expect(dialog).to_be_hidden()
    expect(delete).to_be_focused()  # focus returns to the button that opened the dialog
    assert admin.get("/adapters/demo/ui-delete-me").status_code == 200

    delete.click()
    dialog.get_by_role("button", name="Delete adapter").click()
    expect(page.locator('tr[data-key="demo/ui-delete-me"]')).to_have_count(0)
    assert admin.get("/adapters/demo/ui-delete-me").status_code == 404
    with pytest.raises(openai.NotFoundError):
        server.openai(server.demo_key).completions.create(model="ui-delete-me", prompt="Hi", max_tokens=2)
