"""`loraplex bench tensor-parallel` on CPU (gloo, float32, a tiny model): it runs TP=1 and TP=2,
times the collectives of a step, and writes its JSON with the ratios the issue's goals are about."""

from __future__ import annotations

import json

from loraplex.benchmarks import tensor_parallel

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}


def test_the_benchmark_runs_on_cpu(tmp_path, reuse_tp2_workers):
    tensor_parallel.main(["--device", "cpu", "--dtype", "float32", "--batch-sizes", "1,3",
                          "--prompt-len", "8", "--new-tokens", "3", "--rank", "4",
                          "--model", json.dumps(TINY), "--out", str(tmp_path)])
    (path,) = tmp_path.glob("tensor-parallel-*.json")
    result = json.loads(path.read_text())
    assert {(r["tensor_parallel_size"], r["batch"], r["adapters"]) for r in result["rows"]} == {
        (size, batch, adapters) for size in (1, 2) for batch in (1, 3) for adapters in (0, batch)}
    summary = result["summary"]["tp2"]
    assert summary["batch1_step_ratio"] > 0 and summary["batch3_throughput_ratio"] > 0
    assert set(summary["collective_ms_per_step"]) == {"1", "3"}
    (collective, _) = result["collectives"]
    assert collective["all_reduces_per_step"] == 2 * TINY["num_hidden_layers"] + 1
    assert len(result["devices"]) == 2 and result["goals"] == tensor_parallel.GOALS
