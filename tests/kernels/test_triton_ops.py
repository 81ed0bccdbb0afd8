import dataclasses
import inspect

import pytest

from loraplex.kernels import Ops, reference_ops
from loraplex.kernels.triton_ops import triton_ops


def _positional(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


@pytest.mark.parametrize("check_inputs", [True, False])
def test_every_op_is_a_triton_wrapper_with_the_reference_signature(check_inputs):
    ops, ref = triton_ops(check_inputs), reference_ops()
    assert ops.name == "triton"
    for field in dataclasses.fields(Ops):
        if field.name == "name":
            continue
        kernel, oracle = getattr(ops, field.name), getattr(ref, field.name)
        assert kernel is not oracle
        assert kernel.__module__.startswith("loraplex.kernels.")
        assert kernel.__module__ != "loraplex.kernels.reference"
        assert _positional(kernel) == _positional(oracle), field.name
        # Optional keywords of the wrapper exist on the reference too (which ignores them).
        extra = set(inspect.signature(kernel).parameters) - set(_positional(kernel))
        assert extra <= set(inspect.signature(oracle).parameters), field.name


LAYER_OPS = {"rms_norm", "fused_add_rms_norm", "rotary_store_kv", "paged_attention", "silu_and_mul",
             "lora_shrink_paged", "lora_expand_paged"}


def test_the_engine_set_skips_the_checks_of_the_layer_ops_only():
    checked, engine = triton_ops(), triton_ops(check_inputs=False)
    names = [f.name for f in dataclasses.fields(Ops)]
    differ = {name for name in names if getattr(checked, name) is not getattr(engine, name)}
    assert differ == LAYER_OPS
    for name in LAYER_OPS:
        assert getattr(engine, name).__name__ == f"{name}_unchecked"
        assert getattr(engine, name).__module__ == getattr(checked, name).__module__
