"""Views and in-place ops: CopySlices, AsStrided, indexing, scatter, masks.

In-place ops on views produce ``CopySlices`` nodes and ``as_strided`` view
replays, whose state Python cannot see; cagrad runs those nodes as they are
at run time, inside the compiled graph. Every case must compile and equal
eager bit for bit; modifying a saved tensor must raise eager's error.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import compiled_without_fallback, errors_under_both, run_both, same


def check(build, backend="eager"):
    expected, actual = run_both(build, backend)
    for e, a in zip(expected, actual):
        same(e, a)
    compiled_without_fallback()


def test_inplace_on_a_slice_of_an_intermediate():
    def build():
        x = torch.randn(4, 3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        y = x * 1
        y[1:].mul_(w)
        (y * y).sum().backward()
        return x.grad, w.grad

    check(build)


def test_inplace_on_a_view_of_a_leaf_clone():
    def build():
        p = torch.randn(5, requires_grad=True)
        q = p.clone()
        q[::2].add_(q[1::2].sum())
        q.pow(2).sum().backward()
        return (p.grad,)

    check(build)


def test_setitem_with_tensor_index_on_a_view():
    def build():
        x = torch.randn(5, 3, requires_grad=True)
        v = torch.randn(2, 3, requires_grad=True)
        y = x * 2
        y[torch.tensor([0, 3])] = v
        (y * y).sum().backward()
        return x.grad, v.grad

    check(build)


def test_index_put_scatter_and_masked_fill_on_views():
    def build():
        x = torch.randn(4, 5, requires_grad=True)
        src = torch.randn(2, 5, requires_grad=True)
        y = x * 1
        y[1:3].index_put_((torch.tensor([1, 0]),), src * 3)
        y[:, 1:].scatter_(1, torch.tensor([[0], [2], [1], [3]]), 7.0)
        y[2:].masked_fill_(torch.tensor([True, False, True, False, True]), 0.5)
        (y.sin() * y).sum().backward()
        return x.grad, src.grad

    check(build)


def test_as_strided_unfold_and_diagonal():
    def build():
        x = torch.randn(12, requires_grad=True)
        h = x.exp()
        a = h.as_strided((3, 2), (2, 1), 1).pow(2).sum()
        b = h.unfold(0, 4, 3).tanh().sum()
        c = h[:9].view(3, 3).diagonal().sum()
        (a + b + c).backward()
        return (x.grad,)

    check(build)


def test_inplace_through_two_views():
    def build():
        x = torch.randn(6, 4, requires_grad=True)
        y = x * 2  # saves nothing an in-place change would invalidate
        v = y.view(4, 6)[1:3]
        v.t()[2].mul_(10)
        y.exp().sum().backward()
        return (x.grad,)

    check(build)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_inplace_views_with_aot_eager(backend):
    def build():
        x = torch.randn(4, 3, requires_grad=True)
        y = x.tanh()
        z = y.clone()
        z[:, 0].mul_(y[:, 1])
        (z * 3).sum().backward()
        return (x.grad,)

    check(build, backend)


def test_modifying_a_saved_tensor_in_place_raises_eagers_error():
    def build():
        x = torch.randn(4, requires_grad=True)
        y = x.exp()
        z = y[1:].sin()
        y[2:].mul_(2)  # y is saved by ExpBackward0 and its view by SinBackward0
        z.sum().backward()

    errors = errors_under_both(build)
    assert len(errors) == 2
    assert all(isinstance(e, RuntimeError) for e in errors)
    assert all("modified by an inplace operation" in str(e) for e in errors)
