"""Double backward compiled: ``create_graph=True`` then a backward through it.

The first backward runs compiled with grad mode on, so what it returns (and
what it puts in ``.grad``) is differentiable; the second backward walks the
graph the first one recorded. Every case compares with eager bit for bit
(eager and aot_eager backends run the same aten kernels), checks that the
intermediate gradients are differentiable where eager's are, and that both
backwards compiled (no fallback).
"""

from __future__ import annotations

import pytest
import torch

import cagrad

from .conftest import compiled_without_fallback, run_both, same

BACKENDS = ["eager", "aot_eager"]


def gradient_penalty():
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4, requires_grad=True)
    out = (x @ w).tanh().sum()
    gx, gw = torch.autograd.grad(out, (x, w), create_graph=True)
    differentiable = [gx.grad_fn is not None, gw.grad_fn is not None]
    (out + gx.pow(2).sum() + gw.norm()).backward()
    return [w.grad, x.grad, torch.tensor(differentiable)]


def hessian_vector_product():
    w = torch.randn(6, requires_grad=True)
    v = torch.randn(6)
    loss = (w.sin() * w.exp()).sum() + w.pow(3).sum()
    (g,) = torch.autograd.grad(loss, w, create_graph=True)
    (hv,) = torch.autograd.grad(g, w, v)
    return [g.detach(), hv]


def backward_with_create_graph_into_dot_grad():
    w = torch.randn(3, 3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    for _ in range(2):  # the second time .grad is set: out-of-place sum
        ((w @ b).exp().sum()).backward(create_graph=True)
    grads = [w.grad.detach().clone(), b.grad.detach().clone()]
    differentiable = torch.tensor([w.grad.grad_fn is not None, b.grad.grad_fn is not None])
    penalty = w.grad.pow(2).sum() + b.grad.sum()
    w.grad = None
    b.grad = None
    penalty.backward()
    return [*grads, differentiable, w.grad, b.grad]


def hooks_see_differentiable_grads():
    x = torch.randn(4, requires_grad=True)
    seen = []
    y = x.exp()
    y.register_hook(lambda g: seen.append(g.requires_grad) or g * 2)
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    g.sum().backward()
    return [g.detach(), x.grad, torch.tensor(seen)]


CASES = {
    "gradient_penalty": gradient_penalty,
    "hessian_vector_product": hessian_vector_product,
    "backward_create_graph": backward_with_create_graph_into_dot_grad,
    "hooks": hooks_see_differentiable_grads,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_double_backward_equals_eager_and_compiles(name, backend):
    expected, actual = run_both(CASES[name], backend)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        same(e, a)
    compiled_without_fallback()
    assert cagrad.counters["backwards"] >= 2


def test_a_create_graph_backward_is_a_graph_of_its_own():
    def step(create_graph: bool):
        x = torch.randn(3, requires_grad=True)
        (g,) = torch.autograd.grad(x.sin().sum(), x, create_graph=create_graph)
        return g

    with cagrad.enable("eager"):
        plain = step(False)
        double = step(True)
        step(True)
    assert plain.grad_fn is None and double.grad_fn is not None
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["cache_hits"] == 1


def test_once_differentiable_still_refuses_a_second_backward():
    from torch.autograd.function import once_differentiable

    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x * x * g

    def build():
        x = torch.randn(3, requires_grad=True)
        go = torch.ones(3, requires_grad=True)  # so the wrapper sees a grad needing grad
        (g,) = torch.autograd.grad(Cube.apply(x), x, go, create_graph=True)
        g.sum().backward()

    errors = []
    for use_cagrad in (False, True):
        try:
            if use_cagrad:
                with cagrad.enable("eager"):
                    build()
            else:
                build()
        except RuntimeError as e:
            errors.append(str(e))
    assert len(errors) == 2 and errors[0] == errors[1]
    assert "once_differentiable" in errors[0]


# -- reductions whose backward branches on the data or on a size of 1 ----------
# torch's ProdBackward picks its formula from the input (a zero or not) and,
# on a fake input, always takes the zero-safe one: for one element (or a dim
# of size 1) that one is the incoming gradient itself, so a traced
# create_graph backward returned a gradient with no graph where eager's had
# one. CumprodBackward0 traced on fakes gave NaN second derivatives at zeros.
REDUCTIONS = {
    "prod_one": (lambda x: x.prod(), [0.7]),
    "prod_one_negative": (lambda x: x.prod(), [-1.3]),
    "prod_one_zero": (lambda x: x.prod(), [0.0]),
    "prod_several": (lambda x: x.prod(), [0.7, -0.3, 1.5]),
    "prod_a_zero": (lambda x: x.prod(), [0.7, 0.0, 1.5]),
    "prod_two_zeros": (lambda x: x.prod(), [0.0, 0.3, 0.0]),
    "prod_0dim": (lambda x: x.sum().prod(), [0.7, 2.0]),
    "prod_dim_of_one": (lambda x: x.view(3, 1).prod(1), [0.7, -0.3, 1.5]),
    "prod_dim_of_one_zero": (lambda x: x.view(3, 1).prod(1, keepdim=True), [0.7, 0.0, 1.5]),
    "prod_dim": (lambda x: x.view(2, 3).prod(1), [0.7, -0.3, 1.5, 2.0, 0.5, 1.1]),
    "prod_dim_zero": (lambda x: x.view(2, 3).prod(0, keepdim=True), [0.7, 0.0, 1.5, 0.0, 0.5, 1.1]),
    "cumprod_one": (lambda x: x.cumprod(0), [0.7]),
    "cumprod_zeros": (lambda x: x.cumprod(0), [0.7, 0.0, 1.5, 0.0]),
    "sum_one": (lambda x: x.sum(), [0.7]),
    "mean_one": (lambda x: x.mean(), [0.7]),
    "amax_one": (lambda x: x.amax(), [0.7]),
    "norm_one": (lambda x: x.norm(), [0.7]),
}


def _reduction_program(name: str, dtype: torch.dtype):
    op, data = REDUCTIONS[name]

    def build():
        x = torch.tensor(data, dtype=dtype, requires_grad=True)
        y = op(x)
        v = torch.arange(1.0, y.numel() + 1, dtype=dtype).view_as(y)
        (g,) = torch.autograd.grad(y, x, v, create_graph=True)
        second = None
        if g.requires_grad:
            w = torch.arange(2.0, g.numel() + 2, dtype=dtype).view_as(g)
            (second,) = torch.autograd.grad(g, x, w, retain_graph=True, allow_unused=True)
        # a larger program: the first-order gradient in a loss, into .grad
        loss = op(x).sum() * 2
        if g.requires_grad:
            loss = loss + g.pow(2).sum()
        loss.backward()
        return [g.detach(), torch.tensor(g.requires_grad), second, x.grad]

    return build


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction_create_graph_equals_eager(name, backend, dtype):
    expected, actual = run_both(_reduction_program(name, dtype), backend)
    for e, a in zip(expected, actual):
        same(e, a)
    compiled_without_fallback()


@pytest.mark.parametrize("name", ["prod_one", "prod_several", "prod_a_zero", "prod_dim_of_one", "prod_dim_zero", "cumprod_zeros"])
def test_reduction_gradgradcheck_under_cagrad(name):
    op, data = REDUCTIONS[name]
    x = torch.tensor(data, dtype=torch.float64, requires_grad=True)
    with cagrad.enable("eager"):
        assert torch.autograd.gradgradcheck(op, (x,))
    compiled_without_fallback()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dim", [None, 1])
@pytest.mark.parametrize("zero", [False, True])
def test_prod_gradient_of_a_permuted_input_has_eager_strides(zero, dim, backend):
    # eager: the quotient takes the input's layout, the zero-safe path a
    # contiguous one (chosen by the data)
    def build():
        x = torch.randn(2, 4, 4, requires_grad=True)
        y = x.exp().permute(0, 2, 1)
        if zero:
            y = y * (torch.arange(32).view(2, 4, 4) != 5)
        out = y.prod() if dim is None else y.prod(dim).sum()
        (g,) = torch.autograd.grad(out, [y])
        return g

    expected, actual = run_both(_grad_made_with_requires_grad_custom, backend)
    same(expected, actual)
    assert expected.stride() == actual.stride()
    compiled_without_fallback()


# formulas that ask GradMode::is_enabled() (derivatives.yaml) take an
# infinitely differentiable composite with grad mode on; traced under
# no_grad they recorded the other branch, and the second backward raised
# "derivative for aten::silu_backward is not implemented" where eager's
# does not (found by the fuzz campaign, seed 47)
_GRAD_MODE_FORMULAS = {
    "silu": torch.nn.functional.silu,
    "mish": torch.nn.functional.mish,
    "logit": lambda x: torch.logit(x.sigmoid() * 0.8 + 0.1, eps=1e-6),
    "group_norm": lambda x: torch.nn.functional.group_norm(x.reshape(2, 4, 5), 2),
    "dropout": lambda x: torch.nn.functional.dropout(x * x, 0.5, training=True),
}


@pytest.mark.parametrize("name", sorted(_GRAD_MODE_FORMULAS))
def test_a_grad_mode_formula_gives_a_differentiable_gradient(name):
    f = _GRAD_MODE_FORMULAS[name]

    def build():
        torch.manual_seed(3)
        x = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(f(x).sum(), [x], create_graph=True)
        (g * g).sum().backward()
        return g.detach(), x.grad

    expected, got = run_both(build)
    with cagrad.enable("eager"):
        again = build()  # a hit
    for result in (got, again):
        for a, b in zip(result, expected):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert cagrad.counters["fallbacks"] == 0


class _ThreeOnes(torch.autograd.Function):
    """A backward that makes its gradient with ``requires_grad=True``
    (torch's test_accumulate_grad_polyfill_case_3_2)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return torch.ones_like(g, requires_grad=True) * 3.0


def _grad_made_with_requires_grad_custom():
    var = torch.randn(2, 2, requires_grad=True)
    var.grad = torch.ones_like(var)
    out = _ThreeOnes.apply(var)
    out.backward(torch.ones_like(out), create_graph=True)
    return var.grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_gradient_made_with_requires_grad_keeps_its_history(backend):
    # eager: the .grad is the old one plus a tensor that records history,
    # so it records history too (AddBackward0); a trace of the factory call
    # would drop the flag, which torch sets after the op: such code runs as it is
    cagrad.reset()
    expected, actual = run_both(_grad_made_with_requires_grad_custom, backend)
    same(expected.detach(), actual.detach())
    assert expected.requires_grad and actual.requires_grad
    assert type(actual.grad_fn) is type(expected.grad_fn)
