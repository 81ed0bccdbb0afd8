"""`loraplex bench kernels --paged` runs on the CPU (tiny, under the Triton interpreter) and writes
its JSON naming the device, one row a family: the paged-vs-slots comparison the GPU runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_paged_vs_slots_comparison_runs_tiny_on_the_cpu(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "loraplex.benchmarks", "kernels", "--paged", "--tiny",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "kernels-paged-cpu.json").read_text())
    assert result["device"] == "cpu" and result["interpreted"]
    rows = {row["family"]: row for row in result["results"]}
    assert set(rows) == {"lora", "dora", "ia3", "flora"}
    assert all(row["slots_us"] > 0 and row["paged_us"] > 0 for row in rows.values())
    assert all(row["max_relative_difference"] < 1e-5 for row in rows.values())  # the same work
    assert result["llama3_8b_pool_pages_per_adapter"]["paged_by_rank"] == {"8": 20, "16": 40, "64": 161}
    assert "ratio" in done.stdout
