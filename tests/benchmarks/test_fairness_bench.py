"""`loraplex bench fairness` on the CPU with a tiny model: every step is timed by itself
(LLMEngine.time_steps), so its figures by prompt tokens are the step's own, not those of the step
collected before it."""

from __future__ import annotations

import json

from loraplex.benchmarks import fairness
from loraplex.engine.plan import StepPlan

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 3000}


def test_each_step_is_timed_by_itself_and_bucketed_by_its_own_prompt_tokens():
    config = fairness.FairnessBenchConfig(
        light_rate=10.0, duration_s=2.0, drain_s=1.0, prompt_len=(64, 192), output_len=(16, 48),
        resume_tokens=64, num_kv_blocks=48, max_num_seqs=16, device="cpu", model=TINY, runs=("vtc",))
    result = fairness.run(config)
    run = result["runs"][fairness.RUNS["vtc"]]
    buckets = run["device_by_prompt_tokens"]
    assert buckets["0-0"]["steps"] > 0 and buckets["1-1024"]["steps"] > 0
    assert sum(b["steps"] for b in buckets.values()) <= run["steps"]  # (the steps that launched work)
    assert 0 < run["device_s"] <= run["elapsed_s"]
    assert round(sum(b["device_s"] for b in buckets.values()), 2) == run["device_s"]
    assert buckets["1-1024"]["mean_prompt_tokens"] >= 16 > buckets["0-0"]["mean_prompt_tokens"] == 0
    moved = [b for b in buckets.values() if b["steps_moving_kv"]]
    assert moved, "48 KV blocks for 16 running requests: the run swaps"
    assert all(b["mean_device_ms_moving_kv"] > 0 for b in moved)
    json.dumps(result)  # (the result file is JSON)


def test_time_steps_reports_each_collected_step_with_its_plan_until_turned_off():
    from loraplex.benchmarks import synthetic_server
    from loraplex.types import SamplingParams

    tiny_engine = synthetic_server.build_engine(synthetic_server.parse_args(
        ["--setup", "unused.json", "--device", "cpu", "--max-model-len", "128", "--model-overrides",
         json.dumps(TINY)]))
    timed: list[tuple[StepPlan, float]] = []
    tiny_engine.time_steps(lambda plan, device_s: timed.append((plan, device_s)))
    tiny_engine.add_request("a", prompt_token_ids=list(range(5, 25)), params=SamplingParams(max_tokens=3))
    steps = 0
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
        steps += 1
    assert len(timed) == steps == 3  # the prompt (and the first token), then two decodes
    assert [plan.num_tokens for plan, _ in timed] == [20, 1, 1] and all(s > 0 for _, s in timed)
    tiny_engine.time_steps(None)
    tiny_engine.add_request("b", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=2))
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
    tiny_engine.close()
    assert len(timed) == 3
