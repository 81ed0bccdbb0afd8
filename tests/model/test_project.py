"""Every LoRA shrink and expand of a forward pass follows the one work split (Ops.lone_split)
that the model runner made for it (LoraMetadata.split); the runner makes it once a pass, inside
the pass (so inside a CUDA graph's capture, and a replay remakes it from the step's slots)."""

import dataclasses
from types import SimpleNamespace

import torch

from loraplex.benchmarks import synthetic_server as server
from loraplex.kernels import reference_ops
from loraplex.model.context import ForwardContext, LoraMetadata, forward_context
from loraplex.model.llama import project
from loraplex.types import SamplingParams

TINY = ('{"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "num_hidden_layers": 2}')


def _group(out_features: int, rank: int) -> SimpleNamespace:
    """What project reads of a layer's group (the ops here never look at the tables)."""
    return SimpleNamespace(in_scale_at=None, max_rank=rank, pool=None, vectors=None, a_pages=None,
                           b_pages=None, ranks=None, slice_offsets=(0, out_features), scale_at=None,
                           shift_at=None)


def test_project_hands_the_passes_split_to_every_shrink_and_expand():
    seen = []

    def shrink(x, pool, a_pages, slots, ranks, max_rank, split):
        seen.append(("shrink", split))
        return torch.zeros(1, x.shape[0], max_rank)

    def expand(y, shrunk, pool, b_pages, slots, ranks, offsets, vectors, scale_at, shift_at, split):
        seen.append(("expand", split))
        return y

    ops = dataclasses.replace(reference_ops(), lora_shrink_paged=shrink, lora_expand_paged=expand)
    groups = {"qkv": _group(12, 4), "o": _group(8, 4)}
    buffers = SimpleNamespace(group=lambda layer, name: groups[name])
    split = object()
    lora = LoraMetadata(torch.tensor([1, 0, 1], dtype=torch.int32), buffers, split=split)
    with forward_context(ForwardContext(None, None, lora)):
        for layer in range(2):
            project(layer, "qkv", ops, torch.randn(3, 8), torch.randn(12, 8))
            project(layer, "o", ops, torch.randn(3, 4), torch.randn(8, 4))
    assert seen == [(kind, split) for _ in range(4) for kind in ("shrink", "expand")]


def test_the_runner_makes_one_split_a_forward_pass_from_the_steps_slots():
    args = server.parse_args(["--setup", "unused.json", "--device", "cpu", "--model-overrides", TINY,
                              "--num-adapters", "4", "--num-tenants", "2", "--max-model-len", "256"])
    engine = server.build_engine(args)
    try:
        server.prepare_engine(engine, args)
        made, forwards = [], []
        runner = engine.runner
        runner.ops = dataclasses.replace(runner.ops, lone_split=lambda slots: made.append(slots.clone()))
        forward = runner.forward
        runner.forward = lambda shape, *args: forwards.append(shape.num_tokens) or forward(shape, *args)
        for i in range(3):
            engine.add_request(f"r{i}", prompt_token_ids=[5 + i] * 20, params=SamplingParams(max_tokens=3),
                               adapter=server.synthetic_digest(i), tenant="t000")
        while engine.has_unfinished_requests():
            engine.step()
        # One split a pass, every pass carrying adapters, over that pass's tokens.
        assert [len(slots) for slots in made] == forwards and forwards
        assert all(slots.dtype == torch.int32 and bool((slots > 0).any()) for slots in made)
        assert sum(forwards) >= 60 + 3 * 2  # the prompts, then the decodes
    finally:
        engine.close()
