"""loraplex's engine serves the demo: a mixed batch over the base model and every demo adapter
gives the greedy answers of transformers + PEFT."""

from __future__ import annotations

from loraplex import LLM, SamplingParams
from loraplex.demo import DEMO_ADAPTERS, DEMO_PROMPT
from loraplex.demo.answers import greedy_answer


def test_engine_matches_transformers_and_peft(demo_assets, demo_model):
    llm = LLM(str(demo_assets.model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    for name, folder in demo_assets.adapters.items():
        llm.add_adapter(name, str(folder))
    tokenizer = demo_model.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": DEMO_PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    names = [None, *(adapter.name for adapter in DEMO_ADAPTERS)]
    outputs = llm.generate(prompt_token_ids=[prompt_ids] * len(names),
                           sampling_params=SamplingParams(max_tokens=64, temperature=0.0),
                           adapters=names)
    for name, output in zip(names, outputs):
        assert output.finish_reason == "stop"
        assert output.text == greedy_answer(demo_model, DEMO_PROMPT, name), name
