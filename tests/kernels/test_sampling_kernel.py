"""Sampling is checked statistically (frequencies against the reference's filtered
distribution), by support (top-k / top-p), by reproducibility per (seed, offset), and greedy
rows against argmax. The draws are a deterministic function of the seeds, so each test
either always passes or always fails."""

import pytest
import torch

from loraplex.kernels import sampling
from tests.kernels.kernel_testing import DEVICE, gpu, poisoned_allocations, skip_without_cuda


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The distribution the reference samples from, for one row, in float64."""
    scaled = logits.double() / max(temperature, 1e-6)
    sorted_logits, order = scaled.sort(descending=True)
    if 0 < top_k < len(scaled):
        sorted_logits[top_k:] = float("-inf")
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    sorted_logits[mass_before >= top_p] = float("-inf")
    out = torch.zeros_like(scaled)
    out[order] = sorted_logits.softmax(-1)
    return out


def draw(logits_row, num_draws, temperature, top_k, top_p, *, seed=7, dtype=torch.float32,
         device=DEVICE, chunk=65536):
    """num_draws samples of one row: batches of the same (stride-0) row, offsets 0.."""
    tokens = []
    for first in range(0, num_draws, chunk):
        n = min(chunk, num_draws - first)
        logits = logits_row.to(device, dtype).unsqueeze(0).expand(n, -1)
        full = lambda value, dt, n=n: torch.full((n,), value, dtype=dt, device=device)
        tokens.append(sampling.sample(
            logits, full(temperature, torch.float32), full(top_k, torch.int32),
            full(top_p, torch.float32), full(seed, torch.int64),
            torch.arange(first, first + n, dtype=torch.int64, device=device),
        ))
    return torch.cat(tokens)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=len(probs)).double()
    expected = probs.cpu() * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a token of probability 0"
    return (((counts - expected)[support] ** 2) / expected[support]).sum().item()


# chi-square bound at p ~ 1e-4 for up to 9 degrees of freedom
CHI2_BOUND = 34.0
LOGITS = torch.tensor([2.0, 1.6, 1.5, 1.0, 0.9, 0.2, -0.5, -1.0, -3.0, 0.7]) * 2


@pytest.mark.parametrize("temperature,top_k,top_p,num_draws", [
    (1.0, 0, 1.0, 600),  # temperature alone: 0.8x or 1.25x the temperature fails
    (1.3, 6, 0.9, 200),  # top-k, then top-p
])
def test_frequencies_follow_the_reference_distribution(temperature, top_k, top_p, num_draws):
    probs = filtered_probs(LOGITS, temperature, top_k, top_p)
    with poisoned_allocations(sampling):
        tokens = draw(LOGITS, num_draws, temperature, top_k, top_p)
    assert chi_square(tokens, probs) < CHI2_BOUND


# Logits with well-separated boundaries; at a high temperature every kept token has a fair
# chance, so 60 draws show the whole kept set (each misses with probability < 1e-4).
SUPPORT_LOGITS = torch.tensor([9.0, 3.0, 8.0, 7.5, 1.0, 7.0, 8.5, 6.0, 2.0, 6.5, 0.0, 5.0])
SUPPORT_CASES = [(4, 1.0, 5.0), (0, 0.6, 4.0), (7, 0.75, 6.0)]  # (top_k, top_p, temperature)


def _assert_draws_cover_support(tokens, probs):
    drawn = torch.zeros_like(probs, dtype=torch.bool)
    drawn[tokens.cpu()] = True
    assert torch.equal(drawn, probs > 0), (drawn.nonzero().flatten(), (probs > 0).nonzero())


@pytest.mark.parametrize("top_k,top_p,temperature", SUPPORT_CASES)
def test_kept_set_is_exactly_the_reference_one(top_k, top_p, temperature):
    probs = filtered_probs(SUPPORT_LOGITS, temperature, top_k, top_p)
    assert probs[probs > 0].min() > 0.12  # the case keeps its promise above
    _assert_draws_cover_support(draw(SUPPORT_LOGITS, 60, temperature, top_k, top_p), probs)


def test_tokens_tied_at_the_top_k_boundary_are_all_kept():
    logits = torch.tensor([5.0, 4.0, 1.0, 4.0, 0.0, 4.0, -1.0, 2.0])
    support = tie_inclusive_support(logits, 8.0, 2, 1.0)
    assert support.tolist() == [True, True, False, True, False, True, False, False]
    _assert_draws_cover_support(draw(logits, 60, 8.0, 2, 1.0, dtype=torch.float16),
                                support.double())


def test_kept_set_on_the_whole_row_path(monkeypatch):
    """Too many candidates for the scratch row: the searches run over the row itself."""
    monkeypatch.setattr(sampling, "MAX_CAND", 2)
    top_k, top_p, temperature = SUPPORT_CASES[2]
    probs = filtered_probs(SUPPORT_LOGITS, temperature, top_k, top_p)
    _assert_draws_cover_support(draw(SUPPORT_LOGITS, 60, temperature, top_k, top_p), probs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_rows_take_the_first_argmax(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 1500, generator=g)  # two tiles
    logits[1, 1200] = 50.0
    logits[2, 7] = logits[2, 900] = 60.0  # tie: the first index wins
    logits = logits.to(DEVICE, dtype)
    temperature = torch.tensor([0.0, -1.0, 0.0], device=DEVICE)
    out = sampling.sample(logits, temperature, torch.zeros(3, dtype=torch.int32, device=DEVICE),
                          torch.ones(3, device=DEVICE), torch.zeros(3, dtype=torch.int64,
                          device=DEVICE), torch.zeros(3, dtype=torch.int64, device=DEVICE))
    assert out.dtype == torch.int64
    assert out.tolist() == [int(logits[0].float().argmax()), 1200, 7]


def test_samples_stay_in_the_top_k_and_top_p_support():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1500, generator=g) * 2  # two tiles
    for top_k, top_p in [(3, 1.0), (0, 0.5), (40, 0.6)]:  # tokens spread over both tiles
        support = filtered_probs(logits, 1.0, top_k, top_p) > 0
        tokens = draw(logits, 12, 1.0, top_k, top_p, seed=top_k)
        assert support[tokens.cpu()].all(), (top_k, top_p)


def test_draws_depend_on_seed_and_offset_alone():
    g = torch.Generator().manual_seed(2)
    batch = 6
    logits = torch.randn(batch, 64, generator=g).to(DEVICE)
    temperature = torch.tensor([1.0, 0.8, 1.2, 1.0, 0.0, 1.0], device=DEVICE)
    top_k = torch.tensor([0, 5, 0, 10, 0, 0], dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.7, 1.0, 1.0], device=DEVICE)
    seeds = torch.tensor([1, 2, 3, 4, 5, 1], dtype=torch.int64, device=DEVICE)
    offsets = torch.tensor([0, 0, 3, 9, 0, 1], dtype=torch.int64, device=DEVICE)
    args = (logits, temperature, top_k, top_p, seeds, offsets)
    first = sampling.sample(*args)
    assert torch.equal(first, sampling.sample(*args))
    order = torch.tensor([5, 3, 1, 0, 2, 4], device=DEVICE)  # another batch layout
    shuffled = sampling.sample(*(t[order] for t in args))
    assert torch.equal(shuffled, first[order])
    alone = sampling.sample(*(t[2:3] for t in args))
    assert torch.equal(alone, first[2:3])
    # Another offset is another draw: 40 offsets of one flat row give many tokens.
    assert len(set(draw(torch.zeros(64), 40, 1.0, 0, 1.0).tolist())) > 10


def test_wrapper_rejects_bad_inputs():
    logits = torch.zeros(2, 8, device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    ints = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="seeds"):
        sampling.sample(logits, ones, ints, ones, ints.int(), ints)
    with pytest.raises(ValueError, match="top_k"):
        sampling.sample(logits, ones, ones, ones, ints, ints)
    with pytest.raises(ValueError, match="temperature"):
        sampling.sample(logits, ones[:1], ints, ones, ints, ints)


@gpu
@skip_without_cuda
@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9), (0.9, 100, 0.95), (1.5, 500, 0.9),
])
def test_frequencies_over_a_million_draws(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(1000, generator=g) * 3
    probs = filtered_probs(logits, temperature, top_k, top_p)
    tokens = draw(logits, 1_000_000, temperature, top_k, top_p, device="cuda")
    freq = torch.bincount(tokens.cpu(), minlength=1000).double() / len(tokens)
    assert freq[probs == 0].sum() == 0
    assert torch.nn.functional.cosine_similarity(freq, probs, dim=0) > 0.99
    assert (freq - probs).abs().max() < 3e-3


def tie_inclusive_support(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """The kernel's kept set: the reference's, plus every token tied with its last member
    (the reference cuts ties by sort order; 16-bit logits tie often)."""
    scaled = logits.double() / temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < top_k < len(scaled):
        keep = scaled >= scaled.sort(descending=True).values[top_k - 1]
    probs = torch.where(keep, (scaled - scaled.max()).exp(), 0.0)
    probs = probs / probs.sum()
    values, order = scaled.sort(descending=True)
    sorted_probs = probs[order]
    # mass strictly above each value: the cumulative mass before its first tie
    first = torch.searchsorted(-values, -values, side="left")
    mass_above = (sorted_probs.cumsum(0) - sorted_probs)[first]
    kept = torch.zeros_like(keep)
    kept[order] = (mass_above < top_p) & keep[order]
    return kept


@gpu
@skip_without_cuda
def test_llama_vocab_support_and_greedy():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(128256, generator=g) * 4
    for dtype in (torch.float32, torch.bfloat16):
        rounded = logits.to(dtype).float()
        for top_k, top_p in [(50, 1.0), (0, 0.9), (1000, 0.8), (40000, 0.95)]:
            support = tie_inclusive_support(rounded, 1.0, top_k, top_p)
            assert support.sum() >= (filtered_probs(rounded, 1.0, top_k, top_p) > 0).sum()
            tokens = draw(logits, 4096, 1.0, top_k, top_p, device="cuda", dtype=dtype)
            assert support[tokens.cpu()].all(), (dtype, top_k, top_p)
            if top_k == 50:  # a small kept set: all of it shows up in 4096 draws
                drawn = torch.zeros_like(support)
                drawn[tokens.cpu()] = True
                hits = filtered_probs(rounded, 1.0, top_k, top_p) > 2e-3
                assert drawn[hits].all()
    greedy = draw(logits, 8, 0.0, 0, 1.0, device="cuda")
    assert (greedy.cpu() == logits.argmax()).all()
