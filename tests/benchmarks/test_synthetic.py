"""The GPU benchmarks' machinery, on a tiny model on CPU: the transformers + PEFT baseline sees
exactly our weights and adapters, and both benchmarks run end to end."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex import SamplingParams
from loraplex.benchmarks import accuracy, decode, prompt_logprobs, synthetic
from loraplex.benchmarks.results import write
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine_config import EngineConfig
from loraplex.kernels import select_ops

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 3000}


def test_transformers_peft_baseline_shares_our_weights_and_adapters():
    config = synthetic.model_config(TINY)
    cpu = torch.device("cpu")
    model = synthetic.random_model(config, select_ops(cpu), torch.float32, cpu, max_positions=64)
    adapters = {f"a{i}": synthetic.random_adapter(config, 4, torch.float32, cpu, str(i), seed=i, pin=False)
                for i in range(2)}
    prompt = [[11, 250, 37, 1999, 5, 77]] * 3
    names = [None, "a0", "a1"]
    engine = LLMEngine(EngineConfig(model="synthetic", device="cpu", max_model_len=64), model=model)
    for name, host in adapters.items():
        engine.add_adapter(name, host)
    ours = []
    for i, (tokens, name) in enumerate(zip(prompt, names)):
        engine.add_request(str(i), prompt_token_ids=tokens, adapter=name,
                           params=SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
    while engine.has_unfinished_requests():
        ours.extend(engine.step())
    ours.sort(key=lambda o: o.request_id)

    hf = synthetic.hf_model_sharing_weights(model)
    assert hf.model.layers[0].self_attn.k_proj.weight.data_ptr() > 0
    with torch.no_grad():
        base = torch.log_softmax(hf(torch.tensor(prompt[:1])).logits[0, -1].float(), -1)
        peft = synthetic.add_peft_adapters(hf, adapters, config)
        mixed = torch.log_softmax(peft(input_ids=torch.tensor(prompt), adapter_names=["__base__", "a0", "a1"]
                                       ).logits[:, -1].float(), -1)
    for i, output in enumerate(ours):
        expected = base if i == 0 else mixed[i]
        for token, logprob in output.logprobs[0].top.items():
            assert abs(expected[token].item() - logprob) < 1e-4
    assert ours[1].logprobs[0].top != ours[0].logprobs[0].top  # the adapters change the output


def test_decode_benchmark_runs_end_to_end(tmp_path):
    config = decode.DecodeBenchConfig(batch_sizes=(1, 2), prompt_len=8, new_tokens=4, rank=4,
                                      hf_batch_sizes=(2,), hf_new_tokens=3, device="cpu", dtype="float32",
                                      model=TINY)
    result = decode.run(config)
    engines = [(r["engine"], r["batch"], r["adapters"]) for r in result["rows"]]
    assert engines == [("loraplex", 1, 0), ("loraplex", 1, 1), ("loraplex", 2, 0), ("loraplex", 2, 2),
                       ("transformers", 2, 0), ("transformers+peft", 2, 2)]
    assert all(r["floor_tok_s"] > r["tok_s"] > 0 for r in result["rows"]), [
        (r["engine"], r["batch"], r["tok_s"], r["floor_tok_s"]) for r in result["rows"]]
    floors = result["device_floors"]  # measured on this machine, not an H100's constants
    assert floors["device"] == "cpu" and floors["copy_bytes_per_s"] > 0 and floors["matmul_flops_per_s"] > 0
    for r in result["rows"]:
        assert r["floor_step_ms"] == max(r["bytes_floor_ms"], r["flops_floor_ms"])
        assert r["floor_binding"] == ("bytes" if r["bytes_floor_ms"] >= r["flops_floor_ms"] else "flops")
    path = write(result, tmp_path)
    assert json.loads(path.read_text())["rows"] == result["rows"]


def test_accuracy_check_runs_end_to_end():
    config = accuracy.AccuracyConfig(num_requests=3, prompt_len=6, new_tokens=4, rank=4, device="cpu",
                                     model=TINY)
    result = accuracy.run(config)
    assert result["positions"] == 12 and result["transformers_peft_bf16"]["positions"] == 12
    assert result["identical_greedy_fraction"] >= 0.5
    assert 0 < result["logits_rel_error_max"] < 0.05


def test_prompt_logprobs_benchmark_runs_end_to_end(tmp_path):
    import argparse

    from loraplex.benchmarks.cli import add_benchmarks

    parser = argparse.ArgumentParser()
    add_benchmarks(parser)
    args = parser.parse_args([
        "prompt-logprobs", "--num-prompts", "12", "--prompt-len", "48", "--device", "cpu",
        "--max-num-batched-tokens", "128", "--model-overrides", json.dumps(TINY), "--out", str(tmp_path)])
    args.run(args)
    result = json.loads((tmp_path / f"prompt-logprobs-{_device_file_name()}.json").read_text())
    rows = result["rows"]
    assert set(rows) == set(prompt_logprobs.modes(1)) and rows["score"]["scored_tokens"] == 12 * 47
    assert all(row["prompt_tok_s"] > 0 for row in rows.values())
    ratio = rows["score"]["prompt_tok_s"] / rows["prefill"]["prompt_tok_s"]
    assert result["ratio_to_prefill"] == round(ratio, 3)


def _device_file_name() -> str:
    return decode._device_name(torch.device("cpu")).replace(" ", "-").replace("/", "-").lower()


def test_a_floor_is_the_longer_of_the_bytes_and_the_flops() -> None:
    from loraplex.benchmarks.device_floors import DeviceFloors

    floors = DeviceFloors("x", copy_bytes_per_s=2e12, matmul_flops_per_s=1e15, dtype="bfloat16")
    bytes_bound = floors.floor(num_bytes=4e9, flops=1e12)  # 2 ms of bytes, 1 ms of FLOPs
    assert bytes_bound["binding"] == "bytes" and bytes_bound["floor_s"] == pytest.approx(2e-3)
    flops_bound = floors.floor(num_bytes=1e9, flops=3e12)  # 0.5 ms of bytes, 3 ms of FLOPs
    assert flops_bound["binding"] == "flops" and flops_bound["floor_s"] == pytest.approx(3e-3)
    assert floors.as_dict()["copy_tb_per_s"] == 2.0
