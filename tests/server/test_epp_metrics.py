"""The metrics the Gateway API Inference Extension's endpoint picker reads (its model-server
protocol, proposal 003), under vLLM's names and types: queue depth, running requests, KV cache
use, and `vllm:lora_requests_info` whose labels name the adapters (as requests name them) in
device slots and those that waiting requests ask for, and `max_lora` (the adapters resident
now: the device pool, not a fixed number of slots, bounds them)."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loraplex.server.metrics import EPP_METRICS, LORA_INFO_LABELS, LORA_INFO_METRIC
from tests.server.server_support import Server


def _families(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_the_endpoint_picker_finds_its_metrics(sqlite_server: Server) -> None:
    client = sqlite_server.openai("acme")
    client.completions.create(model="style", prompt="hello", max_tokens=2)
    families = _families(sqlite_server.url)
    for name, kind in EPP_METRICS.items():
        assert families[name].type == kind, name
        (sample,) = families[name].samples
        assert sample.name == name  # a gauge: no _total suffix to strip
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:gpu_cache_usage_perc"):
        assert 0 <= families[name].samples[0].value <= (1 if "perc" in name else 1e9)
    (info,) = families[LORA_INFO_METRIC].samples
    assert set(info.labels) == set(LORA_INFO_LABELS)
    engine = sqlite_server.http().get("/admin/api/engine").json()
    assert info.labels["max_lora"] == str(len(engine["adapters_resident"]))
    # In its slot, named as requests name it, not by its digest (other tests' adapters on this
    # shared server may be resident too).
    resident = info.labels["running_lora_adapters"].split(",")
    assert "style" in resident
    assert sqlite_server.registry.adapters.get("acme", "style").digest not in resident
    assert info.labels["waiting_lora_adapters"] == ""
    assert abs(info.value - time.time()) < 60  # a timestamp: the picker takes the latest


def test_waiting_adapters_are_listed(sqlite_server: Server) -> None:
    from loraplex.server.metrics import Metrics
    from loraplex.server.monitor import EngineMonitor

    # The label values as the collector builds them from an engine snapshot with requests
    # waiting for an adapter that is not in a slot.
    stats = _stats(adapters_in_slots=("d1",), waiting_by_adapter={"d2": 3, "d1": 1})
    monitor = EngineMonitor.__new__(EngineMonitor)
    monitor.latest = type("Snapshot", (), {"stats": stats, "sampled_wall": 1.5e9, "tokens_per_second": 0.0})()
    names = {"d1": ("style",), "d2": ("shared", "other")}
    metrics = Metrics("m", monitor, lambda: 0, lambda digest: names[digest])
    (info,) = next(f for f in text_string_to_metric_families(metrics.render().decode())
                   if f.name == LORA_INFO_METRIC).samples
    assert info.labels == {"running_lora_adapters": "style", "waiting_lora_adapters": "other,shared",
                           "max_lora": "1"}
    assert info.value == 1.5e9


def _stats(**fields):
    from loraplex.engine.stats import EngineStats

    base = dict(num_running=0, num_waiting=4, num_kv_blocks=10, num_kv_blocks_used=2, num_preemptions=0,
                num_lora_slots=4, adapters_in_slots=(), adapters_on_host=(), host_tier_bytes=0,
                max_host_tier_bytes=0, num_adapter_host_loads=0, num_adapter_slot_loads=0,
                num_generated_tokens=0, num_prompt_tokens=0, running_by_tenant={}, waiting_by_tenant={},
                running_by_adapter={}, waiting_by_adapter={}, swapped_by_tenant={}, tenant_service={},
                tenant_weights={}, preemptions={}, num_host_pool_blocks=0, num_host_pool_blocks_used=0,
                swap_bytes_out=0, swap_bytes_in=0, swap_seconds_out=0.0, swap_seconds_in=0.0,
                swap_seconds_stalled=0.0)
    return EngineStats(**(base | fields))
