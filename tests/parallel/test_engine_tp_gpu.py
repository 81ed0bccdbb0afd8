"""Two GPUs. The engine at tensor_parallel_size 2 (NCCL, one worker process a GPU, Triton
kernels) against the same engine at 1: float32 eager gives the same greedy tokens; bfloat16 with
each rank's decode steps captured as CUDA graphs (their all-reduces and the logits' all-gather
inside) agrees with TP=1 as bf16 runs agree with each other (the sums run in another order)."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from tests.parallel.tp_support import SYSTEM

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

NAMES = [None, "all8", "pattern", "ia3", "flora", "dora", "all8", None]
PROMPTS = [SYSTEM + [100 + i] * (1 + i % 3) for i in range(len(NAMES))]


def _tokens(model, adapters, size: int, dtype: str, **options) -> list[list[int]]:
    with LLM(model, device="cuda", dtype=dtype, tensor_parallel_size=size, max_loras=len(adapters),
             max_lora_rank=16, max_num_seqs=16, max_num_batched_tokens=128, relay_attention="always",
             **options) as llm:
        for name, path in adapters.items():
            llm.add_adapter(name, path)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params,
                                                  adapters=NAMES)]


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_tp2_on_two_gpus_matches_tp1_in_float32(tiny):
    _, model, adapters = tiny
    assert _tokens(model, adapters, 2, "float32", enforce_eager=True) == \
        _tokens(model, adapters, 1, "float32", enforce_eager=True)


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_tp2_with_cuda_graphs_in_bfloat16(tiny):
    _, model, adapters = tiny
    want, got = _tokens(model, adapters, 1, "bfloat16"), _tokens(model, adapters, 2, "bfloat16")
    pairs = [(a, b) for w, g in zip(want, got) for a, b in zip(w, g)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"bf16 TP=2 (graphs) against TP=1: {agreement:.1%} of tokens agree")
    assert agreement >= 0.8


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_disaggregated_prefill_and_decode_on_two_gpus_match_the_colocated_engine(tiny):
    """Disaggregated 1:1 (issue 23): the prefill side's worker on GPU 0, the decode side's on
    GPU 1, the decode worker copying KV blocks out of the prefill worker's cache (CUDA IPC,
    device to device), each side stepping on its own thread: float32 eager gives the colocated
    engine's greedy tokens, and bf16 with CUDA graphs agrees as bf16 runs do."""
    _, model, adapters = tiny
    assert _tokens(model, adapters, 1, "float32", enforce_eager=True, disaggregate="1:1") == \
        _tokens(model, adapters, 1, "float32", enforce_eager=True)
    want = _tokens(model, adapters, 1, "bfloat16")
    got = _tokens(model, adapters, 1, "bfloat16", disaggregate="1:1")
    pairs = [(a, b) for w, g in zip(want, got) for a, b in zip(w, g)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.8


def test_a_direct_copy_to_the_peer_gpu_matches_torch_copy():
    """loraplex/worker/peer_copy.py: one cudaMemcpyAsync from GPU 0 into GPU 1's memory."""
    from loraplex.worker.peer_copy import copy_to_peer, enable_peer_access

    source = torch.randn(3, 1 << 20, device="cuda:0", dtype=torch.bfloat16)
    target = torch.zeros(3, 1 << 20, device="cuda:1", dtype=torch.bfloat16)
    direct = enable_peer_access(source.device, target.device)
    assert direct == torch.cuda.can_device_access_peer(0, 1)
    copy_to_peer(target[1:], source[:2], direct)
    torch.cuda.synchronize("cuda:0")
    assert torch.equal(target[1:].cpu(), source[:2].cpu()) and not target[0].any()
