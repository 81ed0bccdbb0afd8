"""What the server reads from a DisaggregatedEngine (CPU, both sides in this process): one
EngineStats of both sides (summed; each side's queue and KV pool; every KV transfer counted and
observed once in the histogram, however often stats are read), and the engine-core process's
facts (EngineFacts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.engine.core_process import facts_of
from loraplex.engine.disaggregated import DisaggregatedEngine
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.stats import Histogram
from loraplex.engine_config import EngineConfig
from loraplex.types import SamplingParams
from tests.factories import make_hf_model

BLOCK_SIZE = 4
PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35, 36, 37])
LAST = [40, 41, 42, 43, 44, 45, 46, 47, 48]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("disaggregated-stats") / "model"
    make_hf_model("llama", folder)
    return folder


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig.from_kwargs(str(model_dir), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                                    max_num_seqs=8)


@pytest.fixture
def engine(model_dir: Path):
    engine = DisaggregatedEngine(_config(model_dir))
    yield engine
    engine.close()


def _run(engine: DisaggregatedEngine | LLMEngine, prompts: list[list[int]], tenant: str) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tenant}-{i}", prompt_token_ids=prompt, tenant=tenant,
                           params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def test_stats_sum_both_sides_and_count_each_transfer_once(engine: DisaggregatedEngine,
                                                           model_dir: Path) -> None:
    colocated = LLMEngine(_config(model_dir))
    _run(colocated, [*PROMPTS, LAST], "acme")
    want = colocated.stats()
    colocated.close()
    _run(engine, list(PROMPTS), "acme")
    first = engine.stats()
    _run(engine, [LAST], "acme")
    stats = engine.stats()
    transfers = stats.kv_transfers
    assert transfers.num_transfers == 4 == transfers.durations.count  # each observed once, across reads
    assert first.kv_transfers.durations.count == 3
    assert transfers.num_blocks == engine.num_blocks_sent and transfers.num_bytes > 0
    assert transfers.bytes_per_second > 0
    assert set(stats.sides) == {"prefill", "decode"}
    prefill, decode = engine.prefill.stats(), engine.decode.stats()
    assert stats.num_kv_blocks == prefill.num_kv_blocks + decode.num_kv_blocks
    assert stats.sides["decode"].num_kv_blocks == decode.num_kv_blocks
    assert all(side.num_kv_blocks_used == 0 and side.num_running == 0 for side in stats.sides.values())
    # The prompt is charged on the prefill side, the outputs on the decode side: together the
    # colocated engine's figures.
    assert stats.num_prompt_tokens == want.num_prompt_tokens
    assert stats.num_generated_tokens == want.num_generated_tokens == 4 * 4
    assert stats.tenant_service == pytest.approx(want.tenant_service)


def test_a_queue_shows_on_its_side(engine: DisaggregatedEngine) -> None:
    engine.add_request("waiting", prompt_token_ids=PROMPTS[0], params=SamplingParams(max_tokens=4))
    stats = engine.stats()
    assert stats.sides["prefill"].num_waiting == 1 and stats.sides["decode"].num_waiting == 0
    assert stats.num_waiting == 1 and stats.waiting_by_tenant == {"default": 1}
    engine.abort_all()


def test_the_facts_the_engine_core_sends(engine: DisaggregatedEngine) -> None:
    facts = facts_of(engine)
    assert facts.config == engine.prefill.config and facts.model_config == engine.prefill.model_config
    assert facts.device == torch.device("cpu") and facts.dtype == torch.float32
    assert facts.max_model_len == min(engine.prefill.max_model_len, engine.decode.max_model_len)
    assert facts.memory == engine.decode.memory and facts.graphs is None
    assert facts.eos_token_ids == engine.prefill.eos_token_ids
    assert engine.grammars is engine.prefill.grammars


def test_pins_and_the_prefix_cache(engine: DisaggregatedEngine) -> None:
    engine.pin_prompt("desk", PROMPTS[0])
    assert engine.pinned_prompts() == {"desk": 0}  # its warm-up runs
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # (sends it to the decode side)
    assert engine.pinned_prompts() == {"desk": 2}
    assert engine.stats().pinned_prompts == {"desk": (4, 0)}  # its two blocks on each side
    _run(engine, [PROMPTS[1]], "acme")
    assert engine.reset_prefix_cache() > 0  # the request's blocks, cached on both sides
    engine.unpin_prompt("desk")


def test_histograms_merge() -> None:
    first, second = Histogram((1.0, 2.0)), Histogram((1.0, 2.0))
    first.observe(0.5)
    second.observe(3.0)
    merged = first.merged(second)
    assert merged.counts == [1, 0, 1] and merged.total == 3.5
    with pytest.raises(ValueError):
        first.merged(Histogram((1.0,)))
