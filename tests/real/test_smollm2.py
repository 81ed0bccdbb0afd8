"""The engine on real weights, SmolLM2-135M-Instruct: the GGUF import gives what transformers'
own GGUF loader gives (weights to the bf16 bit, token ids), the model answers a question right,
and in float32 on CPU the engine is token-exact with transformers + PEFT on a batch that mixes
three random LoRA adapters and the base model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from loraplex import LLM, SamplingParams
from tests.factories import AdapterSpec, generate_with_logits, load_peft_adapters, make_adapter

MAX_TOKENS = 12
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me one tip for sleeping better.",
)
ADAPTERS = (
    AdapterSpec("qv4", ("q_proj", "v_proj"), rank=4, alpha=8),
    AdapterSpec("all8", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                rank=8, alpha=16, use_rslora=True),
    AdapterSpec("mlp16", ("gate_proj", "up_proj", "down_proj"), rank=16, alpha=16),
)
ADAPTER_CYCLE = (None, "qv4", "all8", "mlp16")


@pytest.fixture(scope="module")
def hf_model(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.folder)


def _chat_ids(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def test_import_matches_transformers_gguf_loader(smollm2, smollm2_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert smollm2.name == "Smollm2-135M-8k-Lc100K-Mix1-Ep2"  # the file's general.name
    reference = AutoModelForCausalLM.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name,
                                                     dtype=torch.float32).state_dict()
    ours = load_file(str(smollm2.folder / "model.safetensors"))
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    reference_tokenizer = AutoTokenizer.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name)
    tokenizer = AutoTokenizer.from_pretrained(smollm2.folder)
    texts = ["Hello world 12345, what's up?", "  spaces\n\nnew lines\ttabs", "Ünïcödé 日本語 😀",
             "def f(x):\n    return x**2  # 3.14159", "<|im_start|>user\nHi<|im_end|>\n"]
    for text in texts:
        assert tokenizer(text)["input_ids"] == reference_tokenizer(text)["input_ids"], text
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_the_base_model_answers(smollm2, tokenizer):
    llm = LLM(smollm2.folder, device="cpu", dtype="float32", max_model_len=512)
    reply = llm.generate(prompt_token_ids=[_chat_ids(tokenizer, QUESTIONS[0])],
                         sampling_params=SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert reply.text == "The capital of France is Paris.", reply.text
    assert reply.finish_reason == "stop"


def test_mixed_adapter_batch_is_token_exact_with_transformers_peft(smollm2, hf_model, tokenizer, tmp_path):
    adapters = {spec.name: make_adapter(hf_model, spec, tmp_path, seed=i + 1)
                for i, spec in enumerate(ADAPTERS)}
    prompts = [_chat_ids(tokenizer, question) for question in QUESTIONS]
    names = [ADAPTER_CYCLE[i % len(ADAPTER_CYCLE)] for i in range(len(prompts))]

    peft_model = load_peft_adapters(hf_model, adapters)
    references = []
    for prompt, name in zip(prompts, names):
        # generation stops at eos, as the engine's does (min_new_tokens would mask eos's logit)
        kwargs = dict(max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            if name is None:
                with peft_model.disable_adapter():
                    out = peft_model.generate(input_ids=torch.tensor([prompt]), **kwargs)
            else:
                peft_model.set_adapter(name)
                out = peft_model.generate(input_ids=torch.tensor([prompt]), **kwargs)
        references.append((out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()))

    llm = LLM(smollm2.folder, device="cpu", dtype="float32", max_model_len=512, max_num_batched_tokens=64)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outputs, logits = generate_with_logits(llm, prompts, names, params)
    distinct = set()
    for i, (output, ours, (tokens, ref)) in enumerate(zip(outputs, logits, references)):
        assert output.token_ids == tokens, f"request {i} ({names[i]})"
        assert output.finish_reason == ("stop" if tokens[-1] == tokenizer.eos_token_id else "length")
        error = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert error < 1e-4, f"request {i} ({names[i]}): logits differ by {error:.2e} relative"
        distinct.add(tuple(tokens))
    assert len(distinct) == len(outputs)  # the adapters change the answers
    assert any(output.finish_reason == "stop" for output in outputs)


def test_documents_are_found_in_a_templated_prompt_though_bpe_merged_their_edges(tokenizer):
    """SmolLM2's BPE merges a document's trailing space or newline with the newlines that follow
    it in the prompt: the server still finds each named document, less that token."""
    from types import SimpleNamespace

    from loraplex.server.documents import find_document, find_run, with_documents

    texts = ["Orders ship within two business days. ", "Returns are accepted for thirty days.\n",
             "Tracking numbers arrive by email."]
    records = tuple(SimpleNamespace(text=text) for text in texts)
    messages = with_documents([{"role": "user", "content": "When does my order ship?"}], records)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    start = 0
    for text in texts:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        span = find_document(prompt, tokens, start)
        assert span is not None, text
        merged = text[-1].isspace()
        assert (find_run(prompt, tokens, start) is None) == merged  # the edge merged: not found whole
        length = span[1] - span[0]
        assert length == len(tokens) - merged and prompt[span[0]:span[1]] == tokens[:length]
        start = span[1]
