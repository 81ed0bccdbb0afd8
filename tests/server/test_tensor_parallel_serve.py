"""`loraplex serve --tensor-parallel-size 2` as operators run it (a process of its own, two
gloo worker processes beside it, CPU, float32) answers through the HTTP API, with the official
client, exactly as the same server at 1 does: completions and chat, streamed and not, from the
base model and from adapters uploaded while it serves. The engine's token-exactness under TP is
tests/parallel's; this checks the server drives it."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from loraplex.registry import Registry, RegistryConfig
from tests.registry.registry_support import MODEL_ID, adapter_config, adapter_tensors, write_adapter
from tests.server.server_support import make_model, upload_files
from tests.server.test_serve_cli import loraplex_serve

ADAPTERS = {"qv": ("q_proj", "v_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tp-serve") / "model")  # 4 heads, 2 KV heads


def _answers(data_dir: Path, model: Path, tensor_parallel_size: int) -> dict[str, str]:
    folders = {name: write_adapter(data_dir.parent / f"adapter-{name}",
                                   adapter_config(r=4, target_modules=list(modules)),
                                   adapter_tensors(rank=4, modules=modules, seed=i))
               for i, (name, modules) in enumerate(ADAPTERS.items())}
    with loraplex_serve(data_dir, "--model", str(model), "--model-name", MODEL_ID, "--enforce-eager",
                        "--dtype", "float32", "--max-num-seqs", "8", "--max-lora-rank", "8",
                        "--tensor-parallel-size", str(tensor_parallel_size)) as served:
        with Registry.open(RegistryConfig(data_dir=data_dir), migrate=False) as registry:
            admin_key = registry.keys.create(admin=True).secret
        with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {admin_key}"},
                          timeout=60) as http:
            assert http.post("/admin/api/tenants", json={"name": "acme"}).status_code == 201
            key = http.post("/admin/api/keys", json={"tenant": "acme"}).json()["secret"]
            for name, folder in folders.items():
                response = http.post("/admin/api/adapters", data={"tenant": "acme", "name": name},
                                     files=upload_files(folder))
                assert response.status_code == 201, response.text
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
        answers = {}
        for name in (MODEL_ID, *ADAPTERS):
            answers[f"{name} completion"] = client.completions.create(
                model=name, prompt="Tensor parallel", max_tokens=6, temperature=0).choices[0].text
            answers[f"{name} chat"] = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6,
                temperature=0).choices[0].message.content
        stream = client.completions.create(model="qv", prompt="Streamed", max_tokens=6, temperature=0,
                                           stream=True)
        answers["qv stream"] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert "Traceback" not in served.output()
    return answers


def test_a_tensor_parallel_server_answers_as_one_process_does(tmp_path: Path, model: Path) -> None:
    want = _answers(tmp_path / "tp1" / "data", model, 1)
    got = _answers(tmp_path / "tp2" / "data", model, 2)
    assert got == want
    assert any(want.values())  # the tiny model says something
