"""Custom autograd.Function backwards traced into the graph
(cagrad.hooks.backward_tracing).

A backward in the accepted class is traced with PyNode's steps, so the
backward compiles as one graph; one with a side effect, or one that does
not trace, runs opaque and does its side effect on every backward, as
eager. Every case compares gradients with eager autograd's, bit for bit,
and counts graphs (a segmented backward hands one graph per segment to the
compiler) and ``custom_functions_traced``.
"""

from __future__ import annotations

import pytest
import torch

import cagrad
from cagrad.hooks import backward_tracing
from fuzz.functions import MaxWithIndex

from .conftest import same
from .test_custom_function import OnceDiff

CALLS: list[int] = []  # appended to by an opaque backward below
COUNT = 0  # incremented by an opaque backward below
SHIFT = 1.0  # read as a global by a traced backward below


class Recorder:
    """compiler_fn that keeps each GraphModule it is given and runs it."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs=None):
        self.graphs.append(gm)
        return gm

    def targets(self) -> set:
        return {n.target for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"}


class Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, w):
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        ctx.shape = x.shape
        return x * w * scale

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = (g * w * ctx.scale).reshape(ctx.shape) if ctx.needs_input_grad[0] else None
        gw = g * x * ctx.scale + SHIFT if ctx.needs_input_grad[2] else None
        return gx, None, gw


class Appends(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        CALLS.append(1)
        return g * 2


class Counts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        global COUNT
        COUNT = COUNT + 1
        return g * 2


class Prints(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        print("backward of Prints")
        return g * 2


class WritesCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.calls = 0
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.calls = ctx.calls + 1
        return g * (1 + ctx.calls)


class NotMaterialized(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        # the unused output's gradient is None, not zeros: a materialized
        # zero would add 1 here
        if g2 is None:
            return g1 * 2
        return g1 * 2 + g2 * 3 + 1


class Materialized(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        idx = torch.arange(x.shape[-1])
        ctx.mark_non_differentiable(idx)
        return x * 2, x * 3, idx

    @staticmethod
    def backward(ctx, g1, g2, g_idx):
        # g2 and g_idx arrive as materialized zeros
        return g1 * 2 + g2 * 3 + g_idx.to(g1.dtype)


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 3 * x * x


class NonTensorInputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, x, name, w):
        ctx.k = k
        ctx.name = name
        return x * k + w

    @staticmethod
    def backward(ctx, g):
        scale = 2.0 if ctx.name == "double" else 1.0
        return None, g * ctx.k * scale, None, g.sum(0), None, None  # extra trailing Nones


class ReadsValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if x.sum() > 0:  # data-dependent: does not trace on fake tensors
            return g * 2
        return g * -2


class CallsItem(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * float(x.max())  # a value read: fails on fake tensors


class Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 + torch.randn_like(g)


class TensorOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.w = x.detach() * 3  # a tensor that is not saved
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * ctx.w


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class Raises(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise ValueError("the backward of Raises")


def _steps(fn, steps: int = 3, create_graph: bool = False):
    """``fn(x, w, step)`` builds a loss; returns the leaves' gradients of
    ``steps`` backwards, from the same seed."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    out = []
    for step in range(steps):
        loss = fn(x, w, step)
        if create_graph:
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            gx.pow(2).sum().backward()
        else:
            loss.backward()
        out.append((x.grad, w.grad))
        x.grad = w.grad = None
    return out


def _check(fn, steps: int = 3, create_graph: bool = False) -> Recorder:
    expected = _steps(fn, steps, create_graph)
    rec = Recorder()
    with cagrad.enable(rec):
        actual = _steps(fn, steps, create_graph)
    for (ex, ew), (ax, aw) in zip(expected, actual):
        same(ex, ax)
        same(ew, aw)
        for e, a in ((ex, ax), (ew, aw)):
            assert e is None or e.stride() == a.stride()  # .grad layout as eager's
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    return rec


def _whole(rec: Recorder) -> None:
    """Every capture compiled as one graph: no opaque call, no segment."""
    assert len(rec.graphs) == cagrad.counters["captures"]


def test_traceable_function_is_one_graph():
    rec = _check(lambda x, w, step: Scaled.apply(x.exp(), 1.5, w.tanh()).sum())
    assert cagrad.counters["captures"] == 1 and cagrad.counters["cache_hits"] == 2
    assert cagrad.counters["custom_functions_traced"] == 1
    assert cagrad.counters["nodes_forced_opaque"] == 0
    _whole(rec)
    assert torch.ops.aten.tanh_backward.default in rec.targets()


@pytest.mark.parametrize("cls", [Appends, Counts, Prints], ids=["append", "counter", "print"])
def test_side_effect_runs_opaque_on_every_backward(cls, capsys):
    global COUNT
    CALLS.clear()
    COUNT = 0
    fn = lambda x, w, step: cls.apply(x.exp() * w).sum()  # noqa: E731
    expected = _steps(fn)
    eager = (len(CALLS), COUNT, capsys.readouterr().out.count("backward of Prints"))
    assert sum(eager) == 3
    rec = Recorder()
    with cagrad.enable(rec):
        actual = _steps(fn)
    for (ex, ew), (ax, aw) in zip(expected, actual):
        same(ex, ax)
        same(ew, aw)
    ours = (len(CALLS) - eager[0], COUNT - eager[1], capsys.readouterr().out.count("backward of Prints"))
    assert ours == eager  # once per backward, as eager
    assert cagrad.counters["custom_functions_traced"] == 0
    assert cagrad.counters["fallbacks"] == 0
    assert len(rec.graphs) > cagrad.counters["captures"]  # segments around the call


def test_writing_ctx_in_backward_runs_opaque():
    rec = _check(lambda x, w, step: WritesCtx.apply(x.exp() * w).sum())
    assert cagrad.counters["custom_functions_traced"] == 0
    assert len(rec.graphs) > cagrad.counters["captures"]


def test_changed_ctx_value_recaptures():
    # ctx.scale = 1.5, 2.5, 1.5, 2.5: two graphs; a key without the value
    # would run the first graph (scale 1.5) at step 1
    rec = _check(lambda x, w, step: Scaled.apply(x.exp(), 1.5 + step % 2, w).sum(), steps=4)
    assert cagrad.counters["captures"] == 2 and cagrad.counters["cache_hits"] == 2
    _whole(rec)


def test_changed_global_recaptures():
    global SHIFT
    fn = lambda x, w, step: Scaled.apply(x, 2.0, w.exp()).sum()  # noqa: E731
    expected, actual = [], []
    rec = Recorder()
    try:
        for shift in (1.0, 4.0):
            SHIFT = shift
            expected += _steps(fn, steps=1)
            with cagrad.enable(rec):
                actual += _steps(fn, steps=1)
    finally:
        SHIFT = 1.0
    for (ex, ew), (ax, aw) in zip(expected, actual):
        same(ex, ax)
        same(ew, aw)
    assert cagrad.counters["captures"] == 2
    _whole(rec)


def _closure_function(c: float):
    class Closure(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * c

        @staticmethod
        def backward(ctx, g):
            return g * c

    return Closure


def test_changed_closure_value_and_redefined_class_recapture():
    # a class defined anew each step (same code): hits while c is the
    # same, recaptures when it changes
    values = [2.0, 2.0, 3.0, 3.0]
    rec = _check(lambda x, w, step: _closure_function(values[step]).apply(x * w).sum(), steps=4)
    assert cagrad.counters["captures"] == 2 and cagrad.counters["cache_hits"] == 2
    _whole(rec)


def test_redefined_backward_recaptures():
    class Redefined(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def backward_3(ctx, g):
        return g * 3

    backward_2 = Redefined.backward

    def fn(x, w, step):
        Redefined.backward = staticmethod(backward_3 if step == 2 else backward_2)
        return Redefined.apply(x * w).sum()

    rec = _check(fn)
    assert cagrad.counters["captures"] == 2 and cagrad.counters["cache_hits"] == 1
    _whole(rec)


def test_materialize_grads_false():
    rec = _check(lambda x, w, step: NotMaterialized.apply(x * w)[0].sum())
    assert cagrad.counters["custom_functions_traced"] == 1
    _whole(rec)


def test_materialized_zeros_for_unused_and_non_differentiable_outputs():
    rec = _check(lambda x, w, step: Materialized.apply(x * w)[0].sum())
    assert cagrad.counters["custom_functions_traced"] == 1
    _whole(rec)


def test_once_differentiable():
    rec = _check(lambda x, w, step: OnceDiff.apply(x * w).sum())
    assert cagrad.counters["custom_functions_traced"] == 1
    _whole(rec)


def test_once_differentiable_under_create_graph_raises_as_eager():
    def build():
        x = torch.randn(3, requires_grad=True)
        (g,) = torch.autograd.grad(OnceDiff.apply(x * 2).sum(), x, create_graph=True)
        g.sum().backward()

    with pytest.raises(RuntimeError) as eager:
        build()
    with cagrad.enable("eager"):
        with pytest.raises(RuntimeError) as ours:
            build()
    assert str(ours.value) == str(eager.value)
    assert cagrad.counters["custom_functions_traced"] == 0


def test_non_tensor_inputs_and_trailing_nones():
    rec = _check(lambda x, w, step: NonTensorInputs.apply(2.0, x.exp(), "double", w[0]).sum())
    assert cagrad.counters["custom_functions_traced"] == 1
    _whole(rec)


def test_create_graph_double_backward():
    _check(lambda x, w, step: Cube.apply(x * w).sum(), create_graph=True)
    assert cagrad.counters["custom_functions_traced"] >= 1
    assert cagrad.counters["nodes_forced_opaque"] == 0


@pytest.mark.parametrize("cls", [ReadsValue, CallsItem], ids=["branch", "float"])
def test_trace_failure_runs_opaque(cls):
    _check(lambda x, w, step: cls.apply(x * w).sum())
    assert cagrad.counters["custom_functions_traced"] == 0
    assert cagrad.counters["nodes_forced_opaque"] == 1
    assert cagrad.counters["opaque_reasons"][f"trace_failed:{cls.__name__}Backward"] == 1


def test_rng_in_backward_runs_opaque_and_keeps_eager_rng():
    fn = lambda x, w, step: Noisy.apply(x * w).sum()  # noqa: E731
    expected = _steps(fn)
    eager_state = torch.get_rng_state()
    with cagrad.enable(Recorder()):
        actual = _steps(fn)
    same(torch.get_rng_state(), eager_state)
    for (ex, ew), (ax, aw) in zip(expected, actual):
        same(ex, ax)
        same(ew, aw)
    assert cagrad.counters["custom_functions_traced"] == 0
    assert backward_tracing.fingerprint(Noisy.apply(torch.ones(1, requires_grad=True)).grad_fn, False) is None


def test_tensor_ctx_attribute_runs_opaque():
    _check(lambda x, w, step: TensorOnCtx.apply(x * w).sum())
    assert cagrad.counters["custom_functions_traced"] == 0
    assert cagrad.counters["nodes_forced_opaque"] == 0  # chosen opaque, not a failed trace


def test_backward_raising_raises_eager_type():
    def build():
        x = torch.randn(3, requires_grad=True)
        Raises.apply(x * 2).sum().backward()

    with pytest.raises(ValueError, match="the backward of Raises"):
        build()
    with cagrad.enable("eager"):
        with pytest.raises(ValueError, match="the backward of Raises"):
            build()


def test_user_code_before_the_function_changing_ctx_runs_it_opaque():
    """A hook that runs before the Function's node in the backward changes
    ``ctx.scale``: the value the key read is stale by then, so the node runs
    opaque (the hook's write is seen, as eager sees it)."""

    def fn(x, w, step):
        y = Scaled.apply(x, 1.5, w)

        def hook(g):
            y.grad_fn.scale = 4.0 + step  # runs before y's node
            return g

        z = y * 2
        z.register_hook(hook)
        return z.sum()

    rec = _check(fn)
    assert cagrad.counters["custom_functions_traced"] == 0
    assert len(rec.graphs) > cagrad.counters["captures"]


def test_own_pre_hook_changing_ctx_runs_it_opaque():
    def fn(x, w, step):
        y = Scaled.apply(x, 1.5, w)

        node = y.grad_fn

        def pre_hook(grads):
            node.scale = 4.0 + step

        node.register_prehook(pre_hook)
        return y.sum()

    _check(fn)
    assert cagrad.counters["custom_functions_traced"] == 0


def test_fingerprint():
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3)
    a = Scaled.apply(x, 1.5, w).grad_fn
    b = Scaled.apply(x, 1.5, w).grad_fn
    c = Scaled.apply(x, 2.5, w).grad_fn
    fa = backward_tracing.fingerprint(a, False)
    assert fa is not None and fa == backward_tracing.fingerprint(b, False)
    assert fa != backward_tracing.fingerprint(c, False)
    for cls in (Appends, Counts, Prints, WritesCtx, TensorOnCtx):
        assert backward_tracing.fingerprint(cls.apply(x).grad_fn, False) is None, cls
    once = OnceDiff.apply(x).grad_fn
    assert backward_tracing.fingerprint(once, False) is not None
    assert backward_tracing.fingerprint(once, True) is None


def test_changing_batch_sizes_with_materialized_zeros():
    """Sizes change every step (a dynamic capture after the first): the
    materialized zeros of the unused and non-differentiable outputs follow."""
    sizes = [3, 4, 5, 6]

    def fn(x, w, step):
        a = (x * w).expand(sizes[step], 4, 3).reshape(-1, 3)
        return Materialized.apply(a)[0].sum() + Cube.apply(a.cos()).sum()

    rec = _check(fn, steps=4)
    # a static capture, then one with dynamic sizes that the last two hit
    assert cagrad.counters["captures"] == 2 and cagrad.counters["cache_hits"] == 2
    assert cagrad.counters["recompiles_shape"] == 1
    assert cagrad.counters["nodes_forced_opaque"] == 0
    _whole(rec)


def test_ctx_size_is_size_slots_not_a_constant():
    """A ctx torch.Size (the fuzzer's fn_max keeps its input's) is keyed by
    size slots: a new shape makes one dynamic capture that later shapes
    hit, as a saved size does (a campaign found one capture per shape: fuzz
    seed 47, F002). Its length and a change of the other ctx values still
    recapture."""
    sizes = [3, 4, 5, 6]

    def fn(x, w, step):
        a = (x * w).expand(sizes[step], 4, 3).reshape(-1, 3)
        return MaxWithIndex.apply(a, 1)[0].sum()

    rec = _check(fn, steps=4)
    assert cagrad.counters["captures"] == 2 and cagrad.counters["cache_hits"] == 2
    assert cagrad.counters["recompiles_shape"] == 1
    assert cagrad.counters["custom_functions_traced"] == 2
    _whole(rec)
    x = torch.randn(3, 4, requires_grad=True)
    a = MaxWithIndex.apply(x, 1)[0].grad_fn
    b = MaxWithIndex.apply(torch.randn(5, 4, requires_grad=True), 1)[0].grad_fn
    c = MaxWithIndex.apply(x, 0)[0].grad_fn
    d = MaxWithIndex.apply(torch.randn(2, 3, 4, requires_grad=True), 1)[0].grad_fn
    fa = backward_tracing.fingerprint(a, False)
    assert fa == backward_tracing.fingerprint(b, False)  # the values: slots
    assert fa != backward_tracing.fingerprint(c, False)  # ctx.dim
    assert fa != backward_tracing.fingerprint(d, False)  # the length
    assert backward_tracing.ctx_sizes(a, False) == [("shape", torch.Size([3, 4]))]


def test_traced_tensor_hook_beside_a_traced_function_is_one_graph():
    """A traced custom Function is no user code: a pure tensor hook in the
    same backward is traced too."""

    def fn(x, w, step):
        y = Scaled.apply(x.exp(), 1.5, w)
        y.register_hook(lambda g: g * 3)
        return y.sum()

    rec = _check(fn)
    assert cagrad.counters["hooks_traced"] == 1 and cagrad.counters["custom_functions_traced"] == 1
    _whole(rec)


def test_opaque_after_own_pre_hook_is_keyed_apart_from_untraceable():
    """The same Function with a node pre-hook, its backward traceable at
    step 0 (opaque because of the hook, its node listed after the hook)
    and not at step 1 (its node listed first): two keys, two captures."""

    class Flip(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

    def traceable(ctx, g):
        return g * 2

    def untraceable(ctx, g):
        CALLS.append(1)
        return g * 2

    def fn(x, w, step):
        Flip.backward = staticmethod(traceable if step == 0 else untraceable)
        y = Flip.apply(x * w)
        y.grad_fn.register_prehook(lambda grads: (grads[0] * 3,))
        return y.sum()

    _check(fn, steps=2)
    assert cagrad.counters["captures"] == 2


def test_returned_incoming_gradient_reaches_grad_in_eager_layout():
    """The backward hands its (transposed) incoming gradient on as it is:
    ``.grad`` gets eager's values and strides."""
    c = torch.randn(3, 4)
    rec = _check(lambda x, w, step: (Identity.apply(x).t() * c).sum() + (w * 2).sum())
    assert cagrad.counters["custom_functions_traced"] == 1
    _whole(rec)
