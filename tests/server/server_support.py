"""What the server tests share: a tiny random Llama (the registry tests' base shape, so their
adapter builders fit) with a byte-level tokenizer and a chat template, and a real uvicorn
server on a free loopback port, in a thread of the test process, over a real registry."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

from loraplex.adapter_format import BaseModelShape
from loraplex.engine.core_client import EngineCoreClient
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine_config import EngineConfig
from loraplex.registry import Registry, RegistryConfig
from loraplex.server import ServerConfig, create_app
from tests.registry.registry_support import MAX_RANK, TINY

MODEL_ID = "tiny-llama"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_model(folder: Path, shape: BaseModelShape = TINY, seed: int = 0, vocab_size: int = 300,
               max_positions: int = 512) -> Path:
    """A random Llama of `shape` saved with a byte-level tokenizer and a chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.factories import hf_config, save_byte_tokenizer

    config = hf_config("llama", hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                       num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                       vocab_size=vocab_size, max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    save_byte_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def make_engine(model_dir: Path, **options: Any) -> LLMEngine:
    return LLMEngine(engine_config(model_dir, **options))


def engine_config(model_dir: Path, **options: Any) -> EngineConfig:
    """The server tests' engine settings (make_engine's)."""
    defaults = dict(device="cpu", block_size=16, num_kv_blocks=1024, max_num_seqs=64,
                    max_lora_rank=MAX_RANK, max_loras=4, max_model_len=512)
    return EngineConfig.from_kwargs(str(model_dir), **(defaults | options))


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def run_uvicorn(app: Any, **options: Any) -> Iterator[str]:
    """Serve `app` with uvicorn (`options` for its Config) in a thread on a free loopback port;
    yields the base URL."""
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, **({"log_level": "warning", "timeout_graceful_shutdown": 5}
                                                   | options)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@dataclass
class Server:
    """A running server and its registry, with an admin key and tenant keys."""

    url: str
    registry: Registry
    admin_key: str
    keys: dict[str, str]
    """Tenant name -> a key of that tenant."""

    def openai(self, tenant: str | None = None, *, key: str | None = None, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.keys[tenant or "acme"],
                             max_retries=0, **options)

    def http(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60,
                            headers={"Authorization": f"Bearer {key or self.admin_key}"})

    def metric(self, name: str, **labels: str) -> float:
        """The value of the sample `name` from /metrics whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return sample.value
        raise KeyError(name)


@contextlib.contextmanager
def serve(registry_config: RegistryConfig, engine: LLMEngine | EngineCoreClient, *,
          tenants: tuple[str, ...] = ("acme",), **server_options: Any) -> Iterator[Server]:
    """Open the registry, record the served model, create tenants with keys and an admin key,
    and run the app under uvicorn (an EngineCoreClient is stopped when the app stops)."""
    facts = engine.view if isinstance(engine, EngineCoreClient) else engine
    with Registry.open(registry_config) as registry:
        registry.models.set(MODEL_ID, facts.model_config.shape, facts.config.lora.max_lora_rank)
        keys = {}
        for tenant in tenants:
            registry.tenants.create(tenant)
            keys[tenant] = registry.keys.create(tenant=tenant).secret
        admin_key = registry.keys.create(admin=True).secret
        config = ServerConfig(**({"model_id": MODEL_ID, "registry_cache_ttl_s": 0.2,
                                  "engine_poll_interval_s": 0.2} | server_options))
        with run_uvicorn(create_app(config, registry, engine)) as url:
            yield Server(url, registry, admin_key, keys)


def upload_files(folder: Path) -> dict[str, tuple[str, bytes]]:
    """The multipart files of a PEFT folder, as httpx takes them."""
    files = {}
    for path in sorted(folder.iterdir()):
        field = "adapter_config" if path.name == "adapter_config.json" else "adapter_model"
        files[field] = (path.name, path.read_bytes())
    return files


def replace_config(folder: Path, **changes: Any) -> Path:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return folder

