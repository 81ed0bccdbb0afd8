"""One device pool for KV blocks and adapter slots (issue 27): adapters of ranks 1 to 64 and of
every family page in and out while the KV cache grows and shrinks, an idle adapter is evicted
for KV (the less used one) and reloaded, aborts in the middle of loads leave nothing behind, and
every page is accounted for at every step (held KV, lent to one adapter, free); an adapter takes
pages in proportion to its own rank. Outputs are
token-exact, float32 on CPU, with transformers + PEFT running each request alone."""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.demo.flora import merge_flora
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.lora_weights import adapter_blocks, max_adapter_pool_bytes
from loraplex.engine.sizing import kv_block_bytes
from tests.engine.pool_checks import assert_pool_accounting
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

MAX_RANK = 64
BLOCK_SIZE = 4
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A tiny Llama; LoRA adapters of ranks 1, 8, 16 and 64 and one each of DoRA, IA3, FLoRA."""
    folder = tmp_path_factory.mktemp("pool")
    # a long context: an adapter slot of rank 64 holds as many bytes as ~1,000 tokens of KV
    hf = make_hf_model("llama", folder / "model", config={"max_position_embeddings": 2048})
    ads = folder / "adapters"
    adapters = {
        "lora1": make_adapter(hf, AdapterSpec("lora1", ("q_proj", "v_proj"), rank=1, alpha=2), ads, seed=1),
        "lora8": make_adapter(hf, AdapterSpec("lora8", ALL_SEVEN, rank=8, alpha=16), ads, seed=2),
        "lora16": make_adapter(hf, AdapterSpec("lora16", ("o_proj", "gate_proj", "down_proj"), rank=16,
                                               alpha=16), ads, seed=3),
        "lora64": make_adapter(hf, AdapterSpec("lora64", ALL_SEVEN, rank=64, alpha=64), ads, seed=4),
        "dora4": make_dora_adapter(hf, ads / "dora4", ALL_SEVEN, rank=4, alpha=8, seed=5),
        "ia3": make_ia3_adapter(hf, ads / "ia3", ALL_SEVEN, feedforward=("down_proj",), seed=6),
        "flora4": make_flora_adapter(hf, ads / "flora4", ATTENTION, rank=4, seed=7),
    }
    return hf, folder / "model", adapters


def _reference(hf, adapters, name, prompt) -> list[int]:
    """Greedy tokens of one request alone, through transformers + PEFT (FLoRA merged)."""
    from peft import PeftModel

    if name is None:
        model = hf
    elif name.startswith("flora"):
        model = merge_flora(hf, adapters[name])
    else:
        model = PeftModel.from_pretrained(copy.deepcopy(hf), adapters[name]).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _llm(model_dir, adapters, num_slots: int, num_kv_pages: int, **options) -> LLM:
    """An engine whose pool holds 1 + `num_slots` adapters of the largest rank and
    `num_kv_pages` KV blocks beside them (the pool's size in bytes: its boundary moves)."""
    from loraplex.model.model_config import ModelConfig

    config = ModelConfig.load(model_dir)
    page = kv_block_bytes(config, BLOCK_SIZE, torch.float32)
    slot = max_adapter_pool_bytes(config, MAX_RANK, torch.float32, page)
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_lora_rank=MAX_RANK,
              cpu_kv_cache_bytes=(1 + num_slots) * slot + num_kv_pages * page, **options)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def _prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (length,), generator=generator).tolist()


def _filling(prefix: str, num_pages: int, max_pages: int) -> list[tuple[str, None, list[int]]]:
    """Base-model requests that take `num_pages` KV pages in all, each at most max_pages."""
    full, rest = divmod(num_pages, max_pages)
    sizes = [max_pages] * full + ([rest] if rest else [])
    return [(f"{prefix}-{i}", None, _prompt(1000 + 7 * i + num_pages, n * BLOCK_SIZE - MAX_TOKENS))
            for i, n in enumerate(sizes)]


def _drive(engine, check_every_step: bool = True) -> dict[str, list[int]]:
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.token_ids
        if check_every_step:
            assert_pool_accounting(engine)
    engine.step()  # the runner forgets finished requests at its next step
    return outputs


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_adapters_of_every_rank_and_family_page_in_and_out_as_the_kv_cache_grows_and_shrinks(case):
    """Room for two adapters beside 24 pages of KV: waves of short requests over seven adapters
    (LoRA of ranks 1 to 64, DoRA, IA3, FLoRA) page them in and out, and between the waves a
    long base-model prompt takes the pages that idle adapters held; the next wave pages them in
    again. Every page is accounted for at every step."""
    hf, model_dir, adapters = case
    llm = _llm(model_dir, adapters, num_slots=2, num_kv_pages=24, max_num_seqs=4,
               max_num_batched_tokens=2048)  # the long prompts are all in at once
    engine, cache = llm.engine, llm.engine.adapters
    names = list(adapters)
    peak_kv = peak_adapters = 0
    outputs, phases = {}, []  # [(request id, adapter, prompt)] run one phase after another
    for wave in range(6):
        if wave % 2 == 0:
            phase = [(f"w{wave}-{name}", name, _prompt(100 * wave + i, 3 + (i + wave) % 5))
                     for i, name in enumerate(names)]
        else:  # base-model prompts that need one page more than is free beside the idle adapters
            phase = _filling(f"long{wave}", engine.blocks.num_free_blocks + 1, engine.memory.num_kv_blocks)
        phases.append(phase)
        evictions = cache.num_evictions
        for request_id, name, prompt in phase:
            engine.add_request(request_id, prompt_token_ids=prompt, params=GREEDY, adapter=name)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output.token_ids
            assert_pool_accounting(engine)
            peak_kv = max(peak_kv, engine.blocks.num_used_blocks)
            peak_adapters = max(peak_adapters, len(cache.resident))
        if phase[0][1] is None:
            assert cache.num_evictions > evictions, "the long prompt took no idle adapter's pages"
    engine.step()
    assert_pool_accounting(engine)
    assert engine.blocks.num_used_blocks == 0
    # The boundary moved both ways: KV took pages that adapters held at other times.
    assert peak_kv > engine.blocks.num_blocks - 2 * cache.slot_blocks and peak_adapters >= 2
    assert cache.num_slot_loads > len(names) and engine.scheduler.num_preemptions == 0
    for phase in phases:
        for request_id, name, prompt in phase:
            assert outputs[request_id] == _reference(hf, adapters, name, prompt), request_id


@pytest.mark.gpu
def test_adapters_page_through_the_pool_under_the_decode_graphs(case):
    """On CUDA (Triton kernels, decode graphs captured once at start-up, float32): seven
    adapters of every family through two resident places (max_loras) in waves, slots filled and
    evicted again and again under the graphs' fixed addresses: the same greedy tokens as
    transformers + PEFT alone; every page accounted for at every step."""
    hf, model_dir, adapters = case
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=BLOCK_SIZE, max_lora_rank=MAX_RANK,
              max_loras=2, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, flora_graphs=True)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    engine, cache = llm.engine, llm.engine.adapters
    assert engine.graphs is not None
    requests = [(f"w{wave}-{name}", name, _prompt(10 * wave + i, 3 + i % 5))
                for wave in range(2) for i, name in enumerate([*adapters, None])]
    for request_id, name, prompt in requests:
        engine.add_request(request_id, prompt_token_ids=prompt, params=GREEDY, adapter=name)
    outputs = _drive(engine)
    assert cache.num_evictions > 0 and len(cache.resident) <= 2
    for request_id, name, prompt in requests:
        assert outputs[request_id] == _reference(hf, adapters, name, prompt), request_id


def test_an_idle_adapter_is_evicted_for_kv_and_reloaded(case):
    """Two idle adapters resident, then base-model requests that need more KV than is free:
    the less used adapter (lora1, used once, against lora8, used twice) gives its pages back,
    nobody is preempted, and lora1 comes back when asked for, with the same tokens."""
    hf, model_dir, adapters = case
    used = {name: adapters[name] for name in ("lora1", "lora8")}
    llm = _llm(model_dir, used, num_slots=2, num_kv_pages=16, max_num_seqs=4)
    engine, cache = llm.engine, llm.engine.adapters
    packed_on, pack = [], engine.lora._pack

    def spy(host):
        packed_on.append((host.digest, threading.current_thread().name))
        return pack(host)

    engine.lora._pack = spy
    first = _prompt(1, 5)
    for request_id, name in (("a", "lora8"), ("b", "lora8"), ("c", "lora1")):
        engine.add_request(request_id, prompt_token_ids=first, params=GREEDY, adapter=name)
        _drive(engine)
    digests = {name: engine.local_adapters.resolve(name) for name in used}
    assert set(cache.resident) == set(digests.values()) and cache.num_evictions == 0
    # requests that need one page more than is free
    more = _filling("base", engine.blocks.num_free_blocks + 1, engine.memory.num_kv_blocks)
    for request_id, _, prompt in more:
        engine.add_request(request_id, prompt_token_ids=prompt, params=GREEDY)
    _drive(engine)
    assert cache.num_evictions == 1 and set(cache.resident) == {digests["lora8"]}
    assert engine.scheduler.num_preemptions == 0
    loads = cache.num_slot_loads
    engine.add_request("again", prompt_token_ids=first, params=GREEDY, adapter="lora1")
    outputs = _drive(engine)
    assert cache.num_slot_loads == loads + 1 and digests["lora1"] in cache.resident
    assert outputs["again"] == _reference(hf, adapters, "lora1", first)
    pages = cache.pages_of(digests["lora1"])
    assert cache.device_bytes(digests["lora1"]) == len(pages) * engine.memory.kv_block_bytes
    assert 0 < len(pages) < cache.slot_blocks / 8  # rank 1 on two modules: a few pages, not a slot
    # Each adapter was laid out in pool pages once, on a load thread, when it entered the host
    # tier; the loads (three, one of them a reload) only copied its pages.
    assert sorted(d for d, _ in packed_on) == sorted(digests.values())
    assert all(thread.startswith("loraplex-adapter-load") for _, thread in packed_on)


def test_aborts_during_host_loads_and_slot_copies_leave_every_page_accounted_for(case):
    hf, model_dir, adapters = case
    llm = _llm(model_dir, adapters, num_slots=2, num_kv_pages=24, max_num_seqs=4)
    engine, cache = llm.engine, llm.engine.adapters
    names = ["lora64", "dora4", "flora4", "ia3"]
    prompt = _prompt(3, 6)
    for name in names:  # aborted while the host loads run
        engine.add_request(f"cold-{name}", prompt_token_ids=prompt, params=GREEDY, adapter=name)
    engine.step()
    for name in names:
        engine.abort(f"cold-{name}")
    deadline = time.monotonic() + 30
    copying = False
    for name in names:  # aborted once a slot copy is under way (or done)
        engine.add_request(f"warm-{name}", prompt_token_ids=prompt, params=GREEDY, adapter=name)
    while not copying and engine.has_unfinished_requests():
        engine.step()
        assert_pool_accounting(engine)
        copying = bool(cache._copies)
        assert time.monotonic() < deadline
    for name in names:
        engine.abort(f"warm-{name}")
    _drive(engine)
    cache.settle()  # what was under way finishes on its own
    assert_pool_accounting(engine)
    assert engine.blocks.num_used_blocks == 0 and cache.num_held_slots == 0 and cache.num_needed == 0
    for name in names:  # and the adapters serve afterwards
        engine.add_request(f"after-{name}", prompt_token_ids=prompt, params=GREEDY, adapter=name)
    outputs = _drive(engine)
    for name in names:
        assert outputs[f"after-{name}"] == _reference(hf, adapters, name, prompt), name


def test_a_queued_requests_adapter_is_copied_into_free_pages_before_a_place_frees(case):
    """One running place, held by a long request; the adapter of the request queued behind it
    is read and copied into free pages meanwhile (staged), so it is resident when it runs."""
    hf, model_dir, adapters = case
    used = {name: adapters[name] for name in ("lora8", "dora4")}
    llm = _llm(model_dir, used, num_slots=3, num_kv_pages=64, max_num_seqs=1)
    engine, cache = llm.engine, llm.engine.adapters
    prompt = _prompt(4, 5)
    engine.add_request("long", prompt_token_ids=prompt, adapter="lora8",
                       params=SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    deadline = time.monotonic() + 30
    while not engine.scheduler.running:  # its adapter loads first
        engine.step()
        assert time.monotonic() < deadline
    engine.add_request("queued", prompt_token_ids=prompt, params=GREEDY, adapter="dora4")
    digest = engine.local_adapters.resolve("dora4")
    outputs = {}
    while digest not in cache.resident or cache.slot_of(digest) in cache._copies:
        assert "long" not in outputs and time.monotonic() < deadline, "dora4 was not staged"
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        time.sleep(0.005)
        assert_pool_accounting(engine)
    assert engine._requests["queued"].status.value == "waiting" and cache.num_staged == 1
    loads = cache.num_slot_loads
    outputs.update(_drive(engine))
    assert cache.num_slot_loads == loads  # it ran from the staged copy
    assert outputs["queued"] == _reference(hf, adapters, "dora4", prompt)


class _Idle:
    """A reclaimer that gives back adapters of 4 pages, as the adapter cache would."""

    def __init__(self, blocks: BlockManager, num_adapters: int) -> None:
        self.blocks = blocks
        self.slots = [blocks.lend_pages(4) for _ in range(num_adapters)]

    @property
    def num_reclaimable_blocks(self) -> int:
        return 4 * len(self.slots)

    def reclaim(self, num_blocks: int) -> None:
        while num_blocks > 0 and self.slots:
            self.blocks.give_back_pages(self.slots.pop())
            num_blocks -= 4


def test_kv_comes_from_the_top_and_takes_free_then_cached_then_idle_adapters_blocks():
    blocks = BlockManager(16, 4, enable_prefix_caching=True)
    idle = _Idle(blocks, 2)  # blocks 0-3, 4-7 lent
    blocks.reclaimer = idle
    assert blocks.allocate(2) == [15, 14]
    assert (blocks.num_used_blocks, blocks.num_lent_blocks, blocks.num_free_blocks) == (2, 8, 6)
    cached = blocks.allocate(2)  # 13, 12: cached, then nobody holds them
    blocks.register(cached, [b"x", b"y"])
    blocks.mark_computed(cached)
    blocks.free(cached)
    assert blocks.num_available_blocks == 4 + 2 + 8
    assert sorted(blocks.allocate(4)) == [8, 9, 10, 11]  # the plain free ones first
    assert blocks.num_evicted_blocks == 0 and blocks.num_lent_blocks == 8
    assert sorted(blocks.allocate(2)) == [12, 13]  # then the cached ones
    assert blocks.num_evicted_blocks == 2 and blocks.num_lent_blocks == 8
    assert blocks.allocate(3) == [7, 6, 5]  # then an idle adapter's (slot 1), from the top
    assert blocks.num_lent_blocks == 4 and blocks.num_available_blocks == 5
    assert blocks.allocate(6) is None and blocks.num_lent_blocks == 4  # nothing given back for it


def test_a_block_freed_while_a_step_is_planned_is_lent_only_from_the_next():
    blocks = BlockManager(8, 4)
    taken = blocks.allocate(8)
    blocks.free(taken[4:])  # blocks 0-3 (allocated last: from the top down)
    assert blocks.lend_pages(1) is None  # its swap-out may not be queued yet
    blocks.start_step()
    pages = blocks.lend_pages(4)
    assert pages == [0, 1, 2, 3] and blocks.lend_pages(1) is None
    blocks.give_back_pages(pages)
    assert blocks.num_free_blocks == 4 and blocks.num_lent_blocks == 0


def _lowest_lendable(blocks: BlockManager, count: int, run: int) -> list[int] | None:
    """Lending's rule spelled out as a scan of every block: the lowest `count` aligned runs of
    blocks that are free (or cached and unheld), not lent, and not freed in this step."""
    pages = []
    for first in range(0, blocks.num_blocks - run + 1, run):
        if len(pages) < count * run and all(
                blocks._refs[b] == 0 and not blocks._lent[b] and b not in blocks._fresh
                for b in range(first, first + run)):
            pages += range(first, first + run)
    return pages if len(pages) == count * run else None


@pytest.mark.parametrize("run", [1, 2])
def test_lending_takes_the_lowest_lendable_pages_as_a_scan_of_every_block_would(run):
    """Lending pops candidates off a heap instead of scanning the pool (with hundreds of adapters
    resident on an H200 the scan took tens of milliseconds of the engine's thread a load): under
    random KV allocations, frees, cached blocks, steps, lends and give-backs it lends exactly the
    pages that the scan would, and nothing when the scan finds too few."""
    rng = random.Random(run)
    blocks = BlockManager(64, 4, enable_prefix_caching=True)
    held: list[list[int]] = []
    lent: list[list[int]] = []
    num_hashes = 0
    for _ in range(3000):
        action = rng.random()
        if action < 0.3:
            taken = blocks.allocate(rng.randint(1, 6))
            if taken is not None:
                if rng.random() < 0.5:  # a prompt's blocks: cached once computed
                    hashes = [f"h{num_hashes + i}".encode() for i in range(len(taken))]
                    num_hashes += len(taken)
                    blocks.register(taken, hashes)
                    blocks.mark_computed(taken)
                held.append(taken)
        elif action < 0.5 and held:
            blocks.free(held.pop(rng.randrange(len(held))))
        elif action < 0.6:
            blocks.start_step()
        elif action < 0.85:
            count = rng.randint(1, 5)
            expected = _lowest_lendable(blocks, count, run)
            pages = blocks.lend_pages(count, run)
            assert pages == expected
            if pages is not None:
                lent.append(pages)
        elif lent:
            blocks.give_back_pages(lent.pop(rng.randrange(len(lent))))
        in_use = sum(map(len, held))
        assert blocks.num_lent_blocks == sum(map(len, lent))
        assert blocks.num_used_blocks <= in_use  # (a block held twice counts once)


def test_max_kv_blocks_caps_the_kv_cache_and_its_cached_blocks():
    blocks = BlockManager(16, 4, enable_prefix_caching=True, max_kv_blocks=4)
    held = blocks.allocate(3)
    blocks.register(held, [b"a", b"b", b"c"])
    blocks.mark_computed(held)
    blocks.free(held)
    assert blocks.allocate(5) is None
    assert len(blocks.allocate(4)) == 4 and blocks.num_evicted_blocks == 3  # cached ones, not more


def test_device_bytes_follow_each_adapters_rank_and_mixed_ranks_page_in_and_out_exactly(case, tmp_path):
    """Adapters of ranks 8, 16 and 64 on all seven modules take pool pages in proportion to
    their rank (1:2:8, up to a partly filled last page), device_bytes says so, every page is
    accounted for; requests over the three, in waves with at most two resident (max_loras),
    page them in and out and match transformers + PEFT."""
    hf, model_dir, adapters = case
    mixed = {f"r{r}": make_adapter(hf, AdapterSpec(f"r{r}", ALL_SEVEN, rank=r, alpha=r), tmp_path,
                                   seed=20 + r) for r in (8, 16, 64)}
    llm = _llm(model_dir, mixed, num_slots=1, num_kv_pages=24, max_num_seqs=2, max_loras=2)
    engine, cache = llm.engine, llm.engine.adapters
    page = engine.memory.kv_block_bytes
    device_bytes = {}
    requests = [(f"w{wave}-{i}-{name}", name, _prompt(50 * wave + i, 4 + i)) for wave in range(2)
                for i, name in enumerate(["r8", "r64", "r16", "r64", "r8"])]
    outputs = {}
    for request_id, name, prompt in requests:
        engine.add_request(request_id, prompt_token_ids=prompt, params=GREEDY, adapter=name)
        outputs.update(_drive(engine))
        digest = engine.local_adapters.resolve(name)
        device_bytes[name] = cache.device_bytes(digest)
        assert device_bytes[name] == len(cache.pages_of(digest)) * page > 0
    weights = {name: sum(b.size for b in adapter_blocks(engine.model_config, torch.float32,
                                                            cache._host[engine.local_adapters.resolve(name)].adapter))
               for name in mixed}
    assert weights["r16"] == 2 * weights["r8"] and weights["r64"] == 8 * weights["r8"]
    for name in mixed:  # whole pages, packed: at most a page more than the rank pages need
        assert weights[name] <= device_bytes[name] <= 1.1 * weights[name] + page, name
    assert device_bytes["r8"] < device_bytes["r16"] < device_bytes["r64"] <= cache.slot_blocks * page
    assert cache.num_evictions > 0
    for request_id, name, prompt in requests:
        assert outputs[request_id] == _reference(hf, {**adapters, **mixed}, name, prompt), request_id


def test_small_adapters_are_resident_by_their_pages_not_by_max_rank_slots(case, tmp_path):
    """A pool with the pages of two adapters of the largest rank (64) holds rank-8, rank-16 and
    rank-64 adapters at once: the page tables have rows for as many adapters as the pool holds of
    one rank page a module (MemoryPlan.num_lora_slots), not of the largest rank."""
    hf, model_dir, _ = case
    mixed = {f"r{r}": make_adapter(hf, AdapterSpec(f"r{r}", ALL_SEVEN, rank=r, alpha=r), tmp_path,
                                   seed=40 + r) for r in (8, 16, 64)}
    llm = _llm(model_dir, mixed, num_slots=1, num_kv_pages=24, max_num_seqs=2)
    engine, cache = llm.engine, llm.engine.adapters
    assert engine.memory.num_lora_slots > engine.memory.num_pool_blocks // engine.memory.slot_blocks - 1
    for i, name in enumerate(mixed):
        engine.add_request(f"q{i}", prompt_token_ids=_prompt(300 + i, 4), params=GREEDY, adapter=name)
        _drive(engine)
    assert all(cache.device_bytes(engine.local_adapters.resolve(name)) > 0 for name in mixed)
    assert cache.num_evictions == 0
    assert engine.blocks.num_used_blocks == 0


def test_the_triton_kernels_read_the_same_pages_as_the_reference(case):
    """The engine with the Triton op set (the interpreter without CUDA; eager steps) reads every
    family's adapters through the same page tables as the torch references: the same tokens."""
    _, model_dir, adapters = case
    names = [None, *adapters]
    prompts = [_prompt(70 + i, 3 + i % 3) for i in range(len(names))]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    tokens = {}
    for kernels in ("reference", "triton"):
        llm = _llm(model_dir, adapters, num_slots=2, num_kv_pages=24, max_num_seqs=8, kernels=kernels)
        assert llm.engine.runner.ops.name == kernels
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, adapters=names)
        tokens[kernels] = [o.token_ids for o in outputs]
        assert_pool_accounting(llm.engine)
    assert tokens["triton"] == tokens["reference"]
