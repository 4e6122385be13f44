"""Which memory a leaf's ``.grad`` shares, against eager's.

Eager's ``AccumulateGrad`` takes an arriving gradient as ``.grad`` without a
copy when nothing else holds it and it obeys the layout contract
(torch/csrc/autograd/functions/accumulate_grad.h). So after
``torch.cat([a, b]).backward(g)`` both ``a.grad`` and ``b.grad`` are ``g``'s
memory (``CatBackward`` hands each leaf a fresh view of ``g``), while after
``a.clone().backward(g)`` ``a.grad`` is a copy (``g`` itself arrives, which
the caller holds). A user who writes into ``g`` afterwards sees the
difference in ``.grad``. Each program here runs in eager and under cagrad
(the first backward a capture, the second a cache hit) and the sharing is
compared: with which tensor, at which offset, with which strides, and that
``.grad`` is not a view (eager's never is).
"""

from __future__ import annotations

import pytest
import torch

import cagrad
from cagrad import native
from cagrad.autograd import accumulate
from cagrad.autograd.accumulate import _stealable_outputs, stealable_outputs


def _cat(leaf, g):
    a, b = leaf(3, 4), leaf(2, 4)
    return [a, b], [torch.cat([a, b])], [g(5, 4)]


def _cat_columns(leaf, g):
    # each leaf's view of g is not contiguous: eager copies it
    a, b = leaf(4, 3), leaf(4, 2)
    return [a, b], [torch.cat([a, b], dim=1)], [g(4, 5)]


def _clone(leaf, g):
    a = leaf(3, 4)
    return [a], [a.clone()], [g(3, 4)]


def _reshape(leaf, g):
    # ViewBackward reshapes g: a fresh view, taken
    a = leaf(3, 4)
    return [a], [a.view(12)], [g(12)]


def _same_leaf_twice(leaf, g):
    # two views of g for one leaf are summed first: a fresh tensor
    a = leaf(3, 4)
    return [a], [torch.cat([a, a])], [g(6, 4)]


def _two_roots(leaf, g):
    # a's gradient is a view of the first root's g, b's the second's itself
    a, b = leaf(3, 4), leaf(2, 4)
    return [a, b], [torch.cat([a, a.detach()]), b.clone()], [g(6, 4), g(2, 4)]


def _one_gradient_for_two_leaves(leaf, g):
    # AddBackward hands one tensor to both leaves: at most one takes it
    a, b = leaf(3, 4), leaf(3, 4)
    return [a, b], [(a + b) * 2], [g(3, 4)]


def _with_post_accumulate_hook(leaf, g):
    # a hook on a third leaf: a segmented run, whose accumulations adopt a
    # gradient nothing else holds (runtime_ops.accumulate_handed)
    a, b, c = leaf(3, 4), leaf(2, 4), leaf(3, 4)
    c.register_post_accumulate_grad_hook(lambda leaf: None)
    return [a, b, c], [torch.cat([a, b]), c], [g(5, 4), g(3, 4)]


def _hook_keeps(kind):
    def program(leaf, g):
        # a tensor hook keeps an alias of the leaf's gradient: eager adopts
        # the gradient where the hook kept a detached alias (its memory), not
        # where it kept a view (which holds the gradient itself)
        a, b = leaf(3, 4), leaf(3, 4)
        kept = []
        a.register_hook(lambda grad: kept.append(grad.detach() if kind == "detached" else grad[:1]) and None)
        return [a, b], [(a * b).sin()], [g(3, 4)]
    return program


PROGRAMS = {
    "cat": _cat,
    "cat_columns": _cat_columns,
    "clone": _clone,
    "reshape": _reshape,
    "same_leaf_twice": _same_leaf_twice,
    "two_roots": _two_roots,
    "one_gradient_for_two_leaves": _one_gradient_for_two_leaves,
    "with_post_accumulate_hook": _with_post_accumulate_hook,
    "hook_keeps_detached_alias": _hook_keeps("detached"),
    "hook_keeps_view": _hook_keeps("view"),
}


def _sharing(program, device: str = "cpu") -> list:
    """Per backward (two), per leaf: (index of the grad_tensors tensor whose
    memory ``.grad`` shares, or None; byte offset into it; strides;
    ``_is_view()``; indices of the other leaves whose ``.grad`` shares it)."""
    steps = []
    for _ in range(2):
        leaves, roots, grads = program(
            lambda *shape: torch.randn(*shape, device=device, requires_grad=True),
            lambda *shape: torch.randn(*shape, device=device),
        )
        torch.autograd.backward(roots, grads)
        rows = []
        for i, leaf in enumerate(leaves):
            ptr = leaf.grad.untyped_storage().data_ptr()
            owner = next((j for j, g in enumerate(grads) if g.untyped_storage().data_ptr() == ptr), None)
            offset = None if owner is None else leaf.grad.data_ptr() - grads[owner].data_ptr()
            others = [k for k, other in enumerate(leaves)
                      if k != i and other.grad.untyped_storage().data_ptr() == ptr]
            rows.append((owner, offset, leaf.grad.stride(), leaf.grad._is_view(), others))
        steps.append(rows)
    return steps


@pytest.mark.parametrize("path", ["cpp", "python"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_grad_shares_the_memory_eager_s_shares(monkeypatch, name, backend, path):
    if path == "python":
        monkeypatch.setattr(accumulate, "_native", False)
    elif native.accumulate_fns() is None:
        pytest.skip("the C++ extension is not built here (test_native.py says why)")
    torch.manual_seed(0)
    expected = _sharing(PROGRAMS[name])
    torch.manual_seed(0)
    with cagrad.enable(backend):
        actual = _sharing(PROGRAMS[name])
    assert actual == expected
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    # the second backward reused the first's graph
    assert cagrad.counters["backwards"] == 2 and cagrad.counters["captures"] == 1, dict(cagrad.counters)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", ["cat", "clone", "with_post_accumulate_hook"])
def test_inductor_hands_back_views_of_grad_tensors_as_eager_does(name, device):
    """Inductor regenerates an output that is a view of an input as a view
    of the tensor passed in (AOTAutograd's output aliasing), so the rule
    holds for a compiled graph too, on CPU and CUDA."""
    torch.manual_seed(0)
    expected = _sharing(PROGRAMS[name], device)
    torch.manual_seed(0)
    with cagrad.enable("inductor"):
        actual = _sharing(PROGRAMS[name], device)
    assert actual == expected
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    if name == "cat":  # what the test is about
        assert [row[:2] for row in expected[0]] == [(0, 0), (0, 48)]


@pytest.mark.cuda
@pytest.mark.parametrize("early", ["1", "0"])
def test_a_replayed_cuda_graph_hands_out_views_of_grad_tensors(monkeypatch, early):
    """A replayed graph reads a moved input (a root gradient at a new
    address) from a buffer of its own, so an output that is a view of it
    is a view of that buffer; cagrad hands out the same view of the
    caller's tensor instead (cagrad.compile.cuda_graph_layout.views_of_inputs),
    so ``.grad`` shares ``g`` as eager's does, replayed early or not."""
    from cagrad.compile import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "EARLY_REPLAY", early == "1")
    torch.manual_seed(0)
    expected = [row for _ in range(3) for row in _sharing(_cat, "cuda")]
    torch.manual_seed(0)
    with cagrad.enable("inductor", mode="reduce-overhead"):
        actual = [row for _ in range(3) for row in _sharing(_cat, "cuda")]
        records, replays = cagrad.counters["cudagraph_records"], cagrad.counters["cudagraph_replays"]
    assert records >= 1 and replays >= 3, dict(cagrad.counters)  # what the test is about
    assert actual == expected


@pytest.mark.parametrize("path", ["cpp", "python"])
def test_outputs_over_one_buffer_are_taken_where_they_are_disjoint(path):
    """Disjoint views of one buffer may each become a ``.grad``; a view that
    overlaps one already taken, or a graph input itself, may not (two
    ``.grad`` tensors must never share an element: an in-place add into one
    would change the other)."""
    if path == "cpp" and native.accumulate_fns() is None:
        pytest.skip("the C++ extension is not built here (test_native.py says why)")
    fn = stealable_outputs if path == "cpp" else _stealable_outputs
    buf = torch.arange(12.0)
    grid = torch.arange(12.0).reshape(3, 4)
    outs = [
        buf[:4],  # taken
        buf[4:8],  # disjoint: taken
        buf[2:6],  # overlaps both: copied
        buf,  # a graph input itself: copied, and blocks nothing
        buf[8:],  # disjoint from what was taken: taken
        grid[:, 0],  # taken
        grid[:, 1],  # interleaved with it: copied (below)
        torch.empty(0),  # no memory: taken
    ]
    is_input = [False, False, False, True, False, False, False, False]
    # grid[:, 0] reaches bytes [0, 36) and grid[:, 1] [4, 40): the rule
    # compares the spans the strides reach, so interleaved columns count
    # as overlapping (a copy where eager might take both: never two .grad
    # over one element)
    assert fn(outs, is_input) == [True, True, False, False, True, True, False, True]
