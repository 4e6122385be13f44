"""Every op of the catalog against torch itself.

For each op, Hypothesis draws a few input shapes and attributes through the
op's own generator; the test then checks the op's declared rules against what
torch does (output shapes, output dtype under mixed float32/float64 inputs),
its rendered source against its implementation, and its backward with
``torch.autograd.gradcheck`` in float64: an independent check of the
gradients the fuzzer will compare (for the custom ``autograd.Function`` s,
a check of their hand-written backwards).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz import functions
from fuzz import ops as catalog
from fuzz.render import ref_expr
from tests.conftest import examples

ALL_OPS = sorted(catalog.OPS)
SMALL_DIM = 3  # keeps gradcheck's numerical Jacobians tiny


def test_catalog_has_the_required_breadth() -> None:
    assert len(catalog.OPS) >= 25
    cats = catalog.categories()
    for needed in ("unary", "binary", "reduction", "matmul", "view", "softmax", "where", "join", "split"):
        assert cats.get(needed), needed
    for name in ("view", "transpose", "permute", "expand", "slice", "matmul", "bmm", "softmax", "where", "cat", "split"):
        assert name in catalog.OPS, name


def test_register_rejects_duplicates_and_get_names_unknown_ops() -> None:
    with pytest.raises(ValueError, match="already registered"):
        catalog.register(catalog.OPS["neg"])
    with pytest.raises(KeyError, match="unknown op 'nope'"):
        catalog.get("nope")


def _draw_case(data: st.DataObject, spec: catalog.OpSpec):
    """Input shapes (first one small), attributes and input dtypes."""
    ranks = [r for r in range(catalog.MAX_RANK) if spec.accepts((1,) * r) or spec.accepts((2,) * r)]
    rank = data.draw(st.sampled_from(ranks), label="rank")
    first = tuple(data.draw(st.lists(st.integers(1, SMALL_DIM), min_size=rank, max_size=rank), label="shape"))
    if not spec.accepts(first):
        first = (2,) * rank if spec.accepts((2,) * rank) else (1,) * rank
    others, attrs = spec.plan(data.draw, first)
    shapes = [first] + [tuple(s) for s in others]
    if spec.dtype_rule == "same":
        dtypes = [data.draw(st.sampled_from(["float64", "float32"]), label="dtype")] * len(shapes)
    else:
        dtypes = [data.draw(st.sampled_from(["float64", "float32"]), label=f"dtype{i}") for i in range(len(shapes))]
    return shapes, attrs, dtypes


def _inputs(shapes, dtypes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in zip(shapes, dtypes):
        t = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1
        out.append(t.to(catalog.TORCH_DTYPES[dtype]).requires_grad_(True))
    return out


def _writable(spec: catalog.OpSpec, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """An op that writes into its first input gets a non-leaf copy of it."""
    if spec.inplace_first:
        return [tensors[0] * 1] + list(tensors[1:])
    return tensors


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


@pytest.mark.parametrize("name", ALL_OPS)
@settings(max_examples=examples(10))
@given(data=st.data())
def test_op_rules_match_torch_and_gradients_check(name: str, data: st.DataObject) -> None:
    spec = catalog.OPS[name]
    shapes, attrs, dtypes = _draw_case(data, spec)
    catalog.check_attrs(spec, attrs)
    expected_shapes = spec.infer(shapes, attrs)
    expected_dtype = spec.out_dtype(dtypes, attrs, shapes)

    # declared shape and dtype rules = what torch does, mixed dtypes included
    # (every run from one seed: random ops draw the same numbers each time)
    torch.manual_seed(0)
    outs = _as_tuple(spec.run(_writable(spec, _inputs(shapes, dtypes, seed=len(name))), attrs))
    assert [tuple(o.shape) for o in outs] == [tuple(s) for s in expected_shapes]
    assert all(o.dtype == catalog.TORCH_DTYPES[expected_dtype] for o in outs)
    assert len(outs) == len(expected_shapes) and (spec.multi_output or len(outs) == 1)

    # the rendered source computes the same values (fresh inputs: in-place
    # ops must not see the first run's writes)
    tensors = _writable(spec, _inputs(shapes, dtypes, seed=len(name)))
    names = [f"t{i}" for i in range(len(tensors))]
    namespace = {"torch": torch, **functions.FUNCTIONS, **dict(zip(names, tensors))}
    torch.manual_seed(0)
    exec("\n".join(spec.statements("out", names, attrs)), namespace)  # noqa: S102 - our own rendering
    for a, b in zip(outs, _as_tuple(namespace["out"])):
        assert torch.equal(a, b)
    # ops that return their first input itself do so exactly when they say
    assert (namespace["out"] is tensors[0]) == spec.is_identity(shapes, dtypes, attrs)

    # gradients: analytic (torch's backward formulas) against finite differences
    # (a cast to float32 has no float64 finite differences: check it as a
    # float64 -> float64 cast; its float32 dtype rule was checked above)
    inputs64 = _inputs(shapes, ["float64"] * len(shapes), seed=len(name))
    diff = [j for j in range(len(inputs64)) if j not in spec.nondiff_inputs]
    attrs64 = dict(attrs, dtype="float64") if spec.dtype_rule == "attr" else attrs

    def fn(*xs: torch.Tensor):
        full = list(inputs64)
        for j, x in zip(diff, xs):
            full[j] = x
        torch.manual_seed(0)
        return spec.run(_writable(spec, full), attrs64)

    assert torch.autograd.gradcheck(fn, tuple(inputs64[j] for j in diff), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_zero_dim_inputs_do_not_promote() -> None:
    spec = catalog.OPS["add"]
    assert spec.out_dtype(["float32", "float64"], {}, [(3,), ()]) == "float32"
    assert spec.out_dtype(["float32", "float64"], {}, [(), ()]) == "float64"
    assert spec.out_dtype(["float32", "float64"], {}, [(3,), (1,)]) == "float64"
    with pytest.raises(catalog.DTypeError):
        catalog.OPS["matmul"].out_dtype(["float32", "float64"], {}, [(2, 2), (2, 2)])


def test_ref_expr() -> None:
    assert ref_expr("v3") == "v3"
    assert ref_expr("v3:1") == "v3[1]"
