"""Attention sinks (StreamingLLM) on CPU in float32: while the text fits the window, a request
with sinks gives exactly the greedy tokens of full attention (and of transformers); past it, the
tokens of a token-by-token StreamingLLM loop on transformers' own cache (the window's blocks
dropped, the kept keys rotated back: cache-relative positions); a session runs far past the
context with the blocks it holds flat; windows that cannot fit are refused, naming the field."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine_config import ConfigError
from loraplex.errors import InvalidRequestError
from loraplex.types import StreamingWindow
from tests.factories import make_hf_model

BLOCK_SIZE = 4
SINKS, WINDOW = 4, 24
PROMPT = 20


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sinks")
    hf = make_hf_model("llama", folder / "model")
    prompt = torch.randint(3, 300, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    return folder / "model", hf, prompt


def _llm(model_dir, **options) -> LLM:
    return LLM(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, **options)


def _greedy(max_tokens: int, window: StreamingWindow | None = None, logprobs: int | None = None
            ) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, streaming_window=window,
                          logprobs=logprobs)


def _streaming_reference(hf, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens, and their log-probabilities, of StreamingLLM on transformers: the prompt in
    one pass (it fits), then one token at a time; before each, the window's blocks whose tokens
    are all more than WINDOW behind are dropped from the cache and the keys after the sinks
    rotated back by the tokens dropped; each new token takes its position within the cache."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cache = DynamicCache()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
    tokens, logprobs, num_dropped = [], [], 0
    for step in range(num_tokens):
        tokens.append(int(logits.argmax()))
        logprobs.append(torch.log_softmax(logits, dim=-1)[tokens[-1]].item())
        text_position = len(prompt) + step
        count = max(0, text_position - WINDOW - (SINKS + num_dropped)) // BLOCK_SIZE  # SINKS: one block
        if count:
            shift = count * BLOCK_SIZE
            cos, sin = hf.model.rotary_emb(cache.layers[0].keys, torch.tensor([[shift]]))
            for layer in cache.layers:
                kept = torch.cat((layer.keys[:, :, :SINKS], layer.keys[:, :, SINKS + shift:]), dim=2)
                window_keys, _ = apply_rotary_pos_emb(kept[:, :, SINKS:], kept[:, :, SINKS:], cos, -sin)
                layer.keys = torch.cat((kept[:, :, :SINKS], window_keys), dim=2)
                values = layer.values
                layer.values = torch.cat((values[:, :, :SINKS], values[:, :, SINKS + shift:]), dim=2)
            num_dropped += shift
        position = text_position - num_dropped
        with torch.no_grad():
            logits = hf(torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[position]]),
                        cache=cache, use_cache=True).logits[0, -1]
    return tokens, logprobs


def test_sinks_and_window_equal_full_attention_while_the_text_fits(case):
    model_dir, hf, prompt = case
    num_tokens = SINKS + WINDOW - PROMPT  # prompt and output: exactly the sinks and the window
    llm = _llm(model_dir)
    full = llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy(num_tokens))[0]
    window = StreamingWindow(WINDOW, SINKS)
    ours = llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy(num_tokens, window))[0]
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                do_sample=False, pad_token_id=0)[0, PROMPT:].tolist()
    assert ours.token_ids == full.token_ids == hf_tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_past_the_window_it_is_streaming_llm_and_its_blocks_stay_flat(case, async_scheduling):
    model_dir, hf, prompt = case
    num_tokens = 60  # 80 tokens through a cache of 32: 12 window blocks dropped, keys rotated back
    llm = _llm(model_dir, max_model_len=64, async_scheduling=async_scheduling)
    engine = llm.engine
    engine.add_request("s", prompt_token_ids=prompt,
                       params=_greedy(num_tokens, StreamingWindow(WINDOW, SINKS), logprobs=0))
    held, output = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            output = out
        held.append(engine.blocks.num_used_blocks)
    tokens, logprobs = _streaming_reference(hf, prompt, num_tokens)
    assert output.finished and output.token_ids == tokens
    # (on this random model the tokens barely depend on the keys' positions: without the
    # rotation they are the same, the log-probabilities off by 2.5e-3)
    error = max(abs(ours.logprob - theirs) for ours, theirs in zip(output.logprobs, logprobs))
    assert error < 2e-5, f"log-probabilities differ by {error:.1e}"
    bound = (SINKS + WINDOW) // BLOCK_SIZE + 2  # sinks, window, the window's partial block, the new one
    assert max(held) <= bound and held[-2] >= bound - 1  # flat: at the bound from the window's end on
    assert engine.blocks.num_used_blocks == 0


def test_a_session_runs_far_past_the_context_in_flat_memory(case):
    model_dir, _, prompt = case
    llm = _llm(model_dir, max_model_len=64, sliding_window=40, attention_sinks=4)  # the engine's default
    engine = llm.engine
    long_prompt = (prompt * 5)[:90]  # a prompt longer than the context, prefilled in chunks
    engine.add_request("s", prompt_token_ids=long_prompt, params=_greedy(150))
    held, output = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            output = out
        held.append(engine.blocks.num_used_blocks)
    assert output.finished and len(output.token_ids) == 150  # 240 tokens through 64 of context
    assert max(held) <= 64 // BLOCK_SIZE and engine.blocks.num_used_blocks == 0


def test_windows_that_cannot_fit_are_refused(case):
    model_dir, _, prompt = case
    llm = _llm(model_dir, max_model_len=64)
    with pytest.raises(InvalidRequestError) as refused:
        llm.engine.add_request("w", prompt_token_ids=prompt, params=_greedy(4, StreamingWindow(60, 4)))
    assert refused.value.param == "streaming_window" and "at most 56" in str(refused.value)
    with pytest.raises(InvalidRequestError) as refused:
        llm.engine.add_request("l", prompt_token_ids=prompt * 4, params=_greedy(4))  # no window: 80 > 64
    assert refused.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="sliding_window must be an integer > 0"):
        StreamingWindow(0)
    with pytest.raises(ConfigError, match="sliding_window"):
        _llm(model_dir, max_model_len=64, sliding_window=64)


def test_the_triton_kernels_stream_as_the_reference_does(case):
    """On CPU through the Triton interpreter (tests/conftest.py), on a GPU compiled."""
    model_dir, _, prompt = case
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, logprobs=2,
                            streaming_window=StreamingWindow(8, 4))  # 21 tokens through 16: 1 drop
    results = {}
    for kernels in ("reference", "triton"):
        llm = LLM(model_dir, device=device, dtype="float32", kernels=kernels, block_size=BLOCK_SIZE,
                  max_model_len=64, enforce_eager=True)
        results[kernels] = llm.generate(prompt_token_ids=[prompt[:10]], sampling_params=params)[0]
    ours, ref = results["triton"], results["reference"]
    assert ours.token_ids == ref.token_ids
    assert all(a.logprob == pytest.approx(b.logprob, abs=2e-3) for a, b in zip(ours.logprobs, ref.logprobs))


@pytest.mark.parametrize("swap_space", [1, 0], ids=["swapped", "recomputed"])
def test_a_stream_preempted_past_the_window_resumes_where_it_was(case, swap_space):
    model_dir, _, prompt = case
    params = _greedy(60, StreamingWindow(WINDOW, SINKS), logprobs=0)

    def run(preempt_at: tuple[int, ...]) -> tuple[list[int], list[float], int]:
        engine = _llm(model_dir, max_model_len=64, swap_space=swap_space).engine
        engine.add_request("s", prompt_token_ids=prompt, params=params)
        output, step = None, 0
        while engine.has_unfinished_requests():
            if step in preempt_at:
                engine.preempt("s")
            for out in engine.step():
                output = out
            step += 1
        assert engine.blocks.num_used_blocks == 0
        return output.token_ids, [lp.logprob for lp in output.logprobs], engine.scheduler.num_preemptions

    alone_tokens, alone_logprobs, _ = run(())
    tokens, logprobs, num_preemptions = run((25, 47))  # each after window blocks were dropped
    assert num_preemptions == 2 and tokens == alone_tokens
    # Swapped: exact. Recomputed: its tokens are computed again in chunks, each chunk's tokens
    # seeing the window of its first (not one by one): 4.5e-5 apart here.
    tolerance = 1e-6 if swap_space else 1e-3
    assert max(abs(a - b) for a, b in zip(logprobs, alone_logprobs)) < tolerance
