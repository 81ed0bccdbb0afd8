"""`loraplex bench relay` and `relay-offline` on a tiny model on the CPU: the runs complete, and
the figures that do not depend on the machine (prompt tokens computed, KV blocks held) say what
sharing should make them say."""

from __future__ import annotations

import json

from loraplex.benchmarks import relay, relay_offline

TINY = json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000})
CPU = ["--device", "cpu", "--dtype", "float32", "--rank", "4", "--model-overrides", TINY]


def _result(out, name: str) -> dict:
    (path,) = out.glob(f"{name}-*.json")
    return json.loads(path.read_text())


def test_offline_grouping_computes_each_prefix_once_and_holds_fewer_blocks(tmp_path) -> None:
    relay_offline.main(["--num-prompts", "48", "--num-groups", "4", "--prefix-len", "64", "--own-len", "8",
                        "--new-tokens", "4", "--max-num-seqs", "12", "--out", str(tmp_path), *CPU])
    result = _result(tmp_path, "relay-offline")
    rows = {row["way"]: row for row in result["rows"]}
    assert set(rows) == set(relay_offline.WAYS)
    assert rows["none"]["prompt_tokens_computed"] == rows["none"]["prompt_tokens"] == 48 * (64 + 8)
    assert rows["grouped"]["prompt_tokens_computed"] == 4 * 64 + 48 * 8  # each prefix once
    # Each way starts from a cold cache: the in-order way computes every prefix at least once too.
    assert rows["cache"]["prompt_tokens_computed"] >= rows["grouped"]["prompt_tokens_computed"]
    # Twelve running requests: one or two groups' prefixes grouped, all four in the batch's order.
    peaks = [rows[way]["peak_kv_blocks"] for way in ("grouped", "cache", "none")]
    assert peaks == sorted(set(peaks))  # strictly fewer blocks, way by way
    assert result["ratios"]["grouped_over_none"]["peak_kv_blocks"] < 1


def test_relay_benchmark_runs_its_three_modes(tmp_path) -> None:
    relay.main(["--batches", "8", "--system-lens", "64", "--own-len", "8", "--new-tokens", "4",
                "--out", str(tmp_path), *CPU])
    result = _result(tmp_path, "relay")
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == set(relay.MODES)
    # Pinned prompts: 4 of 4 blocks each held once; without sharing, 8 requests hold 5 each.
    assert rows["relay"]["peak_kv_blocks"] < rows["none"]["peak_kv_blocks"]
    assert rows["none"]["peak_kv_blocks"] >= 8 * 5
    (join,) = result["join_warm"]
    assert join["warm_ttft_ms"] > 0 and join["cold_ttft_ms"] > 0
