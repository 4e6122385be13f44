"""Custom autograd.Functions run under cagrad with PyNode's semantics.

Each variant exercises one rule of ``PyNode::apply``: saved tensors and ctx
attributes, ``needs_input_grad``, non-differentiable outputs, materialized or
not-materialized undefined gradients, non-tensor inputs and outputs, extra
trailing Nones, ``once_differentiable``. Results are compared with eager bit
for bit, and the backward must compile.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd.function import once_differentiable

import cagrad

from .conftest import check_traced as check, errors_under_both, run_both_traced, same


class Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k, w):
        ctx.save_for_backward(x, w)
        ctx.k = k
        return x * w * k

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g * w * ctx.k if ctx.needs_input_grad[0] else None
        gw = g * x * ctx.k if ctx.needs_input_grad[2] else None
        return gx, None, gw


class WithIndices(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        idx = torch.arange(x.shape[0])
        ctx.mark_non_differentiable(idx)
        return x * 2, idx, x.sum()

    @staticmethod
    def backward(ctx, g, g_idx, g_sum):
        # g_idx: zeros materialized with the index output's dtype and shape
        return g * 2 + g_sum + g_idx.to(g.dtype)


class NotMaterialized(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        out = torch.zeros_like(g1 if g1 is not None else g2)
        if g1 is not None:
            out = out + g1 * 2
        if g2 is not None:
            out = out + g2 * 3
        return out


class ExtraNones(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.exp()

    @staticmethod
    def backward(ctx, g):
        return g * 2, None, None


class OnceDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


_NO_GRAD_CALLS: list[int] = []


class NoGradForW(torch.autograd.Function):
    """Runs opaque (its backward has a side effect: cagrad.hooks.backward_tracing),
    so the graph assumes a gradient for ``w`` and the tests below see the
    interpreter finish the first backward."""

    @staticmethod
    def forward(ctx, x, w):
        return x * w

    @staticmethod
    def backward(ctx, g):
        _NO_GRAD_CALLS.append(1)
        return g, None  # w requires grad but gets none


def test_saved_tensors_ctx_attributes_and_needs_input_grad():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3)  # needs_input_grad[2] is False
        Scaled.apply(x.exp(), 1.5, w).sum().backward()
        return [x.grad]

    check(build)


def test_two_inputs_requiring_grad():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        Scaled.apply(x, 2.0, w.tanh()).pow(2).sum().backward()
        return [x.grad, w.grad]

    check(build)


def test_non_differentiable_and_non_tensor_outputs_materialize_like_eager():
    def build(tr):
        x = torch.randn(4, requires_grad=True)
        a, idx, s = WithIndices.apply(x.exp())
        a.sum().backward()
        return [x.grad]

    check(build)


def test_set_materialize_grads_false_passes_none():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        a, _b = NotMaterialized.apply(x)
        a.sum().backward()
        return [x.grad]

    check(build)


def test_extra_trailing_nones_are_dropped():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        ExtraNones.apply(x).sum().backward()
        return [x.grad]

    check(build)


def test_once_differentiable():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        OnceDiff.apply(x * 2).sum().backward()
        return [x.grad]

    check(build)


def _x_like_eager_w_without_grad_one_retrace(step, runs: int) -> None:
    """``step(seed) -> (x.grad, w.grad)`` for seeds ``0..runs-1``, eager then
    under ``cagrad.enable("eager")``: ``x.grad`` the same, ``w.grad`` None in
    both (:class:`NoGradForW`), and one deopt finished by one retrace."""
    expected = [step(s) for s in range(runs)]
    with cagrad.enable("eager"):
        actual = [step(s) for s in range(runs)]
    for (ex, ew), (ax, aw) in zip(expected, actual):
        same(ex, ax)
        assert ew is None and aw is None
    assert cagrad.counters["deopts"] == 1 and cagrad.counters["retraces"] == 1


def test_returning_none_for_an_input_that_requires_grad():
    """The trace assumes a gradient there; the first run is finished by the
    interpreter and traced again at its end with the pattern seen, and
    every backward after it is a plain cache hit."""

    def step(seed):
        torch.manual_seed(seed)
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        NoGradForW.apply(x.exp(), w).sum().backward()
        return x.grad, w.grad

    _x_like_eager_w_without_grad_one_retrace(step, 4)
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 3
    assert cagrad.counters["fallbacks"] == 0


def test_returning_none_then_the_interpreter_sums_two_gradients():
    """The interpreter finishes the first backward from the custom
    Function's call: ``a``'s node then gets two gradients (through the
    Function and through ``a * 2``), summed as eager's InputBuffer sums
    them."""

    def step(seed):
        torch.manual_seed(seed)
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        a = x.exp()
        (NoGradForW.apply(a, w) + a * 2).sum().backward()
        return x.grad, w.grad

    _x_like_eager_w_without_grad_one_retrace(step, 3)


def test_returning_none_then_the_interpreter_runs_an_aot_backward():
    """After the custom Function's failed check the interpreter finishes the
    first backward, an AOTAutograd backward node (``aot_function``, no
    ``BackwardState``: inlined in the graph) included, which it runs as
    PyNode runs it."""
    from functorch.compile import aot_function, nop

    region = aot_function(lambda a: a.sin() * 2, fw_compiler=nop, bw_compiler=nop)

    def step(seed):
        torch.manual_seed(seed)
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        NoGradForW.apply(region(x.exp()), w).sum().backward()
        return x.grad, w.grad

    _x_like_eager_w_without_grad_one_retrace(step, 3)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["nodes_forced_opaque"] == 0, dict(cagrad.counters["opaque_reasons"])


def test_returning_none_deep_in_a_long_graph_resumes_at_that_node():
    """The failed check is at a node past position 256 of the run order
    (261 nodes run before it): the interpreter resumes at that very node,
    with what the compiled part computed, and finishes as eager does."""

    def step(seed):
        torch.manual_seed(seed)
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        y = NoGradForW.apply(x.exp(), w)
        for i in range(260):
            y = y * (2.0 if i % 2 else 0.5)
        y.sum().backward()
        return x.grad, w.grad

    _x_like_eager_w_without_grad_one_retrace(step, 2)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


def test_returning_none_with_a_conjugate_saved_tensor_recaptures_instead_of_retracing():
    """``MulBackward0`` saves the conjugate view ``x.conj()`` (conjugate
    bit set). A trace after the run freed it could fake it only from
    metadata without that bit (cagrad.capture.shells), so the first
    backward's failed check is not traced again at its end: the second
    backward captures (with the seen pattern), the third hits."""

    def step(seed):
        torch.manual_seed(seed)
        x = torch.randn(3, dtype=torch.complex64, requires_grad=True)
        c = torch.randn(3, dtype=torch.complex64, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        y = x.conj() * c
        assert y.grad_fn._saved_self.is_conj()
        NoGradForW.apply(y.real, w).sum().backward()
        return x.grad, c.grad, w.grad

    expected = [step(s) for s in range(3)]
    with cagrad.enable("eager"):
        actual = [step(s) for s in range(3)]
    for (ex, ec, ew), (ax, ac, aw) in zip(expected, actual):
        same(ex, ax)
        same(ec, ac)
        assert ew is None and aw is None
    assert cagrad.counters["deopts"] == 1 and cagrad.counters["retraces"] == 0
    assert cagrad.counters["captures"] == 2 and cagrad.counters["cache_hits"] == 1


def test_module_full_backward_hooks_use_a_custom_function():
    def build(tr):
        m = torch.nn.Linear(3, 2)
        m.register_full_backward_hook(lambda mod, gi, go: tr.append(("gi", gi[0])))
        m(torch.randn(4, 3, requires_grad=True)).sum().backward()
        return [m.weight.grad, m.bias.grad]

    check(build)


@pytest.mark.parametrize(
    "backward, phrase",
    [
        (lambda ctx, g: (g, g, g), "incorrect number of gradients"),
        (lambda ctx, g: (g, torch.ones(())), "different than None"),
    ],
    ids=["count", "non_tensor_input"],
)
def test_errors_match_eager(backward, phrase):
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k):
            return x * k

    Bad.backward = staticmethod(backward)

    def build():
        x = torch.randn(3, requires_grad=True)
        Bad.apply(x, 2.0).sum().backward()

    errors = errors_under_both(build)
    assert len(errors) == 2
    assert type(errors[0]) is type(errors[1])
    assert phrase in str(errors[0]) and phrase in str(errors[1])


def test_function_without_forward_record_falls_back():
    """A Function applied before cagrad was imported has no forward record
    (simulated by removing it): eager runs that backward, counted."""

    def build(tr):
        x = torch.randn(3, requires_grad=True)
        y = Scaled.apply(x, 2.0, torch.ones(3))
        del y.grad_fn.__dict__["_cagrad_record"]
        y.sum().backward()
        return [x.grad]

    (e, _), (c, _) = run_both_traced(build)
    same(e[0], c[0])
    assert cagrad.counters["fallback_reasons"]["custom_function_unrecorded"] == 1
