"""cagrad.torch_compat._enable against the contract of torch's compiled_autograd._enable.

Written in the style of torch's test/inductor/test_compiled_autograd.py: the
same seed (123), a generator ``fn`` run eagerly and then under the context,
outputs compared, ``counters["compiled_autograd"]["captures"]`` and the
compiler's own ``compiles`` count checked. The compilers use Dynamo with the
eager backend (one at most compiles with inductor, marked ``inductor``).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch._dynamo import compiled_autograd
from torch._dynamo.utils import counters
from torch.autograd.variable import Variable

import cagrad
import cagrad.torch_compat as tc

TORCH_ENABLE = tc._ORIGINALS["_enable"]
TORCH_DISABLE = tc._ORIGINALS["_disable"]
EAGER_ENGINE = Variable._execution_engine


def make_compiler_fn(fullgraph=True, dynamic=True, backend="eager", gm_hook=lambda gm: None):
    """torch's test helper: torch.compile, counting Dynamo graphs in ``compiles``."""
    assert backend in ["inductor", "aot_eager", "eager", "ca_eager"]

    def _compiler_fn(gm):
        gm_hook(gm)
        if backend == "ca_eager":
            return gm

        def _inner_compiler(gm_, example_inputs_):
            counters["compiled_autograd"]["compiles"] += 1
            if backend == "inductor":
                from torch import _inductor

                return _inductor.compile(gm_, example_inputs_)
            if backend == "aot_eager":
                from torch._dynamo.backends.debugging import aot_eager

                return aot_eager(gm_, example_inputs_)
            return gm_.forward

        return torch.compile(gm, backend=_inner_compiler, fullgraph=fullgraph, dynamic=dynamic)

    return _compiler_fn


compiler_fn = make_compiler_fn()


SEGMENTS = object()


def hook1(grad):
    return grad * 2


def hook2(grads):
    return (grads[0] + 1,)


def hook3(gI, gO):
    return (torch.sin(gI[0]) + gO[0],)


@pytest.fixture(autouse=True)
def clean_state():
    """Every test starts and ends as a fresh process would (torch's setUp/tearDown)."""
    depth = compiled_autograd.depth
    tc.uninstall()
    torch._dynamo.config.compiled_autograd = False
    tc.reset()
    torch._dynamo.reset()
    counters.clear()
    yield
    # nothing leaks out of a test: flags, engine, torch's functions
    assert compiled_autograd.compiled_autograd_enabled is False
    assert compiled_autograd.in_compiled_autograd_region is False
    assert compiled_autograd.active_disable_ctx is False
    assert compiled_autograd.depth == depth
    assert Variable._execution_engine is EAGER_ENGINE
    assert compiled_autograd._enable is TORCH_ENABLE
    assert compiled_autograd._disable is TORCH_DISABLE
    tc.reset()
    counters.clear()


def check_output_and_recompiles(fn, count=1, compiler_fn=compiler_fn, compile_fn=False, dynamic=True):
    """torch's helper, on cagrad: ``count`` is captures, or [captures, compiles].

    ``compiles`` may be ``SEGMENTS``: cagrad cuts a backward at hooks and at
    nodes it runs opaquely (custom Functions) and compiles each segment, where
    torch compiles one graph per capture; then the compiler must have run
    once per segment of every capture.
    """
    if isinstance(count, list):
        captures, compiles = count
    else:
        captures, compiles = count, count
    segments = []
    with torch.autograd.set_multithreading_enabled(False):
        torch._dynamo.reset()
        counters["compiled_autograd"].clear()
        torch.manual_seed(123)
        expected = list(fn())
        torch.manual_seed(123)
        cagrad.events.on_capture.append(lambda e: segments.append(e.num_segments))
        try:
            with tc._enable(compiler_fn, dynamic=dynamic):
                opt_fn = torch.compile(fn, backend="eager") if compile_fn else fn
                actual = list(opt_fn())
        finally:
            cagrad.events.on_capture.pop()
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e)
    assert counters["compiled_autograd"]["captures"] == captures
    if compiles is SEGMENTS:
        assert sum(segments) > captures  # the case is meant to be segmented
        compiles = sum(segments)
    assert counters["compiled_autograd"]["compiles"] == compiles
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


# --- outputs and counts ------------------------------------------------------


def _two_layer_backward():
    """One backward of a fresh Linear-ReLU-Linear-ReLU; yields its grads."""
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        torch.nn.ReLU(),
        torch.nn.Linear(4, 4),
        torch.nn.ReLU(),
    )
    x = torch.randn([2, 4])
    result = model(x).sum()
    result.backward()
    yield model[0].weight.grad
    yield model[0].bias.grad
    yield model[2].weight.grad
    yield model[2].bias.grad


def test_basic():
    check_output_and_recompiles(_two_layer_backward)


def test_mlp_training_step():
    """A few SGD steps: parameters, losses and grads equal eager's."""

    def fn():
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            x, y = torch.randn(5, 8), torch.randn(5, 4)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            yield loss.detach()
            yield from (p.detach().clone() for p in model.parameters())

    check_output_and_recompiles(fn)
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 2


def test_cache_hit():
    def fn():
        for _ in range(3):
            yield from _two_layer_backward()

    check_output_and_recompiles(fn)
    assert cagrad.counters["cache_hits"] == 2


def test_graph_change():
    def fn():
        for act in (torch.nn.ReLU(), torch.nn.Sigmoid(), torch.nn.ReLU()):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), act)
            x = torch.randn([2, 4])
            model(x).sum().backward()
            yield model[0].weight.grad
            yield model[0].bias.grad

    check_output_and_recompiles(fn, count=2)


def test_cache_shared_across_contexts():
    """torch keeps one cache whatever the compiler: a second context hits."""

    def step():
        torch.manual_seed(123)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        model(torch.randn(2, 4)).sum().backward()
        return model[0].weight.grad

    calls = []
    for _ in range(3):
        with tc._enable(make_compiler_fn(gm_hook=calls.append)):
            step()
    assert counters["compiled_autograd"]["captures"] == 1
    assert len(calls) == 1
    tc.reset()
    with tc._enable(make_compiler_fn(gm_hook=calls.append)):
        step()
    assert counters["compiled_autograd"]["captures"] == 2  # reset emptied it
    assert len(calls) == 2


@pytest.mark.parametrize("dynamic,captures", [(True, 1), (False, 2)])
def test_dynamic(dynamic, captures):
    """dynamic=True: sizes symbolic from the start; False: static, then
    dynamic after the first change (torch's SizeInput STATIC -> DYNAMIC)."""

    def fn():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        for batch in (2, 3, 5):
            model.zero_grad()
            model(torch.randn(batch, 4)).sum().backward()
            yield model[0].weight.grad.clone()
            yield model[0].bias.grad.clone()

    check_output_and_recompiles(fn, count=captures, dynamic=dynamic)


def test_tensor_grad_hooks():
    """Leaf hook (hook1), intermediate hook scaling the grad, node pre/post
    hooks: equal results, one capture, cache hits after it. All four are
    pure, so cagrad traces them into one graph, compiled once, as torch's
    compiled autograd does."""

    def fn():
        for _ in range(3):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
            x = torch.randn([2, 4])
            model[0].weight.register_hook(hook1)
            h = model(x)
            h.register_hook(lambda g: g * 0.5)
            result = h.sum()
            result.grad_fn.register_prehook(hook2)
            result.grad_fn.register_hook(hook3)
            result.backward()
            yield model[0].weight.grad
            yield model[0].bias.grad

    check_output_and_recompiles(fn, count=[1, 1])
    assert cagrad.counters["cache_hits"] == 2
    assert cagrad.counters["hooks_traced"] == 4


def test_custom_autograd_function():
    class MySin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.sin(x)

        @staticmethod
        def backward(ctx, gO):
            (x,) = ctx.saved_tensors
            return gO * torch.cos(x)

    def fn():
        for _ in range(3):
            x = torch.randn([2, 4], requires_grad=True)
            w = torch.randn([4, 4], requires_grad=True)
            MySin.apply(x @ w).sum().backward()
            yield x.grad
            yield w.grad

    # its backward is traced (cagrad.hooks.backward_tracing): one graph, as torch's
    check_output_and_recompiles(fn, count=[1, 1])
    assert cagrad.counters["custom_functions_traced"] == 1


def test_torch_compiled_forward():
    """A torch.compile'd (aot_eager) model: its CompiledFunctionBackward runs
    in cagrad's graph; AOTAutograd's own backward (joint trace, under
    ``_disable()``) never reaches cagrad."""

    def fn():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sigmoid())
        opt_model = torch.compile(model, backend="aot_eager", fullgraph=True)
        for _ in range(3):
            x = torch.randn([1, 4])
            opt_model(x).sum().backward()
            yield model[0].weight.grad
            yield model[0].bias.grad
            model.zero_grad()

    check_output_and_recompiles(fn, count=[1, 1])
    assert cagrad.counters["backwards"] == 3  # AOT's trace-time backward ran eagerly


def test_backward_inside_compiled_function():
    """check_output_and_recompiles(compile_fn=True): backward is called from a
    torch.compile'd function (after its graph break); Dynamo does not trace
    cagrad's own frames."""

    def fn():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        x = torch.randn([2, 4])
        model(x).sum().backward()
        yield model[0].weight.grad
        yield model[0].bias.grad

    check_output_and_recompiles(fn, compile_fn=True)


def test_compile_ids():
    """Dynamo compiles the graph of capture N in CompileContext "!N/..."."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(torch._guards.CompileContext.current_compile_id())
        return gm.forward

    def compiler(gm):
        return torch.compile(gm, backend=backend, fullgraph=True)

    with tc._enable(compiler):
        for act in (torch.relu, torch.sigmoid):
            w = torch.randn(4, requires_grad=True)
            act(w * 2).sum().backward()
    assert [cid.compiled_autograd_id for cid in seen] == [0, 1]
    assert str(seen[0]).startswith("!0/")


@pytest.mark.inductor
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_basic_inductor():
    def fn():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        for _ in range(2):
            x = torch.randn([2, 4])
            model(x).sum().backward()
            yield model[0].weight.grad.clone()
            yield model[2].bias.grad.clone()

    check_output_and_recompiles(fn, compiler_fn=make_compiler_fn(backend="inductor"))


# --- the context manager's contract -------------------------------------------


def _backward():
    w = torch.randn(3, requires_grad=True)
    (w.sin() * 2).sum().backward()
    return w.grad


def test_flags_inside_and_outside():
    assert compiled_autograd.compiled_autograd_enabled is False
    with tc._enable(compiler_fn):
        assert compiled_autograd.compiled_autograd_enabled is True
        assert compiled_autograd.in_compiled_autograd_region is False
        # AOTAutograd/Inductor/functorch enter torch's _disable by name: it is
        # cagrad-aware while a context is open, torch's own afterwards
        assert compiled_autograd._disable is tc._disable
    assert compiled_autograd.compiled_autograd_enabled is False
    assert compiled_autograd._disable is TORCH_DISABLE


def _observe_flags(enable):
    """Flags seen at each point of one backward with hooks, under ``enable``."""
    log = []

    def flags(tag):
        log.append(
            (
                tag,
                compiled_autograd.compiled_autograd_enabled,
                compiled_autograd.in_compiled_autograd_region,
                compiled_autograd.active_disable_ctx,
            )
        )

    def compiler(gm):
        flags("compiler_fn")
        return gm  # no Dynamo: hooks run for real inside the compiled code

    torch.manual_seed(123)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)

    def tensor_hook(g):
        flags("tensor_hook")
        return g * 2

    w.register_post_accumulate_grad_hook(lambda p: flags("post_accumulate_grad_hook"))
    with enable(compiler):
        flags("enter")
        y = x @ w
        y.register_hook(tensor_hook)
        y.relu().sum().backward()
        flags("after_backward")
    flags("exit")
    return log, w.grad


def test_flags_match_torch():
    """The flags a compiler_fn and hooks observe are torch's own."""
    expected, expected_grad = _observe_flags(TORCH_ENABLE)
    assert counters["compiled_autograd"]["captures"] == 1
    actual, actual_grad = _observe_flags(tc._enable)
    assert counters["compiled_autograd"]["captures"] == 2
    torch.testing.assert_close(actual_grad, expected_grad)
    # cagrad calls the compiler once per segment; dedupe consecutive entries
    dedup = [k for k, _ in itertools.groupby(actual)]
    assert dedup == expected
    assert ("tensor_hook", False, True, True) in actual
    assert ("compiler_fn", True, False, False) in actual


def test_flags_restored_when_backward_raises():
    def bad_hook(g):
        raise ValueError("hook failed")

    with tc._enable(make_compiler_fn(backend="ca_eager")):
        w = torch.randn(3, requires_grad=True)
        y = w * 2
        y.register_hook(bad_hook)
        with pytest.raises(ValueError, match="hook failed"):
            y.sum().backward()
        assert compiled_autograd.in_compiled_autograd_region is False
        assert compiled_autograd.compiled_autograd_enabled is True
        assert compiled_autograd.active_disable_ctx is False
    assert compiled_autograd.compiled_autograd_enabled is False


def test_flags_restored_when_body_raises():
    with pytest.raises(KeyError):
        with tc._enable(compiler_fn):
            raise KeyError("x")
    assert compiled_autograd.compiled_autograd_enabled is False
    assert Variable._execution_engine is EAGER_ENGINE


def test_dynamic_must_be_bool():
    with pytest.raises(AssertionError, match="Expected dynamic to be bool"):
        with tc._enable(compiler_fn, dynamic=1):
            pass
    with tc._enable(compiler_fn, dynamic=False):  # falsy non-bools pass, as in torch
        pass


def test_nested_inner_wins():
    outer_calls, inner_calls = [], []
    outer = make_compiler_fn(backend="ca_eager", gm_hook=outer_calls.append)
    inner = make_compiler_fn(backend="ca_eager", gm_hook=inner_calls.append)
    with tc._enable(outer):
        with tc._enable(inner):
            assert compiled_autograd.depth >= 2
            _backward()
        assert (len(outer_calls), len(inner_calls)) == (0, 1)
        assert compiled_autograd.compiled_autograd_enabled is True
        w = torch.randn(3, requires_grad=True)
        w.cos().sum().backward()  # a new graph: the outer compiler
        assert (len(outer_calls), len(inner_calls)) == (1, 1)
    assert counters["compiled_autograd"]["captures"] == 2


def test_nested_context_manager():
    """torch's test_nested_context_manager, with cagrad behind it."""

    def ctx():
        return tc._enable(torch.compile)

    # ok
    outer = ctx()
    inner = ctx()
    outer.__enter__()
    inner.__enter__()
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)

    # not ok
    outer = ctx()
    inner = ctx()
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(
        AssertionError,
        match="Nested Compiled Autograd Contexts must return before their parent context",
    ):
        outer.__exit__(None, None, None)
    # both are shut down: backward is eager again
    assert compiled_autograd.compiled_autograd_enabled is False
    assert Variable._execution_engine is EAGER_ENGINE
    _backward()
    assert cagrad.counters["backwards"] == 0
    # the inner one's late exit reports the same misuse, as torch's does
    with pytest.raises(AssertionError, match="Nested Compiled Autograd Contexts"):
        inner.__exit__(None, None, None)


def test_disable_inside():
    with tc._enable(compiler_fn):
        _backward()
        assert cagrad.counters["backwards"] == 1
        with tc._disable():
            assert compiled_autograd.compiled_autograd_enabled is False
            assert compiled_autograd.active_disable_ctx is True
            eager_grad = _backward()
            assert cagrad.counters["backwards"] == 1  # eager ran it
            # the torch.compile(config.compiled_autograd=True) path: no-op here
            with tc._enable(compiler_fn, ignore_active_disable_ctx=False):
                _backward()
                assert cagrad.counters["backwards"] == 1
            # the default ignores the disable context
            with tc._enable(compiler_fn):
                assert compiled_autograd.compiled_autograd_enabled is True
                _backward()
                assert cagrad.counters["backwards"] == 2
            assert compiled_autograd.compiled_autograd_enabled is False
            _backward()
            assert cagrad.counters["backwards"] == 2
        assert compiled_autograd.compiled_autograd_enabled is True
        assert compiled_autograd.active_disable_ctx is False
        torch.manual_seed(0)
        compiled_grad = _backward()
        assert cagrad.counters["backwards"] == 3
    torch.manual_seed(0)
    torch.testing.assert_close(compiled_grad, _backward())
    assert eager_grad is not None


def test_force_eager_stance():
    with torch.compiler.set_stance("force_eager"):
        with tc._enable(compiler_fn):
            assert compiled_autograd.compiled_autograd_enabled_force_eager is True
            assert compiled_autograd.compiled_autograd_enabled is False
            _backward()
        assert compiled_autograd.compiled_autograd_enabled_force_eager is False
    assert cagrad.counters["backwards"] == 0
    assert counters["compiled_autograd"]["captures"] == 0


def test_reset():
    with tc._enable(compiler_fn):
        _backward()
    assert cagrad.counters["captures"] == 1
    tc.reset()
    assert cagrad.counters["captures"] == 0
    assert next(compiled_autograd.COMPILE_COUNTER) == 0
    with tc._enable(compiler_fn):
        _backward()  # the cache was emptied: captured again
    assert cagrad.counters["captures"] == 1


def test_reset_inside_region_raises():
    def hook(g):
        tc.reset()
        return g

    with tc._enable(make_compiler_fn(backend="ca_eager")):
        w = torch.randn(3, requires_grad=True)
        y = w * 2
        y.register_hook(hook)
        # torch's own check raises (its message differs across 2.11-2.13)
        with pytest.raises(AssertionError):
            y.sum().backward()


def test_reset_shuts_open_contexts():
    ctx = tc._enable(compiler_fn)
    ctx.__enter__()  # left open, as a failed test would
    tc.reset()
    assert compiled_autograd.compiled_autograd_enabled is False
    assert Variable._execution_engine is EAGER_ENGINE
    _backward()
    assert cagrad.counters["backwards"] == 0
    ctx.__exit__(None, None, None)  # a late exit is harmless


def test_functools_partial_compiler():
    """torch's tests often pass functools.partial(torch.compile, ...)."""

    def fn():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        model(torch.randn(2, 4)).sum().backward()
        yield model[0].weight.grad

    check_output_and_recompiles(
        fn, count=[1, 0], compiler_fn=functools.partial(torch.compile, backend="eager", fullgraph=True)
    )


def test_torch_internal_disable_bypasses_cagrad():
    """functorch (like AOTAutograd and Inductor) runs its own backward inside
    ``compiled_autograd._disable()``: eager autograd, not cagrad."""
    x = torch.randn(5)
    with tc._enable(compiler_fn):
        g = torch.func.grad(lambda t: t.sin().sum())(x)
    torch.testing.assert_close(g, x.cos())
    assert cagrad.counters["backwards"] == 0


def test_mark_dynamic_stays_symbolic_in_the_backward():
    # torch's test_dynamic_shapes_annotations, with eager's gradients and
    # cagrad's counters: x (marked) is saved by the compiled forward and
    # lifted into cagrad's graph; torch.compile as compiler_fn used to raise
    # ConstraintViolationError on it (the backward fell back to eager)
    f = torch.compile(lambda x: x.sin().sin(), backend="aot_eager")

    def expected_grad(x):
        return x.cos() * x.sin().cos()

    cagrad.reset()
    with tc._enable(functools.partial(torch.compile, backend="aot_eager")):
        for n in (2, 4, 7):
            x = torch.randn(n, 3, requires_grad=True)
            torch._dynamo.mark_dynamic(x, 0)
            f(x).sum().backward()
            torch.testing.assert_close(x.grad, expected_grad(x.detach()))
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert counters["compiled_autograd"]["captures"] == 1
    assert cagrad.counters["cache_hits"] == 2
