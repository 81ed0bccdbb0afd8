"""`loraplex bench accuracy --model` and `bench decode --model` on the quick start's real model
and trained adapters, small enough for CPU: the GPU runs (scripts/gpu-real-model.sh) take the same
path at 64 prompts x 128 tokens and batches up to 256."""

from __future__ import annotations

from loraplex.benchmarks import accuracy, decode


def test_accuracy_on_the_real_model_compares_every_adapter_and_the_base(quickstart):
    config = accuracy.AccuracyConfig(
        num_requests=4, new_tokens=3, device="cpu", model_path=str(quickstart.model_dir),
        adapters={name: str(folder) for name, folder in quickstart.adapters.items()})
    result = accuracy.run(config)
    assert result["positions"] == 12 and result["transformers_peft_bf16"]["positions"] == 12
    assert set(result["by_adapter"]) == {"base", "pirate", "extract", "sentiment"}
    assert all(v["loraplex_bf16"]["positions"] == 3 for v in result["by_adapter"].values())
    # The float32 reference is transformers + PEFT's float32 on the same weights, adapters, tokens.
    fp32 = result["transformers_peft_float32"]
    assert fp32["identical_greedy_fraction"] == 1.0 and fp32["logits_rel_error_max"] < 1e-4
    assert result["identical_greedy_fraction"] >= 0.5
    assert 0 < result["chosen_logprob_abs_error_max"] < 1
    base, pirate = result["sample_replies"][:2]
    assert (base["adapter"], pirate["adapter"]) == (None, "pirate") and base["prompt"] == pirate["prompt"]
    assert base["reply"] != pirate["reply"]  # the adapter is applied


def test_decode_on_the_real_model_reads_its_weights(quickstart):
    config = decode.DecodeBenchConfig(
        batch_sizes=(1,), prompt_len=8, new_tokens=3, rank=4, hf_batch_sizes=(1,), hf_new_tokens=3,
        startup_batch=1, device="cpu", dtype="float32", model_path=str(quickstart.model_dir))
    result = decode.run(config)
    engines = [(r["engine"], r["batch"], r["adapters"]) for r in result["rows"]]
    assert engines == [("loraplex", 1, 0), ("loraplex", 1, 1), ("transformers", 1, 0),
                       ("transformers+peft", 1, 1)]
    # SmolLM2-135M's shape (from the folder's config.json): 30 layers of q, k, v, o and the MLP
    # in float32 (the norms and the tied embedding aside).
    hidden, kv, intermediate, layers = 576, 192, 1536, 30
    projections = layers * (hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * intermediate)
    assert abs(result["weight_bytes"] / (4 * projections) - 1) < 1e-3
