"""The two-stage argmax against torch.argmax (first index of the maximum)."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.argmax import CHUNK, argmax
from loraplex.kernels.reference import argmax as reference_argmax

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows, vocab", [(1, 7), (3, CHUNK + 5), (2, 2 * CHUNK)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_argmax_matches_reference(rows, vocab, dtype):
    torch.manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, device=DEVICE).to(dtype)
    assert torch.equal(argmax(logits), reference_argmax(logits))


def test_ties_go_to_the_lowest_index_across_chunks():
    logits = torch.full((2, 2 * CHUNK + 3), -1.0, device=DEVICE)
    logits[0, [5, CHUNK + 1, 2 * CHUNK + 2]] = 3.0  # tie in three chunks
    logits[1, [2 * CHUNK + 2, CHUNK + 7]] = 4.0
    assert argmax(logits).tolist() == [5, CHUNK + 7]


def test_strided_rows_and_empty_batch():
    wide = torch.randn(4, 300, device=DEVICE)
    rows = wide[:, :250]  # rows stride 300, contiguous within a row
    assert torch.equal(argmax(rows), rows.argmax(-1))
    assert argmax(torch.empty(0, 10, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="unit stride"):
        argmax(wide.t())  # check_tensor refuses a non-unit last stride


@pytest.mark.gpu
def test_argmax_at_llama3_vocab_bf16():
    logits = torch.randn(64, 128256, device="cuda").to(torch.bfloat16)
    assert torch.equal(argmax(logits), logits.argmax(-1))
