"""Global prefix grouping of an offline batch (BatchLLM): prompts whose common prefixes are
registered nowhere are found by a prefix tree over the whole batch, each shared prefix is
computed once, and its members run together. On CPU in float32, token-exact against
transformers + PEFT per request alone, grouping on and off, prefix cache on and off."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.offline_batch import BatchRequest, run_batch
from loraplex.engine.prefix_groups import PromptKey, group_by_prefix
from loraplex.errors import UnknownAdapterError
from tests.engine.test_hf_parity import MAX_TOKENS, _hf_references
from tests.engine.test_relay_prefix import GroupLog
from tests.factories import ADAPTERS, make_adapter, make_hf_model

BLOCK_SIZE = 4
PREFIX_LEN = 13  # 3 full blocks and one token


# The prefix tree ------------------------------------------------------------------------------
def _key(tokens: list[int], tenant: str = "t", adapter: str | None = "a") -> PromptKey:
    return PromptKey(tenant, adapter, tokens)


def test_groups_follow_the_prefix_tree_and_share_whole_blocks() -> None:
    p, q = list(range(100, 108)), list(range(200, 208))  # two blocks each
    keys = [
        _key(q + [1, 2]),          # 0: group q
        _key(p + [5]),             # 1: group p
        _key([7, 8, 9]),           # 2: alone (shares nothing)
        _key(q + [3]),             # 3: group q
        _key(p + [9, 9, 9, 9, 1]),  # 4: group p, shares 3 blocks with 5
        _key(p + [9, 9, 9, 9, 2]),  # 5
        _key(p[:6] + [0, 0, 0]),   # 6: shares one block with p's prompts
    ]
    groups = group_by_prefix(keys, block_size=4)
    assert sorted(i for g in groups for i in g.members) == list(range(len(keys)))
    by_member = {i: g for g in groups for i in g.members}
    assert by_member[1] is by_member[4] is by_member[5] is by_member[6]
    assert by_member[1].num_shared_blocks == 1  # what all four start with
    members = by_member[1].members
    assert abs(members.index(4) - members.index(5)) == 1  # the deeper subgroup sits together
    assert by_member[0] is by_member[3] and by_member[0].num_shared_blocks == 2
    assert by_member[2].members == (2,) and by_member[2].num_shared_blocks == 0


def test_tenants_adapters_and_the_last_token_keep_prompts_apart() -> None:
    shared = list(range(1, 9))  # two blocks
    keys = [_key(shared + [1]), _key(shared + [2], tenant="u"), _key(shared + [3], adapter="b"),
            _key(shared + [4], adapter=None), _key(shared[:5])]
    groups = group_by_prefix(keys, block_size=4)
    # The last has one whole block before its last token and shares it with the first.
    assert sorted(sorted(g.members) for g in groups) == [[0, 4], [1], [2], [3]]
    assert next(g for g in groups if 0 in g.members).num_shared_blocks == 1
    # A prompt of exactly the shared blocks shares one block less: it computes its last token.
    two = group_by_prefix([_key(shared), _key(shared + [5, 6])], block_size=4)
    assert [g.num_shared_blocks for g in two] == [1]


# The engine -------------------------------------------------------------------------------------
# (prefix, adapter, tenant, members): groups whose prefixes nobody registered; the same prefix
# text under another adapter and another tenant never joins the first group.
GROUPS = (("x", "qv4", "t1", 4), ("y", "all8", "t1", 4), ("z", None, "t1", 3),
          ("x", "all8", "t1", 2), ("x", "qv4", "t2", 2))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grouping")
    hf = make_hf_model("llama", folder / "model")
    specs = [spec for spec in ADAPTERS if spec.name in ("qv4", "all8")]
    adapters = {spec.name: make_adapter(hf, spec, folder / "adapters", seed=i + 1)
                for i, spec in enumerate(specs)}
    generator = torch.Generator().manual_seed(21)
    prefixes = {name: torch.randint(3, 300, (PREFIX_LEN,), generator=generator).tolist() for name in "xyz"}
    rows = []  # (prompt, adapter, tenant, group index)
    for g, (prefix, adapter, tenant, count) in enumerate(GROUPS):
        for _ in range(count):
            own = torch.randint(3, 300, (int(torch.randint(1, 7, (1,), generator=generator)),),
                                generator=generator).tolist()
            rows.append((prefixes[prefix] + own, adapter, tenant, g))
    random.Random(3).shuffle(rows)  # the batch's order mixes the groups
    references = _hf_references(hf, adapters, [r[0] for r in rows], [r[1] for r in rows])
    return folder / "model", adapters, rows, [tokens for tokens, _ in references]


def _llm(case, **options) -> LLM:
    model_dir, adapters, _, _ = case
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_num_seqs=4,
              max_num_batched_tokens=32, relay_attention="always", **options)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    # Adapters load on their own threads: load them now, so that when a group's members start
    # does not depend on when their adapter's load ends.
    llm.generate(prompt_token_ids=[[5]] * len(adapters), adapters=list(adapters),
                 sampling_params=SamplingParams(max_tokens=1))
    llm.engine.blocks.reset_prefix_cache()
    return llm


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("group_prefixes", [True, False], ids=["grouped", "in-order"])
@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "no-cache"])
def test_grouped_batches_are_token_exact(case, monkeypatch, group_prefixes, prefix_cache) -> None:
    _, _, rows, references = case
    log = GroupLog(monkeypatch)
    llm = _llm(case, enable_prefix_caching=prefix_cache)
    outputs = llm.generate(prompt_token_ids=[r[0] for r in rows], sampling_params=_params(),
                           adapters=[r[1] for r in rows], tenants=[r[2] for r in rows],
                           group_prefixes=group_prefixes)
    assert [o.token_ids for o in outputs] == references
    group_of = {o.request_id: r[3] for o, r in zip(outputs, rows)}
    for relay_group in log.groups:  # relay groups never mix prompt groups
        assert len({group_of[request_id] for request_id in relay_group}) == 1
    assert llm.engine.blocks.num_used_blocks == 0


def test_grouped_members_decode_as_one_relay_group(case, monkeypatch) -> None:
    _, _, rows, _ = case
    largest = {}
    for grouped in (False, True):
        log = GroupLog(monkeypatch)
        llm = _llm(case)
        outputs = llm.generate(prompt_token_ids=[r[0] for r in rows], sampling_params=_params(),
                               adapters=[r[1] for r in rows], tenants=[r[2] for r in rows],
                               group_prefixes=grouped)
        group_of = {o.request_id: r[3] for o, r in zip(outputs, rows)}
        largest[grouped] = {g: max((len(rg) for rg in log.groups if group_of[next(iter(rg))] == g), default=0)
                            for g in range(len(GROUPS))}
    # Grouped, both groups of four decode together (a running place each: max_num_seqs is 4);
    # in the batch's order their members are spread over time.
    assert largest[True][0] == largest[True][1] == 4
    assert largest[False][0] < 4 and largest[False][1] < 4


def test_each_shared_prefix_is_computed_once_and_held_briefly(case) -> None:
    _, _, rows, references = case
    peaks, hits = {}, {}
    for grouped in (False, True):
        llm = _llm(case)
        blocks = llm.engine.blocks
        blocks.peak_used_blocks = 0
        requests = [BatchRequest(f"r{i}", tokens, _params(), adapter, tenant)
                    for i, (tokens, adapter, tenant, _) in enumerate(rows)]
        outputs = run_batch(llm.engine, requests, group_prefixes=grouped)
        assert [o.token_ids for o in outputs] == references
        peaks[grouped], hits[grouped] = blocks.peak_used_blocks, blocks.num_hit_tokens
    # Grouped, each group's first member computes the 3 prefix blocks and every other member
    # takes them from the cache.
    assert hits[True] == sum(count - 1 for *_, count in GROUPS) * 3 * BLOCK_SIZE
    assert hits[False] <= hits[True]
    # Four running requests of one group hold one prefix; four of mixed groups hold several.
    assert peaks[True] < peaks[False]


def test_an_unknown_adapter_fails_before_anything_runs(case) -> None:
    _, _, rows, _ = case
    llm = _llm(case)
    with pytest.raises(UnknownAdapterError, match="nope"):
        llm.generate(prompt_token_ids=[rows[0][0], rows[1][0]], sampling_params=_params(),
                     adapters=["qv4", "nope"])
    assert llm.engine.num_requests == 0 and not llm.engine.has_unfinished_requests()


def test_a_batch_sharing_nothing_keeps_its_order() -> None:
    keys = [_key([9, 1]), _key([1, 2, 3, 4, 5, 6]), _key([5]), _key([1, 2, 3, 4, 7, 7])]
    groups = group_by_prefix(keys, block_size=4)
    assert [g.members for g in groups] == [(0,), (1, 3), (2,)]
