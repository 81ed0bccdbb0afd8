"""llama.project hands every LoRA shrink and expand of a forward pass the one work split
(Ops.lone_split) that the first layer needing it made: inside a CUDA graph's capture, so that a
replay remakes it from the step's adapter slots."""

import dataclasses
from types import SimpleNamespace

import torch

from loraplex.kernels import reference_ops
from loraplex.model.context import ForwardContext, LoraMetadata, forward_context
from loraplex.model.llama import project


def _group(out_features: int, rank: int) -> SimpleNamespace:
    """What project reads of a layer's group (the ops here never look at the tables)."""
    return SimpleNamespace(in_scale_at=None, max_rank=rank, pool=None, vectors=None, a_pages=None,
                           b_pages=None, ranks=None, slice_offsets=(0, out_features), scale_at=None,
                           shift_at=None)


def test_one_split_a_forward_pass_reaches_every_shrink_and_expand():
    made, seen = [], []

    def lone_split(token_slots):
        made.append(token_slots)
        return ("split", len(made))

    def shrink(x, pool, a_pages, slots, ranks, max_rank, split):
        seen.append(("shrink", split))
        return torch.zeros(1, x.shape[0], max_rank)

    def expand(y, shrunk, pool, b_pages, slots, ranks, offsets, vectors, scale_at, shift_at, split):
        seen.append(("expand", split))
        return y

    ops = dataclasses.replace(reference_ops(), lone_split=lone_split, lora_shrink_paged=shrink,
                              lora_expand_paged=expand)
    groups = {"qkv": _group(12, 4), "o": _group(8, 4)}
    buffers = SimpleNamespace(group=lambda layer, name: groups[name])
    slots = torch.tensor([1, 0, 1], dtype=torch.int32)
    x = torch.randn(3, 8)
    for step in range(2):
        lora = LoraMetadata(slots, buffers)
        with forward_context(ForwardContext(None, None, lora)):
            for layer in range(2):
                project(layer, "qkv", ops, x, torch.randn(12, 8))
                project(layer, "o", ops, x[:, :4], torch.randn(8, 4))
        assert len(made) == step + 1  # one a forward pass
        assert made[-1] is slots
    assert [split for _, split in seen] == [("split", 1)] * 8 + [("split", 2)] * 8


def test_ops_that_make_no_split_pass_none():
    seen = []
    base = reference_ops()

    def shrink(*args):
        seen.append(args[-1])
        return base.lora_shrink_paged(*args)

    ops = dataclasses.replace(base, lora_shrink_paged=shrink, lora_expand_paged=lambda *args: args[0])
    group = _group(8, 4)
    group.pool = torch.zeros(64)
    group.a_pages = torch.zeros(2, 1, 1, dtype=torch.int64)
    group.ranks = torch.zeros(2, 1, dtype=torch.int32)
    buffers = SimpleNamespace(group=lambda layer, name: group)
    lora = LoraMetadata(torch.tensor([1, 0], dtype=torch.int32), buffers)
    with forward_context(ForwardContext(None, None, lora)):
        project(0, "o", ops, torch.randn(2, 4), torch.randn(8, 4))
        project(1, "o", ops, torch.randn(2, 4), torch.randn(8, 4))
    assert seen == [None, None]
