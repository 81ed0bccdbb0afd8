"""All four adapter families in one batch, float32 on CPU: base requests, LoRA, DoRA, IA3 and
FLoRA adapters (ranks 1 to 16, attention-only and all seven modules) each give exactly the
greedy tokens that transformers + PEFT (LoRA, DoRA, IA3) or the explicit W0 * (B A) reference
(FLoRA) give the request alone, with logits within 1e-4 relative. Llama (no biases) and Qwen2
(q/k/v biases, which DoRA must leave unscaled and IA3 scales)."""

from __future__ import annotations

import copy

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.demo.flora import merge_flora
from loraplex.engine.step_inputs import FLORA_ROW_BUCKETS
from tests.engine.test_hf_parity import _run as _run_recording_logits
from tests.factories import (
    ALL_SEVEN,
    ATTENTION,
    AdapterSpec,
    make_adapter,
    make_dora_adapter,
    make_flora_adapter,
    make_hf_model,
    make_ia3_adapter,
)

MAX_TOKENS = 6
PROMPT_LENGTHS = (5, 1, 17, 9, 3, 12, 7, 20, 2, 11, 6)
NAMES = (None, "lora16", "dora1-attn", "dora16-all", "ia3-attn", "ia3-all", "flora1-attn",
         "flora4-all", "flora16-attn", "lora2", None)


def _make_adapters(hf, folder):
    return {
        "lora16": make_adapter(hf, AdapterSpec("lora16", ALL_SEVEN, rank=16, alpha=16), folder, seed=1),
        "lora2": make_adapter(hf, AdapterSpec("lora2", ("q_proj", "v_proj"), rank=2, alpha=4), folder,
                              seed=2),
        "dora1-attn": make_dora_adapter(hf, folder / "dora1-attn", ATTENTION, rank=1, alpha=2, seed=3),
        "dora16-all": make_dora_adapter(hf, folder / "dora16-all", ALL_SEVEN, rank=16, alpha=32, seed=4),
        "ia3-attn": make_ia3_adapter(hf, folder / "ia3-attn", ("k_proj", "v_proj", "o_proj"),
                                     feedforward=("o_proj",), seed=5),
        "ia3-all": make_ia3_adapter(hf, folder / "ia3-all", ALL_SEVEN, feedforward=("down_proj",), seed=6),
        # PEFT's default for Llama: the fused kernels apply it all (no shrink or expand).
        "ia3-default": make_ia3_adapter(hf, folder / "ia3-default", ("k_proj", "v_proj", "down_proj"),
                                        feedforward=("down_proj",), seed=12),
        "flora1-attn": make_flora_adapter(hf, folder / "flora1-attn", ATTENTION, rank=1, seed=7),
        "flora4-all": make_flora_adapter(hf, folder / "flora4-all", ALL_SEVEN, rank=4, seed=8),
        "flora16-attn": make_flora_adapter(hf, folder / "flora16-attn", ATTENTION, rank=16, seed=9),
    }


def _reference(hf, adapters, name, prompt):
    """(greedy tokens, logits [MAX_TOKENS, vocab]) of one request alone."""
    from peft import PeftModel

    if name is None:
        model = hf
    elif name.startswith("flora"):
        model = merge_flora(hf, adapters[name])
    else:
        model = PeftModel.from_pretrained(copy.deepcopy(hf), adapters[name]).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, folder / "model")
    adapters = _make_adapters(hf, folder / "adapters")
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    references = [_reference(hf, adapters, name, prompt) for name, prompt in zip(NAMES, prompts)]
    return folder / "model", adapters, prompts, references


def _run(model_dir, adapters, prompts, **options):
    return _run_recording_logits(model_dir, adapters, prompts, list(NAMES), max_tokens=MAX_TOKENS, **options)


def _check(outputs, logits, references):
    _check_named(NAMES, outputs, logits, references)


def _check_named(names, outputs, logits, references):
    for name, output, ours, (tokens, ref) in zip(names, outputs, logits, references):
        assert output.token_ids == tokens, f"request with adapter {name}"
        error = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert error < 1e-4, f"adapter {name}: logits differ by {error:.2e} relative"


def test_each_adapter_changes_the_output(case):
    """Each reference differs from the base model's logits on the same prompt (or the parity
    test below could pass on a family the engine ignores)."""
    model_dir, _, prompts, references = case
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, prompt, (_, ref) in zip(NAMES, prompts, references):
        if name is None:
            continue
        with torch.no_grad():
            base = hf(torch.tensor([prompt])).logits[0, -1].float()
        assert (ref[0] - base).abs().max() > 1e-2, name


@pytest.mark.parametrize("chunk", [16, 512])
def test_mixed_families_match_each_request_alone(case, chunk):
    model_dir, adapters, prompts, references = case
    llm, outputs, logits = _run(model_dir, adapters, prompts, max_num_batched_tokens=chunk,
                                max_num_seqs=16, block_size=4)
    _check(outputs, logits, references)
    families = {llm.engine.lora.slot_family[slot] for slot in range(1, llm.engine.lora.num_slots + 1)}
    assert families >= {"lora", "dora", "ia3", "flora"}


def test_few_slots_reload_families(case):
    """Three slots for nine adapters: a slot holds a FLoRA adapter, then a DoRA one, ... and
    what a slot held before never leaks into the next (scales, FLoRA ranks, input vectors)."""
    model_dir, adapters, prompts, references = case
    _, outputs, logits = _run(model_dir, adapters, prompts, max_loras=3, max_num_batched_tokens=16)
    _check(outputs, logits, references)


IA3_FLORA = (None, "ia3-default", "flora1-attn", "flora4-all", "flora16-attn", "ia3-default", None)
"""A batch that needs no LoRA shrink or expand (IA3 as PEFT's default, FLoRA)."""


def _references_for(model_dir, adapters, names, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [_reference(hf, adapters, name, prompt) for name, prompt in zip(names, prompts)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("families", ["all", "ia3-flora"])
def test_mixed_families_on_the_gpu_kernels(case, families):
    """The same batch through the Triton kernels (float32 on CUDA, decode graphs, FLoRA's rows
    padded in them; IA3 in the rotary and activation kernels): the same greedy tokens as each
    request alone."""
    model_dir, adapters, prompts, references = case
    names = list(NAMES)
    if families == "ia3-flora":
        names, prompts = list(IA3_FLORA), prompts[:len(IA3_FLORA)]
        references = _references_for(model_dir, adapters, names, prompts)
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=16, max_num_batched_tokens=64,
              flora_graphs=True)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, adapters=names)
    for name, output, (tokens, _) in zip(names, outputs, references):
        assert output.token_ids == tokens, f"request with adapter {name}"
    graphs = llm.engine.runner.graphs
    assert any(key[5] for key in graphs._graphs), "no FLoRA graph was captured"


@pytest.mark.parametrize("families", ["all", "ia3-flora"])
@pytest.mark.parametrize("layout", ["by-size", "per-slice"])
def test_padded_decode_path_with_families(case, families, layout, monkeypatch):
    """The decode steps the CUDA graphs replay, run eagerly on CPU at padded batch sizes: FLoRA
    rows padded to a graph's count (padding rows inert), and batches of IA3 and FLoRA alone
    skipping the LoRA shrink and expand, give the same tokens and logits as each request alone;
    FLoRA's products fused or per slice as the row count picks (these steps: fused), or every
    fused group per slice."""
    from loraplex.engine.cuda_graphs import DecodeGraphs
    from loraplex.model import llama

    if layout == "per-slice":
        monkeypatch.setattr(llama, "FLORA_FUSED_MAX_ROWS", 0)
    model_dir, adapters, prompts, references = case
    if families == "all":
        names, prompts = list(NAMES), prompts
    else:
        names, prompts = list(IA3_FLORA), prompts[:len(IA3_FLORA)]
        references = _references_for(model_dir, adapters, names, prompts)
    llm = LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=16, block_size=4)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, max_batch=16, vocab_size=runner.model.config.vocab_size,
                                 capture=False)
    shapes, logits, original = [], {}, runner.forward

    def forward(shape, prompt=None):
        if shape.is_padded_decode:
            shapes.append(shape)
        return original(shape, prompt)

    def record(sampled_ids, step_logits):
        for request_id, row in zip(sampled_ids, step_logits):
            logits.setdefault(request_id, []).append(row.clone())

    runner.forward, runner.on_logits = forward, record
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, adapters=names)
    _check_named(names, outputs, [torch.stack(logits[o.request_id]) for o in outputs], references)
    flora_shapes = [s for s in shapes if s.has_flora]
    assert flora_shapes and all(s.flora_rows in FLORA_ROW_BUCKETS for s in flora_shapes)
    assert all(runner.graphs.padded_size(s.num_seqs) == s.num_seqs for s in shapes)
    if families == "ia3-flora":  # IA3's vectors in rotary and the activation: no shrink or expand
        assert shapes and not any(s.has_expand for s in shapes)
    else:
        assert any(s.has_expand for s in shapes)
    variants = {tuple(sorted(v.items())) for v in runner.graphs.variants(16)}
    for s in shapes:  # each step has a graph to replay on CUDA, IA3 with FLoRA too
        key = dict(has_lora=s.has_lora)
        if s.has_flora:  # FLoRA with the expand scales inputs too (identity where no IA3)
            assert s.has_input_scale == s.has_expand, s
            key.update(has_expand=s.has_expand, flora_rows=s.flora_rows,
                       **({"has_input_scale": True} if s.has_expand else {}))
        elif s.has_input_scale:
            key = dict(has_lora=True, has_input_scale=True)
        elif s.has_lora:
            key.update(has_expand=s.has_expand)
        assert tuple(sorted(key.items())) in variants, s
