"""cagrad.torch_compat.install()/uninstall(): torch's entry points served by cagrad.

After install(), ``torch._dynamo.compiled_autograd._enable`` / ``_disable`` /
``reset`` are cagrad's, so ``torch._dynamo.config.compiled_autograd = True``
(torch.compile enters ``_enable`` around every call of the compiled function)
runs backward through cagrad; after uninstall() torch is as it was.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo import compiled_autograd, config
from torch._dynamo import trace_rules
from torch._dynamo.utils import counters
from torch.autograd.variable import Variable

import cagrad
import cagrad.torch_compat as tc

ORIGINALS = {name: getattr(compiled_autograd, name) for name in ("_enable", "_disable", "reset")}
EAGER_ENGINE = Variable._execution_engine


@pytest.fixture(autouse=True)
def clean_state():
    depth = compiled_autograd.depth
    tc.uninstall()
    config.compiled_autograd = False
    tc.reset()
    torch._dynamo.reset()
    counters.clear()
    yield
    tc.uninstall()
    config.compiled_autograd = False
    assert compiled_autograd.compiled_autograd_enabled is False
    assert compiled_autograd.in_compiled_autograd_region is False
    assert compiled_autograd.active_disable_ctx is False
    assert compiled_autograd.depth == depth
    assert Variable._execution_engine is EAGER_ENGINE
    for name, fn in ORIGINALS.items():
        assert getattr(compiled_autograd, name) is fn, name
    tc.reset()
    torch._dynamo.reset()
    counters.clear()


def train_fn():
    """torch's test_torch_compile_api_* function: 3 steps in one compiled call."""
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sigmoid())
    res = []
    for _ in range(3):
        x = torch.randn([1, 4])
        result = model(x).sum()
        result.backward()
        res.append(model[0].weight.grad)
        res.append(model[0].bias.grad)
        model.zero_grad()
    return res


def test_install_uninstall_round_trip():
    skip_dirs = list(trace_rules.SKIP_DIRS)
    tc.install()
    tc.install()  # idempotent
    assert tc.is_installed()
    assert compiled_autograd._enable is tc._enable
    assert compiled_autograd._disable is tc._disable
    assert compiled_autograd.reset is tc.reset
    tc.uninstall()
    tc.uninstall()  # idempotent
    assert not tc.is_installed()
    for name, fn in ORIGINALS.items():
        assert getattr(compiled_autograd, name) is fn, name
    assert trace_rules.SKIP_DIRS == skip_dirs
    with tc.installed():
        assert compiled_autograd._enable is tc._enable
    assert compiled_autograd._enable is ORIGINALS["_enable"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_config_compiled_autograd_runs_on_cagrad(backend):
    """torch's test_torch_compile_api_{eager,aot_eager}, after install()."""
    tc.install()
    expected = train_fn()
    with config.patch(compiled_autograd=True):
        compiled_fn = torch.compile(train_fn, backend=backend)
    actual = compiled_fn()
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e)
    assert counters["compiled_autograd"]["captures"] == 1
    assert cagrad.counters["backwards"] == 3
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 2
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    # the next call enters _enable with a fresh compiler: torch's cache is
    # one for all compilers, and so is cagrad's behind the compat layer
    compiled_fn()
    assert counters["compiled_autograd"]["captures"] == 1
    assert cagrad.counters["cache_hits"] == 5
    assert compiled_autograd.compiled_autograd_enabled is False


def test_multiple_torch_compile():
    """torch's test_multiple_torch_compile: only the function compiled with
    config.compiled_autograd=True captures."""
    tc.install()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sigmoid())
    x = torch.randn([1, 4])

    def fn():
        model(x).sum().backward()

    model2 = torch.nn.Linear(4, 4)
    x2 = torch.randn([1, 4])

    def fn2():
        model2(x2).sum().backward()

    torch.compile(fn, backend="eager")()
    assert counters["compiled_autograd"]["captures"] == 0
    counters.clear()
    with config.patch(compiled_autograd=True):
        torch.compile(fn2, backend="eager")()
        assert counters["compiled_autograd"]["captures"] == 1
        counters.clear()
    torch.compile(fn, backend="eager")()
    assert counters["compiled_autograd"]["captures"] == 0
    assert cagrad.counters["backwards"] == 1


def test_graph_break_backward_in_disabled_fn():
    """torch's test_torch_compile_graph_break2."""
    tc.install()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sigmoid())
    x = torch.randn([1, 4])

    @torch._dynamo.disable()
    def inner_fn(loss):
        loss.backward()

    def fn():
        inner_fn(model(x).sum())

    with config.patch(compiled_autograd=True):
        torch.compile(fn, backend="eager")()
    assert counters["compiled_autograd"]["captures"] == 1
    assert cagrad.counters["captures"] == 1


def test_dynamo_reset_reaches_cagrad():
    tc.install()
    with compiled_autograd._enable(lambda gm: gm):
        w = torch.randn(3, requires_grad=True)
        w.sin().sum().backward()
    assert cagrad.counters["captures"] == 1
    torch._dynamo.reset()  # calls compiled_autograd.reset(): cagrad's now
    assert cagrad.counters["captures"] == 0


def test_after_uninstall_torch_runs_its_own():
    """After uninstall, torch's compiled autograd works and cagrad sees nothing."""
    tc.install()
    with config.patch(compiled_autograd=True):
        torch.compile(train_fn, backend="eager")()
    assert cagrad.counters["captures"] == 1
    tc.uninstall()
    before = cagrad.counters.snapshot()
    counters.clear()
    expected = train_fn()
    with config.patch(compiled_autograd=True):
        actual = torch.compile(train_fn, backend="eager")()
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e)
    assert counters["compiled_autograd"]["captures"] == 1  # torch's own capture
    with compiled_autograd._enable(lambda gm: gm):
        w = torch.randn(3, requires_grad=True)
        w.cos().sum().backward()
        assert w.grad is not None
    assert cagrad.counters.snapshot() == before


def test_intermediate_hook_in_aot_forward():
    """A tensor hook registered inside a torch.compile'd forward under compiled
    autograd becomes a BackwardState input of the AOT backward; cagrad inlines
    that backward and calls the hook on this backward's BackwardState."""

    def fn(x, w):
        y = x @ w
        y.register_hook(lambda g: g * 2)
        return y.sin().sum()

    x = torch.randn(3, 4)
    w = torch.randn(4, 4, requires_grad=True)
    fn(x, w).backward()
    expected, w.grad = w.grad, None
    # torch's own compiled autograd runs it
    with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager", fullgraph=True)):
        torch.compile(fn, backend="aot_eager")(x, w).backward()
    torch.testing.assert_close(w.grad, expected)
    w.grad = None
    torch._dynamo.reset()
    tc.install()
    before = cagrad.counters.snapshot()
    with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager", fullgraph=True)):
        torch.compile(fn, backend="aot_eager")(x, w).backward()
    torch.testing.assert_close(w.grad, expected)
    after = cagrad.counters.snapshot()
    assert after["captures"] == before["captures"] + 1
    assert after["fallbacks"] == before["fallbacks"]
