"""A step that runs out of memory (issue 26, fault 3): its largest request fails with a clear
error, the engine serves the rest, and every KV block, slot and runner row comes back.

The failure is real, not a mocked exception: on CPU the test caps the process's data segment
(RLIMIT_DATA, which counts the anonymous memory that torch's CPU allocator gets from malloc) at
what it uses now plus HEADROOM_BYTES, so the allocator itself fails (ENOMEM) when a step needs
more: the same path an allocation takes on a device whose memory is short. The cap is set in
the test process, on the engine the test drives, and lifted after; glibc is told to serve every
allocation of 1 MiB or more from its own mapping (mallopt M_MMAP_THRESHOLD), so that memory
the process freed before stays out of the cap's count. Why not a subprocess under RLIMIT_AS:
that counts address space that is reserved and never used (thread stacks, malloc arenas, the
CUDA-less torch's mappings), so where the cap bites is the interpreter's, not the step's.

The model is wide where activations are (intermediate size 4096, one layer): a 1,000-token
prompt step needs about 200 MB of activations here, a decode step of three requests well under
1 MB, so a 64 MiB cap fails the one and never the other. On a GPU the same scenario runs in
test_gpu_out_of_memory_check (device memory allocated away by the test;
scripts/gpu-oom.sh)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import re
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.llm_engine import LLMEngine
from loraplex.errors import DeviceOutOfMemoryError
from loraplex.types import RequestOutput
from tests.factories import hf_config, save_byte_tokenizer

pytestmark = pytest.mark.alone  # scripts/test.sh runs these in a process of their own, after the rest

HEADROOM_BYTES = 64 << 20
GPU_HEADROOM_BYTES = 8 << 20
"""On CUDA the activations are bf16 (half the CPU's float32) and decode steps replay graphs
from their own pool: 8 MiB left is far below the prompt step's need and above the rest."""

BIG_PROMPT = [9] * 1000
SMALL_PROMPTS = {f"small-{i}": [5 + i] * 20 for i in range(3)}
SMALL = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
M_MMAP_THRESHOLD = -3
MAX_STEPS = 200


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("wide-llama") / "model"
    config = hf_config("llama", hidden_size=128, intermediate_size=4096, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    save_byte_tokenizer(folder)
    return folder


def _engine(folder: Path, device: str, async_scheduling: bool) -> LLMEngine:
    return LLM(folder, device=device, block_size=16, max_num_batched_tokens=1024, max_model_len=2048,
               max_num_seqs=8, async_scheduling=async_scheduling).engine


def _data_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmData:\s+(\d+) kB", status).group(1)) * 1024


@contextlib.contextmanager
def memory_cap(headroom_bytes: int) -> Iterator[None]:
    """The process may use `headroom_bytes` of data memory more than it does now (RLIMIT_DATA),
    for the block. Garbage is collected first and the collector is off for the block: memory
    that earlier tests left in reference cycles (an engine's buffers: hundreds of MB), freed by a
    collection inside the block, would add to the headroom; under pytest-xdist, after other test
    files in the same process, a 1,000-token step once ran within the cap that way."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    gc.collect()
    libc.malloc_trim(0)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = _data_bytes() + headroom_bytes
    if hard != resource.RLIM_INFINITY and hard < cap:
        pytest.skip(f"RLIMIT_DATA's hard limit ({hard} bytes) is below the cap the test needs")
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _run(engine: LLMEngine, until: set[str]) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    for _ in range(MAX_STEPS):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if until <= finished.keys():
            return finished
    raise AssertionError(f"not finished in {MAX_STEPS} steps: {until - finished.keys()}")


def _add_small(engine: LLMEngine) -> None:
    for request_id, prompt in SMALL_PROMPTS.items():
        engine.add_request(request_id, prompt_token_ids=prompt, params=SMALL)


def assert_all_returned(engine: LLMEngine) -> None:
    """Memory accounting is exact: every KV block, adapter slot and runner row is back."""
    engine.step()  # the runner drops ended requests' rows at its next step
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_used_blocks == 0
    assert engine.scheduler.num_unfinished == 0 and not engine.scheduler.running
    assert engine.num_requests == 0
    assert not engine.runner.batch.row_of
    engine.adapters.settle()  # a copy into a slot for an ended request ends on its own
    assert engine.adapters.num_held_slots == 0 and engine.adapters.num_needed == 0


def _out_of_memory_scenario(engine: LLMEngine, cap: contextlib.AbstractContextManager) -> None:
    """Three small requests decode; a 1,000-token prompt joins them under `cap` and its step runs
    out of memory: it fails with DeviceOutOfMemoryError, the small ones finish with the tokens
    they give without the fault. Once memory is back, the same prompt is served."""
    _add_small(engine)
    expected = {i: o.token_ids for i, o in _run(engine, set(SMALL_PROMPTS)).items()}
    assert_all_returned(engine)

    _add_small(engine)
    engine.step()
    engine.step()  # their prompts are computed: they decode from here
    with cap:
        engine.add_request("big", prompt_token_ids=BIG_PROMPT, params=SMALL)
        finished = _run(engine, {"big", *SMALL_PROMPTS})
    big = finished.pop("big")
    print(f"\nthe big request's error: {big.error}")
    errors = {i: o.error for i, o in finished.items()}
    assert {i: o.token_ids for i, o in finished.items()} == expected, errors
    assert all(o.finish_reason == "length" for o in finished.values())
    assert big.finish_reason == "error" and big.error_code == DeviceOutOfMemoryError.code, big.error
    assert "ran out of device memory" in big.error
    assert_all_returned(engine)

    engine.add_request("big again", prompt_token_ids=BIG_PROMPT, params=SMALL)
    again = _run(engine, {"big again"})["big again"]
    assert again.finish_reason == "length" and len(again.token_ids) == SMALL.max_tokens
    assert_all_returned(engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_out_of_memory_fails_its_largest_request_and_serves_the_rest(
        wide_model: Path, async_scheduling: bool) -> None:
    engine = _engine(wide_model, "cpu", async_scheduling)
    try:
        _out_of_memory_scenario(engine, memory_cap(HEADROOM_BYTES))
    finally:
        engine.close()


@contextlib.contextmanager
def device_memory_taken(device: torch.device, headroom_bytes: int) -> Iterator[None]:
    """All of the device's free memory but `headroom_bytes` is held by a tensor for the block
    (as another process, or a leak, would hold it); the caching allocator's free blocks are
    given back first, so that the engine's steps must allocate anew. Garbage first: tensors of
    earlier tests left in reference cycles would be freed into the allocator inside the block
    (run after twelve other engine GPU tests in one process, the prompt's step once did not run
    out of memory)."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    hog = torch.empty(max(0, free - headroom_bytes), dtype=torch.uint8, device=device)
    try:
        yield
    finally:
        del hog
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_out_of_memory_check(wide_model: Path) -> None:
    """The same scenario on CUDA (scripts/gpu-oom.sh runs it): the device's memory allocated away
    but 8 MiB, a 1,000-token prompt step needs more (torch.OutOfMemoryError from the caching
    allocator); the decode steps of the small requests run in CUDA graphs' own pool."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for async_scheduling in (False, True):
        engine = _engine(wide_model, "cuda", async_scheduling)
        try:
            _out_of_memory_scenario(engine, device_memory_taken(engine.device, GPU_HEADROOM_BYTES))
        finally:
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
