"""The size queries of a backend's compile that TraceShapeEnv answers
without a guard (cagrad.capture.backend_queries), and neighbours that
still guard.

Each case states what holds for every value of the symbol, and checks the
ShapeEnv's guards accept 0 and 1 where it holds, and keep a value out
where the answer depends on it.
"""

from __future__ import annotations

import types

import pytest
import sympy
import torch
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm
from torch._subclasses.fake_tensor import FakeTensorMode

from cagrad.capture import shape_env

from .test_trace_shape_env import _accepts, _symbol

pytestmark = pytest.mark.skipif(
    torch.__version__.split("+")[0] not in ("2.12.1", "2.13.0", "2.14.1"),
    reason="cagrad.capture.backend_queries recognizes the sources of torch 2.12.1, 2.13.0 and 2.14.1 only",
)


@pytest.fixture
def env():
    if not shape_env.zero_symbols():
        pytest.skip("sizes of 0 stay specialized on this torch")
    env = shape_env.trace_shape_env()
    env.answer_queries = True
    return env


def test_index_of_a_varying_number_of_rows_needs_no_guard(env):
    """``aten.index`` of an (8, 6) tensor by s indices (the decomposition of
    ``index_select``'s backward): its meta restrides the source to (s, 6)
    with strides (0, 6)... (0, 1), contiguous at s of 0 or 1 only; the
    output permutation is the identity either way (a zero stride decides no
    order), so the output is (s, 6) contiguous at every s without a guard."""
    sym, s = _symbol(env, 4)
    with FakeTensorMode(shape_env=env):
        x = torch.empty(8, 6)
        idx = torch.empty((s,), dtype=torch.long)
        out = torch.ops.aten.index.Tensor(x, [idx])
    assert tuple(out.shape) == (s, 6) and out.stride() == (6, 1)
    assert env.guards == []
    assert all(_accepts(env, sym, v) for v in (0, 1, 2, 9))


def test_a_permutation_that_depends_on_the_value_is_guarded(env):
    """(6, s) with strides (1, 6): contiguous at s == 1 (the fast path's
    identity), column-major above; the general path decides [1, 0] from
    the strides alone (no symbol in them), which is not the identity, so
    the contiguity query guards and 1 stays out (at 1 eager's output of
    (6, 1) has strides (1, 1), the permutation [1, 0] would give (1, 6))."""
    sym, s = _symbol(env, 4)
    with FakeTensorMode(shape_env=env):
        t = torch.empty_strided((6, s), (1, 6))
        perm, _ = compute_elementwise_output_logical_to_physical_perm(t)
    assert perm == [1, 0]
    assert _accepts(env, sym, 4) and not _accepts(env, sym, 1)


def test_functional_wrapper_storage_size_needs_no_guard(env):
    """AOTAutograd's functionalization wraps a fake of (s, 10): the wrapper's
    storage-size queries (``Eq(s, 0)``) are answered without a guard; its
    sizes and strides are the fake's."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    sym, s = _symbol(env, 4)
    mode = FakeTensorMode(shape_env=env)
    with mode:
        t = torch.empty_strided((s, 10), (10, 1))
        with FunctionalTensorMode():
            f = FunctionalTensor.to_functional(t)
    assert (tuple(f.shape), f.stride()) == ((s, 10), (10, 1))
    assert env.guards == []
    assert all(_accepts(env, sym, v) for v in (0, 1, 3))


def _inductor_graph(env):
    from torch._inductor.sizevars import SizeVarAllocator
    from torch._inductor.virtualized import V

    return V.set_graph_handler(types.SimpleNamespace(sizevars=SizeVarAllocator(env)))


def test_inductor_broadcast_of_two_symbols_guards_their_equality_only(env):
    """inductor's ``broadcast_symbolic_shapes`` of (s,) and (t,): neither is
    known to be 1, so the shapes must be equal; that equality is the only
    guard, and s == t == 0 or 1 are accepted (the broadcast is s there too)."""
    from torch._inductor.lowering import broadcast_symbolic_shapes

    a, _ = _symbol(env, 4)
    b, _ = _symbol(env, 4)
    with _inductor_graph(env):
        out = broadcast_symbolic_shapes((a,), (b,))
    assert len(out) == 1 and out[0] in (a, b)
    for v in (0, 1, 5):
        assert all(bool(g.expr.xreplace({a: v, b: v})) for g in env.guards), env.guards
    assert not all(bool(g.expr.xreplace({a: 1, b: 5})) for g in env.guards)


def test_other_inductor_queries_are_guarded(env):
    """A ``guard_or_false`` of inductor's elsewhere (its CPU reductions'
    ``s > 4096``, say) guards as before."""
    sym, _ = _symbol(env, 4)
    with _inductor_graph(env) as _:
        from torch._inductor.virtualized import V

        assert not V.graph.sizevars.guard_or_false(sympy.Eq(sym, 1))
    assert not _accepts(env, sym, 1) and _accepts(env, sym, 3)


def test_expand_stride_query_only_where_the_size_is_kept(env):
    """``ExpandView.create``'s stride-0 query is answered without a guard
    only for a dimension the view keeps at the input's size; an expand of
    a size that may be 1 to another size guards."""
    from cagrad.capture import backend_queries

    a, _ = _symbol(env, 4)
    b, _ = _symbol(env, 4)

    def frame(new_size, size):
        return types.SimpleNamespace(f_locals={"new_size": new_size, "new_stride": [sympy.S.Zero], "size": size})

    assert backend_queries.expand_keeps_size(frame([3, a], a), env.replace)
    assert not backend_queries.expand_keeps_size(frame([3, b], a), env.replace)
    assert not backend_queries.expand_keeps_size(frame([3, 5], sympy.S.One), env.replace)
