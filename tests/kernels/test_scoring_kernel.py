"""Scoring tokens under rows of logits (prompt log-probabilities) against the reference:
log-probability, rank and the top token, across chunk boundaries, with ties and strided rows."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.reference import score_tokens as reference_score_tokens
from loraplex.kernels.scoring import CHUNK, score_tokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    ours, expected = score_tokens(logits, targets), reference_score_tokens(logits, targets)
    assert torch.allclose(ours[:, [0, 2]], expected[:, [0, 2]], atol=1e-5, rtol=1e-5)
    assert torch.equal(ours[:, [1, 3]], expected[:, [1, 3]])  # rank and top index: exact


@pytest.mark.parametrize("rows, vocab", [(1, 7), (3, CHUNK + 5), (5, 2 * CHUNK), (2, 3 * CHUNK - 1)])
def test_scores_match_the_reference(rows, vocab):
    torch.manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, device=DEVICE) * 4
    targets = torch.randint(0, vocab, (rows,), device=DEVICE)
    targets[0] = vocab - 1  # the last token, past the last full chunk
    _check(logits, targets)


def test_ties_and_ranks_across_chunks():
    logits = torch.full((3, 2 * CHUNK + 3), -1.0, device=DEVICE)
    logits[0, [5, CHUNK + 1, 2 * CHUNK + 2]] = 3.0  # the max tied in three chunks
    logits[1, [2 * CHUNK + 2, CHUNK + 7]] = 4.0
    logits[2, 17] = 2.0
    targets = torch.tensor([CHUNK + 1, 3, 17], device=DEVICE)
    out = score_tokens(logits, targets)
    assert out[:, 3].tolist() == [5, CHUNK + 7, 17]  # the first index of the max
    assert out[:, 1].tolist() == [1, 3, 1]  # ties with the target do not count against it
    _check(logits, targets)


def test_strided_rows_and_empty_batch():
    wide = torch.randn(4, 300, device=DEVICE)
    rows = wide[:, :250]
    _check(rows, torch.tensor([0, 249, 100, 7], device=DEVICE))
    assert score_tokens(torch.empty(0, 10, device=DEVICE), torch.empty(0, dtype=torch.int64,
                                                                       device=DEVICE)).shape == (0, 4)
    with pytest.raises(ValueError, match="logits"):
        score_tokens(torch.randn(2, 10, device=DEVICE).half(), torch.zeros(2, dtype=torch.int64,
                                                                            device=DEVICE))


@pytest.mark.gpu
def test_scores_at_llama3_vocab():
    logits = torch.randn(300, 128256, device="cuda") * 3
    targets = torch.randint(0, 128256, (300,), device="cuda")
    _check(logits, targets)
