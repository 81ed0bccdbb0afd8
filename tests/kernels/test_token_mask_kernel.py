"""The token-mask kernel (structured outputs) against the reference: only the masked rows
change, -inf exactly where their bits are clear, padding rows (-1) do nothing."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.reference import mask_logits as reference_mask_logits
from loraplex.kernels.token_mask import BLOCK, mask_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_bitmask(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2**32, (num_rows, -(-vocab // 32)), generator=generator, dtype=torch.int64)
    return (bits - 2**31).to(torch.int32).to(DEVICE)  # every bit pattern, the sign bit included


@pytest.mark.parametrize("batch, vocab", [(3, 37), (4, BLOCK + 40), (2, 2 * BLOCK)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_logits_matches_reference(batch, vocab, dtype):
    torch.manual_seed(batch * vocab)
    logits = torch.randn(batch, vocab, device=DEVICE).to(dtype)
    rows = torch.tensor([batch - 1, -1, 0], dtype=torch.int64, device=DEVICE)
    bitmask = random_bitmask(3, vocab, seed=vocab)
    out = mask_logits(logits, rows, bitmask)
    assert torch.equal(out, reference_mask_logits(logits, rows, bitmask))
    assert torch.equal(out[1:-1], logits[1:-1])  # unmasked rows: unchanged
    assert torch.isinf(out[0]).any() and not torch.isinf(logits).any()


def test_all_ones_changes_nothing_and_no_rows_is_a_copy():
    logits = torch.randn(2, 100, device=DEVICE)
    ones = torch.full((2, 4), -1, dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([0, 1], device=DEVICE)
    assert torch.equal(mask_logits(logits, rows, ones), logits)
    empty = mask_logits(logits, rows[:0], ones[:0])
    assert torch.equal(empty, logits) and empty.data_ptr() != logits.data_ptr()
    with pytest.raises(ValueError, match="words"):
        mask_logits(logits, rows, ones[:, :3].contiguous())
