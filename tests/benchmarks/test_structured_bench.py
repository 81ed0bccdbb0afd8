"""`loraplex bench structured` on a tiny model on the CPU: both runs complete with every request
decoding through the timed steps, the constrained run builds masks at each of them, and the result
records the device, its measured floors and the commit; without xgrammar it says so and stops."""

from __future__ import annotations

import json

from loraplex.benchmarks import structured

TINY = json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000})


def test_structured_benchmark_runs_tiny_on_cpu(tmp_path) -> None:
    status = structured.main([
        "--device", "cpu", "--dtype", "float32", "--model-overrides", TINY, "--batch", "8",
        "--num-schemas", "2", "--prompt-len", "8", "--steps", "3", "--warm-up-steps", "1",
        "--repeats", "1", "--num-adapters", "2", "--rank", "4", "--out", str(tmp_path)])
    assert status == 0
    (path,) = tmp_path.glob("structured-*.json")
    result = json.loads(path.read_text())
    assert result["device"].startswith("cpu") and result["commit"]
    assert result["floors"]["copy_bytes_per_s"] > 0
    plain, masked = result["unconstrained"], result["constrained"]
    for run in (plain, masked):
        assert run["steps"] == 3 and run["min_running"] == 8 and run["step_ms"] > 0
    assert plain["mask_fill_calls"] == 0 and masked["mask_fill_calls"] == 3
    assert plain["masked_draw_ms_per_step"] == 0 < masked["masked_draw_ms_per_step"]
    assert result["num_schemas"] == 2 and result["constrained_over_unconstrained"] > 0


def test_structured_schemas_are_distinct_and_long():
    schemas = structured.schemas(8)
    assert len({json.dumps(s) for s in schemas}) == 8
    assert all(s["properties"]["tags"]["minItems"] >= 40 for s in schemas)


def test_without_xgrammar_the_benchmark_says_so(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(structured.importlib.util, "find_spec", lambda name: None)
    assert structured.main(["--out", str(tmp_path)]) == 2
    assert "xgrammar is not installed" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
