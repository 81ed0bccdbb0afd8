"""Adapters of every family upload through the admin API as their trainers saved them.

(Its own module: the upload tests' server lives for their whole module, and one engine serves
one server at a time.)"""

from __future__ import annotations

from pathlib import Path

from tests.server.server_support import Server, upload_files


def test_peft_dora_and_ia3_folders_and_a_trained_flora_folder_upload_as_they_are(
        sqlite_server: Server, model_dir: Path, tmp_path: Path) -> None:
    """PEFT's own saved DoRA and IA3 folders and a FLoRA folder saved by the demo trainer upload
    unchanged, are listed with their family, and serve completions at once."""
    import torch
    from transformers import AutoModelForCausalLM

    from loraplex.demo.flora import save_flora, train_flora
    from tests.factories import ATTENTION, make_dora_adapter, make_ia3_adapter

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    flora, _ = train_flora(hf, [{"input_ids": ids, "labels": ids}], rank=2, target_modules=ATTENTION,
                           num_epochs=2, lr=1e-2)
    folders = {
        "dora": make_dora_adapter(hf, tmp_path / "dora", ("q_proj", "v_proj", "down_proj"), rank=4, alpha=8),
        "ia3": make_ia3_adapter(hf, tmp_path / "ia3", ("k_proj", "v_proj", "down_proj"), ("down_proj",)),
        "flora": save_flora(flora, tmp_path / "flora"),
    }
    client = sqlite_server.openai("acme")
    with sqlite_server.http() as http:
        for family, folder in folders.items():
            response = http.post("/admin/api/adapters", data={"tenant": "acme", "name": family},
                                 files=upload_files(folder))
            assert response.status_code == 201, response.text
            adapter = response.json()
            assert (adapter["family"], adapter["rank"]) == (family, {"dora": 4, "ia3": 0, "flora": 2}[family])
        listed = {a["name"]: a["family"]
                  for a in http.get("/admin/api/adapters", params={"tenant": "acme"}).json()}
        assert {name: listed[name] for name in folders} == {"dora": "dora", "ia3": "ia3", "flora": "flora"}
    for family in folders:
        # (ignore_eos: an unseeded draw from the tiny random model may end at EOS before 3 tokens)
        completion = client.completions.create(model=family, prompt="x", max_tokens=3,
                                               extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 3
