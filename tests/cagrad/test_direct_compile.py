"""Named backends compile cagrad's graph directly (no Dynamo on top).

What Dynamo's guards used to check must still hold: size guards the backend
adds while compiling, inputs that are the same tensor in one backward and
different tensors in the next, and the global state the graph was compiled
in. Every case compares with eager autograd.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.backends.registry import register_backend

import cagrad
from cagrad import engine

from .conftest import same

_GUARDED: list[bool] = []


@register_backend(name="cagrad_test_guarding")
def _guarding_backend(gm, example_inputs):
    """Specializes on the first symbolic dimension it finds, the way
    inductor's code generation does (``s0 <= 4096``): it branches on it, which
    records a guard in the ShapeEnv, and returns code valid only on that side."""
    dims = [
        x.shape[0]
        for x in example_inputs
        if isinstance(x, torch.Tensor) and x.dim() and isinstance(x.shape[0], torch.SymInt)
    ]
    assert dims, "the test needs a graph traced with symbolic sizes"
    small = bool(dims[0] < 10)  # a guard on the symbol
    _GUARDED.append(small)

    def run(*args):
        first = next(a for a in args if isinstance(a, torch.Tensor) and a.dim())
        if (first.shape[0] < 10) != small:
            raise AssertionError("compiled code called outside the guard its backend recorded")
        return gm(*args)

    return run


def _mlp_step(model, n):
    torch.manual_seed(n)
    x = torch.randn(n, 8)
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_size_guard_the_backend_adds_is_checked_on_every_hit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    sizes = [4, 6, 32, 5, 40]
    expected = [_mlp_step(model, n) for n in sizes]
    before = len(_GUARDED)
    with cagrad.enable("cagrad_test_guarding", dynamic=True):
        actual = [_mlp_step(model, n) for n in sizes]
    for e, a in zip(expected, actual):
        for x, y in zip(e, a):
            same(x, y)
    # one graph for sizes below 10, one for the rest: the backend's guard
    # split them, and each later size found the graph on its side
    assert _GUARDED[before:] == [True, False]
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["fallbacks"] == 0
    assert cagrad.counters["backend_compiles"] == 2


_NARROWED: list[int] = []


def _first_symbolic_dim(example_inputs) -> torch.SymInt:
    dims = [
        x.shape[0]
        for x in example_inputs
        if isinstance(x, torch.Tensor) and x.dim() and isinstance(x.shape[0], torch.SymInt)
    ]
    assert dims, "the test needs a graph traced with symbolic sizes"
    return dims[0]


def _valid_while(gm, low: int, high: int):
    def run(*args):
        first = next(a for a in args if isinstance(a, torch.Tensor) and a.dim())
        if not low <= first.shape[0] <= high:
            raise AssertionError("compiled code called outside what its backend assumed")
        return gm(*args)

    return run


@register_backend(name="cagrad_test_relating")
def _relating_backend(gm, example_inputs):
    """Where the input of shape ``(a, b)`` has ``b == 2 * a``, branches on
    it: the ShapeEnv replaces ``b``'s symbol by ``2 * a``'s (its guard then
    reads ``2*a == 2*a``, true; neither range narrows), and the code is valid
    only while that holds."""
    x = next(x for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() == 2)
    a, b = x.shape
    assert isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and a.node.expr != b.node.expr
    _NARROWED.append(int(a.node.hint))
    if int(b.node.hint) != 2 * int(a.node.hint):
        return gm
    assert b == 2 * a  # records the replacement

    def run(*args):
        y = next(y for y in args if isinstance(y, torch.Tensor) and y.dim() == 2)
        if y.shape[1] != 2 * y.shape[0]:
            raise AssertionError("compiled code called outside what its backend assumed")
        return gm(*args)

    return run


@register_backend(name="cagrad_test_ranges")
def _range_backend(gm, example_inputs):
    """Narrows the first symbol's range to [2, 9] where it is below 10
    (``constrain_range``: a range, no guard) and returns code valid there."""
    from torch.fx.experimental.symbolic_shapes import constrain_range

    dim = _first_symbolic_dim(example_inputs)
    n = int(dim.node.hint)
    _NARROWED.append(n)
    if n < 10:
        constrain_range(dim, min=2, max=9)
        return _valid_while(gm, 2, 9)
    return gm


def _scaled_step(w, n):
    torch.manual_seed(n)
    x = torch.randn(n, 8)
    w.grad = None
    (x * w).sin().sum().backward()
    return [w.grad.clone()]


@pytest.mark.parametrize(
    "backend, step, sizes, compiled_at",
    [
        # (n, 8) with a symbol per size: 8 == 2 * 4 at the first backward only
        ("cagrad_test_relating", _scaled_step, [4, 5, 4, 6], [4, 5]),
        ("cagrad_test_ranges", _mlp_step, [4, 32, 5, 40], [4, 32]),
    ],
)
def test_a_replacement_or_range_the_backend_records_is_checked_on_every_hit(backend, step, sizes, compiled_at):
    """What a backend assumed about the symbols that no guard of the
    ShapeEnv still says (one symbol replaced by an expression of another, a
    narrowed range) joins the variant's size check
    (``cagrad.keys.sizes.tighten``): a size outside it is a new capture, not
    a call of code compiled for other sizes."""
    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        if step is _mlp_step
        else torch.randn(8, requires_grad=True)
    )
    expected = [step(model, n) for n in sizes]
    before = len(_NARROWED)
    with cagrad.enable(backend, dynamic=True):
        actual = [step(model, n) for n in sizes]
    for e, a in zip(expected, actual):
        for x, y in zip(e, a):
            same(x, y)
    assert _NARROWED[before:] == compiled_at
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["cache_hits"] == 2
    assert cagrad.counters["fallbacks"] == 0


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_one_tensor_saved_twice_then_two_tensors_is_not_read_as_one(backend, dynamic):
    """``(w * c1) * c`` saves ``c1`` and ``c``: the same tensor in some
    steps, two tensors in others; the cache key is the same for both."""
    w = torch.randn(4, requires_grad=True)
    c1, c2 = torch.randn(4), torch.randn(4)
    pattern = [True, False, True, False]

    def step(same_tensor):
        w.grad = None
        ((w * c1) * (c1 if same_tensor else c2)).sum().backward()
        return w.grad.clone()

    expected = [step(s) for s in pattern]
    with cagrad.enable(backend, dynamic=dynamic):
        actual = [step(s) for s in pattern]
    for e, a in zip(expected, actual):
        same(e, a)
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 3


def test_a_changed_global_state_gets_a_variant_of_its_own():
    """A graph compiled with deterministic algorithms off is not run with
    them on (Dynamo's GlobalStateGuard tells): that backward captures a
    variant of its own, and each state then hits its own variant."""
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    x = torch.randn(4, 5)

    def step():
        w.grad = None
        (x @ w).relu().sum().backward()
        return w.grad.clone()

    expected = step()
    before = torch.are_deterministic_algorithms_enabled()
    compiled_in = []
    with cagrad.enable("aot_eager"):
        for deterministic in (False, True, False, True, False):
            try:
                torch.use_deterministic_algorithms(deterministic)
                same(expected, step())
                compiled_in.append(cagrad.counters["captures"])
            finally:
                torch.use_deterministic_algorithms(before)
    assert compiled_in == [1, 2, 2, 2, 2]
    c = cagrad.counters
    assert (c["recompiles_global_state"], c["recompiles_shape"], c["cache_hits"], c["fallbacks"]) == (1, 0, 3, 0)
    # one key sequence, two variants; in the original state only the first holds
    stack, ends = [engine.cache_for("aot_eager", None)], []
    while stack:
        node = stack.pop()
        ends += [node] if node.variants else []
        stack.extend(node.children.values())
    (node,) = ends
    assert [v.state_holds() for v in node.variants] == [True, False]


# inductor's per-input size checks: one ``assert_size_stride(x, ...)`` per
# input up to torch 2.13, one ``assert_size_stride_grouped((x, y), ...)`` for
# all inputs from 2.14
_SIZE_ASSERT = re.compile(r"assert_size_stride(_grouped)?\(")


def _inductor_codes(step):
    """The output code inductor writes while ``step`` runs (a fresh cache:
    a cached compile writes none)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering
    from torch._inductor.utils import fresh_cache

    codes = []
    with fresh_cache(), mock.patch.object(GraphLowering, "save_output_code", codes.append):
        step()
    return codes


def test_inductor_drops_size_asserts_only_where_the_key_covers_every_input():
    """A whole graph's inputs are all keyed, so its code has no
    ``assert_size_stride``; an input of other strides (a transposed saved
    tensor) is a cache miss and a capture of its own, never the old code."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)

    def grads(x):
        w.grad = None
        (x @ w).tanh().sum().backward()
        return w.grad.clone()

    contiguous = torch.randn(6, 8)
    transposed = torch.randn(8, 6).t()
    expected = [grads(contiguous), grads(transposed), grads(contiguous)]
    engine.clear_caches()
    got = []
    with cagrad.enable("inductor"):
        codes = _inductor_codes(lambda: got.extend(grads(x) for x in (contiguous, transposed, contiguous)))
        assert cagrad.counters["cache_hits"] == 1
    assert len(codes) == 2  # one graph per layout of the saved input
    for code in codes:
        assert "def call(" in code and not _SIZE_ASSERT.search(code)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)  # inductor fuses: float32 rounding


def test_inductor_keeps_size_asserts_in_a_segment():
    """A segment reads what an opaque call returns (here a hook's result),
    which no cache key covers: inductor's own size asserts stay."""
    torch.manual_seed(0)
    seen = []
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(6, 8)

    def step():
        w.grad = None
        y = x @ w
        y.register_hook(seen.append)  # a bound method: opaque (cagrad.hooks.hook_tracing)
        y.tanh().sum().backward()
        return w.grad.clone()

    expected = step()
    engine.clear_caches()
    with cagrad.enable("inductor"):
        got = []
        codes = _inductor_codes(lambda: got.append(step()))
        got.append(step())
    for g in got:
        torch.testing.assert_close(g, expected)  # inductor fuses: float32 rounding
    assert any(_SIZE_ASSERT.search(code) for code in codes)
