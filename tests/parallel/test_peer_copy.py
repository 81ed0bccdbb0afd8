"""loraplex/worker/peer_copy.py on the CPU: what it refuses, and torch's copy where it cannot
copy directly (its direct path, one cudaMemcpyAsync to the peer GPU, is tests/parallel/
test_engine_tp_gpu.py's)."""

import pytest
import torch

from loraplex.worker.peer_copy import copy_to_peer


def test_without_a_direct_path_it_is_torch_copy():
    source, target = torch.arange(12.0).view(3, 4), torch.zeros(3, 4)
    copy_to_peer(target, source, direct=False)
    assert torch.equal(target, source)


@pytest.mark.parametrize("target", [torch.zeros(4, 3).t(), torch.zeros(3, 4, dtype=torch.float16),
                                    torch.zeros(2, 4)], ids=["strided", "dtype", "shape"])
def test_tensors_that_one_copy_cannot_take_are_refused(target):
    with pytest.raises(ValueError, match="contiguous tensors of one dtype and shape"):
        copy_to_peer(target, torch.zeros(3, 4), direct=True)
