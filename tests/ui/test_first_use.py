"""What a first-time user met in the admin UI: one identity for an adapter wherever it is shown
(the UI, the admin API, the CLI, the engine page, the engine's own digest), the engine page
following deletions when two names share a digest, the tenant kept after an upload, notices
that never cover the page, and the UI saying plainly what does not act yet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from playwright.sync_api import expect

from loraplex.adapter_format import load_adapter_dir
from loraplex.demo import DEMO_PROMPT
from loraplex.model.model_config import ModelConfig
from loraplex.registry.registry_config import DATABASE_URL_ENV
from tests.ui.ui_support import REPO, LiveServer, copy_adapter, go_to, upload_adapter

SOURCE = "robot"
TENANT = "zz-first-use"


def _engine_digest(server: LiveServer, folder: Path) -> str:
    """The digest the engine computes when it loads the adapter (loraplex.adapter_format)."""
    shape = ModelConfig.load(server.data_dir / "demo" / "model").shape
    return load_adapter_dir(folder, shape, max_rank=64).digest


def _cli(server: LiveServer, *args: str) -> str:
    """`loraplex ARGS` on the server's registry (another process beside the server)."""
    env = {k: v for k, v in os.environ.items() if k != DATABASE_URL_ENV}
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args, "--data-dir", str(server.data_dir)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=True).stdout


def _cli_digests(server: LiveServer, tenant: str) -> dict[str, str]:
    """`loraplex adapter list --tenant TENANT`: name -> the DIGEST column."""
    listing = _cli(server, "adapter", "list", "--tenant", tenant).splitlines()
    column = listing[0].split().index("DIGEST")
    return {row.split()[1]: row.split()[column] for row in listing[1:]}


def _is_clickable(page, locator) -> bool:
    """Whether the point a click on `locator` lands on belongs to it (no notice on top)."""
    return locator.evaluate("""element => {
        const box = element.getBoundingClientRect();
        const hit = document.elementFromPoint(box.left + box.width / 2, box.top + box.height / 2);
        return element.contains(hit);
    }""")


def test_one_identity_everywhere_and_the_engine_page_follows_deletions(admin_page, server: LiveServer,
                                                                       admin, tmp_path: Path):
    page = admin_page
    assert admin.post("/tenants", json={"name": TENANT}).status_code == 201  # not the first in the list
    key = admin.post("/keys", json={"tenant": TENANT}).json()["secret"]
    go_to(page, "Tenants")
    go_to(page, "Adapters")
    folder = copy_adapter(server.demo_adapters / SOURCE, tmp_path / "twin")
    page.get_by_label("Tenant", exact=True).first.select_option(TENANT)
    page.get_by_label("Adapter name").fill("twin")
    page.get_by_label("adapter_config.json").set_input_files(folder / "adapter_config.json")
    page.get_by_label("adapter_model.safetensors").set_input_files(folder / "adapter_model.safetensors")
    page.get_by_role("button", name="Upload adapter").click()
    notice = page.get_by_role("status").filter(has_text=f"Adapter {TENANT}/twin uploaded")
    expect(notice).to_be_visible()

    # The form is ready for the next adapter of the same tenant.
    expect(page.get_by_label("Adapter name")).to_have_value("")
    expect(page.get_by_label("Tenant", exact=True).first).to_have_value(TENANT)
    # The notice sits in the top bar, over nothing of the page: every Delete button stays
    # visible and clickable.
    top_bar, box = page.locator(".topbar").bounding_box(), notice.bounding_box()
    assert top_bar["y"] <= box["y"] and box["y"] + box["height"] <= top_bar["y"] + top_bar["height"], box
    deletes = page.locator("main").get_by_role("button", name="Delete")
    for i in range(deletes.count()):
        deletes.nth(i).scroll_into_view_if_needed()
        assert _is_clickable(page, deletes.nth(i)), deletes.nth(i).get_attribute("aria-label")

    # One identity: the engine's digest of the tensors, in the API, the UI and the CLI.
    digest = _engine_digest(server, folder)
    api = {(a["tenant"], a["name"]): a for a in admin.get("/adapters").json()}
    assert api[(TENANT, "twin")]["digest"] == api[("demo", SOURCE)]["digest"] == digest
    cell = page.locator(f'tr[data-key="{TENANT}/twin"] td[data-label="Digest"]')
    expect(cell).to_have_text(digest[:16])
    expect(cell.locator("code")).to_have_attribute(
        "title", f"{digest}: the adapter's identity, the sha256 of its tensors and their scaling: the same "
                 f"in the CLI (loraplex adapter list) and on the Engine page. Uploads of the same tensors "
                 f"share it, and one copy in the engine.")
    expect(page.locator("#digest-note")).to_contain_text("Digest: the adapter's identity, the sha256 of its "
                                                         "tensors")
    assert _cli_digests(server, TENANT)["twin"] == _cli_digests(server, "demo")[SOURCE] == digest[:16]

    # The engine page: one digest in a slot, named by all of its adapters (even one never used);
    # a name deleted through the UI or the CLI goes.
    upload_adapter(server, TENANT, "triplet", folder)
    for client, model in ((server.openai(server.demo_key), SOURCE), (server.openai(key), "twin")):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": DEMO_PROMPT}],
                                       max_tokens=2)
    go_to(page, "Engine")
    slot = page.locator(f'tr[data-key="{digest}"]')
    expect(slot.locator('td[data-label="Digest"]')).to_have_text(digest[:16])
    names = slot.locator('td[data-label="Adapters (tenant/name)"]')
    expect(names).to_contain_text(f"{TENANT}/twin")
    expect(names).to_contain_text(f"{TENANT}/triplet")
    expect(names).to_contain_text(f"demo/{SOURCE}")
    _cli(server, "adapter", "rm", "--tenant", TENANT, "triplet")
    expect(names).not_to_contain_text(f"{TENANT}/triplet")  # within the page's next refresh
    go_to(page, "Adapters")
    page.get_by_role("button", name=f"Delete adapter {TENANT}/twin").click()
    page.get_by_role("dialog").get_by_role("button", name="Delete adapter").click()
    expect(page.locator(f'tr[data-key="{TENANT}/twin"]')).to_have_count(0)
    go_to(page, "Engine")
    expect(names).to_contain_text(f"demo/{SOURCE}")
    expect(names).not_to_contain_text(f"{TENANT}/twin")


def test_what_does_not_act_yet_says_so(admin_page, server: LiveServer):
    page = admin_page
    expect(page.get_by_role("columnheader", name="On device")).to_be_visible()
    expect(page.get_by_text("On GPU")).to_have_count(0)
    go_to(page, "Tenants")
    expect(page.locator("#weights-note")).to_contain_text("a change applies from the engine's next step")
    page.get_by_role("button", name="Edit tenant demo").click()
    expect(page.get_by_role("dialog").get_by_text("Applies from the engine's next step")).to_be_visible()
    page.keyboard.press("Escape")
    go_to(page, "System prompts")
    expect(page.locator("#prompts-note")).to_contain_text("The engine computes its KV when it is added")
    go_to(page, "API keys")
    expect(page.locator("#last-used-note")).to_have_text(
        "Last used is recorded at most once a minute per key, so it can be up to a minute behind.")
