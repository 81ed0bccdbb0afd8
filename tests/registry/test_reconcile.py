"""Crash consistency: orphan blobs and temporary files are removed on reconcile(), missing
blobs reported, and an upload killed with SIGKILL (while streaming, or after renaming its blobs
but before committing its row) leaves a registry that reconcile() makes consistent; the same
upload then succeeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.numpy import save_file

from loraplex.adapter_format import BaseModelShape
from loraplex.registry import Registry, RegistryConfig
from tests.registry.registry_support import (
    adapter_config,
    adapter_tensors,
    registry_state,
    write_adapter,
)

BIG = BaseModelShape(num_layers=8, hidden_size=1024, intermediate_size=2048, num_heads=8,
                     num_kv_heads=8, head_dim=128)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
UPLOADER = """
import sys, time
from pathlib import Path
from loraplex.registry import Registry, RegistryConfig

data_dir, url, config_path, weights_path, mode = sys.argv[1:]
with Registry.open(RegistryConfig(data_dir=Path(data_dir), database_url=url)) as registry:
    if mode == "after-publish":
        publish = registry.blobs.publish
        def publish_then_hang(staged):
            path = publish(staged)
            if staged.size > 1 << 20:
                print("published", flush=True)
                time.sleep(600)
            return path
        registry.blobs.publish = publish_then_hang
        weights = Path(weights_path)
    else:
        weights = sys.stdin.buffer
    registry.adapters.upload("acme", "big", Path(config_path).read_bytes(), weights)
"""


def test_reconcile_removes_orphans_and_reports_missing_blobs(registry: Registry,
                                                             tmp_path: Path) -> None:
    kept = registry.adapters.upload_dir("acme", "kept", write_adapter(tmp_path / "a"))
    lost = registry.adapters.upload_dir("acme", "lost", write_adapter(
        tmp_path / "b", tensors=adapter_tensors(seed=9)))
    orphan = registry.blobs.publish(registry.blobs.stage(b"renamed, never committed", 100, "x"))
    temp = registry.blobs.stage(b"half an upload", 100, "x").path
    os.utime(temp, (0, 0))  # written long ago by a process that may be elsewhere
    lost.weights_path.unlink()
    report = registry.reconcile()
    assert report.removed_blobs == (orphan.name,)
    assert report.removed_temp_files == (temp,)
    assert [(m.adapter, m.digest) for m in report.missing_blobs] == [("lost",
                                                                      lost.weights_sha256)]
    assert not report.is_consistent
    assert not orphan.exists() and not temp.exists()
    assert kept.weights_path.is_file() and kept.config_path.is_file()
    assert lost.config_path.is_file()  # shared with `kept`: same config bytes
    registry.adapters.delete("acme", "lost")
    assert registry.reconcile().is_consistent


def _big_adapter(folder: Path) -> tuple[Path, Path]:
    folder.mkdir()
    config = folder / "adapter_config.json"
    config.write_text(json.dumps(adapter_config(r=8, target_modules=list(MODULES))))
    weights = folder / "adapter_model.safetensors"
    save_file(adapter_tensors(BIG, rank=8, modules=MODULES), str(weights))
    return config, weights


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the uploader did not get there in time")
        time.sleep(0.02)


@pytest.mark.parametrize("mode", ["streaming", "after-publish"])
def test_upload_killed_with_sigkill_is_reconciled(
    registry: Registry, registry_config: RegistryConfig, tmp_path: Path, mode: str
) -> None:
    registry.models.set("big-llama", BIG, 8)
    config, weights = _big_adapter(tmp_path / "big")
    data = weights.read_bytes()
    assert len(data) > 4 << 20
    before = registry_state(registry)
    process = subprocess.Popen(
        [sys.executable, "-c", UPLOADER, str(registry_config.data_dir), registry_config.url,
         str(config), str(weights), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    try:
        if mode == "streaming":
            process.stdin.write(data[: len(data) * 3 // 4])
            process.stdin.flush()
            temps = registry.blobs.temp_dir
            _wait_for(lambda: any(p.stat().st_size >= 2 << 20 for p in temps.iterdir()))
        else:
            assert process.stdout.readline() == b"published\n"
            assert len(list(registry.blobs.digests())) == 2  # renamed, row not committed
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        process.kill()
        process.wait()
    assert registry.adapters.list() == ()
    report = registry.reconcile()
    assert report.is_consistent
    assert len(report.removed_temp_files if mode == "streaming" else report.removed_blobs) == 2
    assert registry_state(registry) == before
    record = registry.adapters.upload("acme", "big", config.read_bytes(), weights)
    assert record.weights_path.read_bytes() == data
    assert registry.reconcile() == type(report)((), (), ())
