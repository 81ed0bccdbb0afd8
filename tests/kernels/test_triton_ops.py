import dataclasses
import inspect

from loraplex.kernels import Ops, reference_ops
from loraplex.kernels.triton_ops import triton_ops


def _positional(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def test_every_op_is_a_triton_wrapper_with_the_reference_signature():
    ops, ref = triton_ops(), reference_ops()
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
