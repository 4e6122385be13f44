"""TraceShapeEnv (cagrad.capture.shape_env): which ``guard_or_*`` queries
on a symbol that may be 1 it answers without a guard.

Each case states what holds for every value of the symbol (by the
definition of contiguity or broadcasting), and checks that a query whose
answer depends on the value is still a guard that rejects the values on
the other side.
"""

from __future__ import annotations

import pytest
import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch._prims_common import (
    compute_elementwise_output_logical_to_physical_perm,
    is_contiguous_for_memory_format_or_false,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import guard_or_false

from cagrad.capture import shape_env


def _symbol(env, hint: int):
    src = ConstantSource(f"s_{len(env.backed_var_to_val)}")
    sym = shape_env.create_symbol(env, hint, src, zero_one=True)
    return sym, env.create_symintnode(sym, hint=hint, source=src)


def _accepts(env, sym, value: int) -> bool:
    """Whether ``sym == value`` is in its range and every guard recorded so
    far holds there (what the variant's SizeCheck asks)."""
    if value not in env.var_to_range[sym]:
        return False
    return all(bool(g.expr.xreplace({sym: sympy.Integer(value)})) for g in env.guards)


@pytest.fixture
def env():
    if not shape_env.zero_one_symbols():
        pytest.skip("this torch has no _extract_tensor_metadata")
    env = shape_env.trace_shape_env()
    env.answer_queries = True
    return env


def test_contiguous_at_every_value_needs_no_guard(env):
    """(s, 6) with strides (6, 1) is contiguous for every s (at 0 it has no
    element): the probe proves it, and nothing keeps 0 or 1 out (where
    :func:`shape_env.zero_symbols` holds; else 0 is out of the range)."""
    sym, s = _symbol(env, 4)
    with FakeTensorMode(shape_env=env):
        t = torch.empty_strided((s, 6), (6, 1))
        assert is_contiguous_for_memory_format_or_false(t, memory_format=torch.contiguous_format)
    assert env.guards == []
    assert all(_accepts(env, sym, v) for v in (1, 2, 7))
    assert _accepts(env, sym, 0) == shape_env.zero_symbols()


def test_contiguity_that_depends_on_the_value_is_guarded(env):
    """(6, s) with strides (1, 6) is contiguous for s of 1 only (of those
    in the range): at s = 4 the answer is False, and a guard keeps 1 out."""
    sym, s = _symbol(env, 4)
    with FakeTensorMode(shape_env=env):
        t = torch.empty_strided((6, s), (1, 6))
        assert not is_contiguous_for_memory_format_or_false(t, memory_format=torch.contiguous_format)
    assert env.guards
    assert _accepts(env, sym, 3) and not _accepts(env, sym, 1) and not _accepts(env, sym, 0)


def test_off_every_query_guards(env):
    """``answer_queries`` off (no symbol may be 1, or a node has several
    inputs): torch's ShapeEnv, the contiguity query guards."""
    env.answer_queries = False
    sym, s = _symbol(env, 4)
    with FakeTensorMode(shape_env=env):
        t = torch.empty_strided((s, 6), (6, 1))
        assert is_contiguous_for_memory_format_or_false(t, memory_format=torch.contiguous_format)
    assert env.guards and not _accepts(env, sym, 1)


def test_queries_of_other_code_are_guarded(env):
    sym, s = _symbol(env, 4)
    assert not guard_or_false(s == 1)
    assert not _accepts(env, sym, 1) and _accepts(env, sym, 5)


@pytest.fixture
def zero_env(env):
    if not shape_env.zero_symbols():
        pytest.skip("sizes of 0 stay specialized on this torch (its storage-size computation was not read)")
    return env


def test_a_symbol_may_be_zero_and_sympy_does_not_decide_it(zero_env):
    """The symbol has the range [0, inf] and no ``positive`` assumption:
    ``s == 0`` is a question for the ShapeEnv (a guard), not False."""
    sym, s = _symbol(zero_env, 4)
    assert sym.is_positive is None
    assert sympy.Eq(sym, 0) not in (sympy.true, sympy.false)
    assert _accepts(zero_env, sym, 0)
    assert not bool(s == 0)
    assert not _accepts(zero_env, sym, 0) and _accepts(zero_env, sym, 1)


def test_storage_size_of_a_fake_needs_no_guard(zero_env):
    """``empty_strided`` of (s, 5) with strides (6, 1) (a gap) and of
    (s, 3) with strides (0, 1) (expanded): the zero tests of the C++
    storage-size computation are answered without a guard, the fakes'
    sizes and strides are the given ones; only the storage's byte count
    is the strided formula (not 0 at s == 0)."""
    sym, s = _symbol(zero_env, 4)
    with FakeTensorMode(shape_env=zero_env):
        a = torch.empty_strided((s, 5), (6, 1))
        b = torch.empty_strided((2, s, 3), (3 * s, 0, 1))
    assert zero_env.guards == []
    assert (a.shape, a.stride(), b.shape, b.stride()) == ((s, 5), (6, 1), (2, s, 3), (3 * s, 0, 1))
    assert all(_accepts(zero_env, sym, v) for v in (0, 1, 5))


def test_zero_tests_of_other_code_are_guarded(zero_env):
    sym, s = _symbol(zero_env, 3)
    assert not guard_or_false(s == 0)
    assert not _accepts(zero_env, sym, 0) and _accepts(zero_env, sym, 1)


def test_empty_index_checks_of_scatter_need_no_guard(zero_env):
    """``scatter_add`` with an index of s rows: whether its index is empty
    only decides whether dtype and shape checks run (they pass here), so
    nothing keeps 0 out; an index of another dtype still fails."""
    sym, s = _symbol(zero_env, 4)
    with FakeTensorMode(shape_env=zero_env):
        src = torch.empty_strided((s, 3), (3, 1))
        index = torch.empty_strided((s, 3), (3, 1), dtype=torch.long)
        wrong = torch.empty_strided((s, 3), (3, 1), dtype=torch.float)
        torch.zeros(4, 3).scatter_add(0, index, src)
        assert zero_env.guards == []
        assert _accepts(zero_env, sym, 0)
        with pytest.raises(RuntimeError, match="int32/int64"):
            torch.zeros(4, 3).scatter_add(0, wrong, src)


def test_elementwise_op_of_equal_shapes_needs_no_guard(env):
    """(s, 6) * (s, 6) is (s, 6), contiguous, for every s: the fast path's
    broadcast shape and contiguity need no guard."""
    sym, s = _symbol(env, 4)
    with FakeTensorMode(shape_env=env):
        a = torch.empty_strided((s, 6), (6, 1))
        out = a * torch.empty_strided((s, 6), (6, 1))
    assert out.shape == (s, 6) and out.stride() == (6, 1)
    assert all(_accepts(env, sym, v) for v in (1, 2, 9))


def test_new_dimension_of_size_one_in_expand_is_guarded(env):
    """A 0-dim tensor expanded to (s, 6): the stride torch's meta gives the
    new dimension 0 differs at s == 1, a query that stays a guard."""
    sym, s = _symbol(env, 4)
    with FakeTensorMode(shape_env=env):
        torch.empty(()).expand(s, 6).contiguous()
    assert not _accepts(env, sym, 1)


@pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15),
    reason="the sources were read for torch 2.12 to 2.14",
)
@pytest.mark.skipif(
    torch.__version__.split("+")[0] not in ("2.12.1", "2.13.0", "2.14.1"),
    reason="cagrad.capture.shape_env recognizes the sources of torch 2.12.1, 2.13.0 and 2.14.1 only; "
    "other versions guard sizes of 1 as before (sound, one more capture)",
)
def test_the_sources_read_are_recognized():
    """On the torch versions CI runs, every function of the module docstring
    is recognized (a changed source would silently cost captures)."""
    shape_env._load()
    kinds = sorted(kind for kind, _ in shape_env._SITES.values())
    # and those of a backend's compile (cagrad.capture.backend_queries)
    assert kinds == ["exact"] * 10 + ["expand_stride", "metadata", "probe", "storage", "wrapper_storage"], kinds
    assert shape_env.zero_symbols()
    assert shape_env._PROBED is is_contiguous_for_memory_format_or_false
    assert shape_env._PERM_CODE is compute_elementwise_output_logical_to_physical_perm.__code__


_AUDITED_TORCH = pytest.mark.skipif(
    torch.__version__.split("+")[0] not in ("2.12.1", "2.13.0", "2.14.1"),
    reason="cagrad.capture.shape_env recognizes the sources of torch 2.12.1, 2.13.0 and 2.14.1 only",
)


@_AUDITED_TORCH
def test_broadcast_in_dim_to_its_own_sizes_needs_no_guard(env):
    """``prims.broadcast_in_dim`` of (s, 6) to (s, 6): its two broadcast-
    dimension queries (is the size 1; is it the target size) are answered
    without a guard, and the strides (6, 1) hold for every s (a survivor of
    the mutation run, docs/mutation-testing.md: the queries' line numbers
    computed wrongly made them guards, 1 kept out, and no check noticed)."""
    sym, s = _symbol(env, 4)
    with FakeTensorMode(shape_env=env):
        a = torch.empty_strided((s, 6), (6, 1))
        out = torch._prims.broadcast_in_dim(a, [s, 6], [0, 1])
    assert out.stride() == (6, 1)
    assert all(_accepts(env, sym, v) for v in (1, 2, 9)), env.guards


def test_a_query_asked_by_a_site_itself_is_answered(env, monkeypatch):
    """The search for a site starts at the frame that asked the query: a
    site that calls ``evaluate_expr`` itself (as a torch whose
    ``_extract_tensor_metadata``, recognized whatever its source, may) has
    its query answered without a guard."""
    sym, _ = _symbol(env, 4)

    def site():
        return env.evaluate_expr(sympy.Eq(sym, 1), fallback_value=False)

    monkeypatch.setattr(shape_env, "_SITES", {**shape_env._SITES, site.__code__: (shape_env.METADATA, None)})
    assert site() == sympy.false
    assert env.guards == [] and _accepts(env, sym, 1)


def test_tensor_metadata_of_a_layout_that_depends_on_the_value_needs_no_guard(env):
    """``_extract_tensor_metadata`` (``node.meta["tensor_meta"]``) of (6, s)
    with strides (1, 6), contiguous at s == 1 only: its contiguity queries
    fill metadata alone and are answered without a guard."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    sym, s = _symbol(env, 4)
    with FakeTensorMode(shape_env=env):
        _extract_tensor_metadata(torch.empty_strided((6, s), (1, 6)))
    assert all(_accepts(env, sym, v) for v in (1, 2, 9)), env.guards


def test_a_query_answered_without_a_guard_is_counted(env, monkeypatch):
    """``unguarded`` counts the queries answered by their fallback that the
    symbol's range did not decide: ``s == 1`` (undecided) once, ``s == -1``
    (False for every size) not."""
    sym, _ = _symbol(env, 4)

    def site(expr):
        return env.evaluate_expr(expr, fallback_value=False)

    monkeypatch.setattr(shape_env, "_SITES", {**shape_env._SITES, site.__code__: (shape_env.METADATA, None)})
    assert env.unguarded == 0
    assert site(sympy.Eq(sym, 1)) == sympy.false
    assert env.unguarded == 1
    assert site(sympy.Eq(sym, -1)) == sympy.false
    assert env.unguarded == 1 and env.guards == []


def _two_queries():
    first = 1  # query one
    second = 2  # query two
    return first + second


def test_a_function_is_an_exact_site_only_where_each_query_is_found_once():
    """``_add_lines`` makes a site of the lines that hold the queries, and no
    site where one of them is missing (a changed source guards as before)."""
    first_line = _two_queries.__code__.co_firstlineno
    sites: dict = {}
    shape_env._add_lines(sites, _two_queries, ("# query one", "# query two"))
    assert sites == {_two_queries.__code__: (shape_env.EXACT, frozenset({first_line + 1, first_line + 2}))}
    for queries in (("# query one", "# not in the source"), ("# not in the source",)):
        sites = {}
        shape_env._add_lines(sites, _two_queries, queries)
        assert sites == {}, queries


def _asks():
    pass


def _constructor():
    pass


def _storage_frames(sizes, called_code=None):
    """Stand-ins for the frames of a query from the C++ of ``empty_strided``:
    the asking frame, ``OpOverload.__call__`` of ``aten.empty_strided`` (or
    a frame of ``called_code``) and ``fake_impls.constructors`` (here
    ``_constructor``, made the storage site by the caller)."""
    from types import SimpleNamespace

    from torch._ops import OpOverload

    op = torch.ops.aten.empty_strided.default
    ctor = SimpleNamespace(
        f_code=_constructor.__code__, f_back=None, f_locals={"func": op, "new_kwargs": {"size": sizes}}
    )
    called = SimpleNamespace(
        f_code=called_code or OpOverload.__call__.__code__, f_back=ctor, f_locals={"self": op}
    )
    return SimpleNamespace(f_code=_asks.__code__, f_back=called, f_locals={}), ctor


def _zero_symbol(env, hint: int):
    """A symbol that may be 0 (range [0, inf], no ``positive``), as
    :func:`shape_env.create_symbol` makes where :func:`shape_env.zero_symbols`
    holds, on any torch (sympy would decide ``Eq(s, 0)`` for a positive one)."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic
    from torch.utils._sympy.numbers import int_oo

    src = ConstantSource(f"z_{len(env.var_to_range)}")
    sym = env.create_symbol(hint, src, dynamic_dim=DimDynamic.DYNAMIC, positive=None, do_not_specialize_zero_one=True)
    env.constrain_symbol_range(sym, 0, int_oo)
    return sym, env.create_symintnode(sym, hint=hint, source=src)


@pytest.fixture
def storage_site(env, monkeypatch):
    """The storage site's expression and order rules alone: ``_constructor``
    is the site and every query counts as asked from C++ (the stack check,
    ``_asked_from_cpp``, is what the fake-tensor cases above exercise on the
    torch versions read)."""
    monkeypatch.setattr(shape_env, "_SITES", {_constructor.__code__: (shape_env.STORAGE, None)})
    monkeypatch.setattr(shape_env, "_asked_from_cpp", lambda called: True)
    return env


def test_storage_site_answers_each_sizes_zero_test_once_and_in_order(storage_site):
    env = storage_site
    (a, s), (b, t), (c, _) = (_zero_symbol(env, 3), _zero_symbol(env, 4), _zero_symbol(env, 5))
    asking, _ = _storage_frames([s, 7, t])
    answers = [
        env._without_guard(asking, e)
        for e in (sympy.Eq(c, 0), sympy.Eq(a, 0), sympy.Eq(b, 0), sympy.Eq(b, 0), sympy.Eq(a, 0))
    ]
    # not a size of the call; the first size; the second; either again
    assert answers == [False, True, True, False, False]
    asking, _ = _storage_frames([s, t])  # another call: counted afresh
    assert [env._without_guard(asking, sympy.Eq(x, 0)) for x in (a, b, b)] == [True, True, False]


def test_storage_site_answers_only_empty_strided_asked_through_opoverload_call(storage_site):
    env = storage_site
    a, s = _zero_symbol(env, 3)
    asking, ctor = _storage_frames([s], called_code=_asks.__code__)
    assert not env._without_guard(asking, sympy.Eq(a, 0))  # not OpOverload.__call__
    assert not env._without_guard(ctor, sympy.Eq(a, 0))  # asked by the site itself: no frame below
    asking, _ = _storage_frames((s,))
    assert not env._without_guard(asking, sympy.Integer(0) < 1)  # a number
    assert env._without_guard(asking, sympy.Eq(a, 0))  # sizes as a tuple
    asking, _ = _storage_frames(None)
    assert not env._without_guard(asking, sympy.Eq(a, 0))  # no sizes


def test_a_query_not_asked_through_guard_or_false_is_not_from_cpp():
    """``_asked_from_cpp`` walks the stack for ``SymNode.guard_or_false``:
    from a test function it finds none."""

    def ask():
        return shape_env._asked_from_cpp(object())

    assert ask() is False
