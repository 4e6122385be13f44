"""What hooks see is eager's, in the corners the fuzzer found.

* A leaf's post-accumulate-grad hooks run even when no gradient reaches its
  AccumulateGrad (``AccumulateGrad::apply`` calls them after an early return
  of the accumulation), and when the leaf no longer requires grad.
* A node post-hook gets the node's outputs as eager's engine has them: with
  ``inputs=`` a C++ node computes no gradient for an edge whose target does
  not run (``Node::task_should_compute_output`` consults the graph task's
  ``exec_info``; a tensor-list argument such as ``cat``'s is one range),
  ``validate_outputs`` leaves outputs for invalid edges alone (``cat``'s
  slice for an input that does not require grad), and a custom Function
  returns what its backward returned.
* A second ``retain_grad()`` is a no-op.
* With ``inputs=`` that the one root does not lead to, the engine still
  reaches the root node (it is the graph root: no GraphRoot for one root
  edge) and runs its tensor pre-hooks and ``retain_grad`` hooks, not the
  node (found by the CUDA nightly campaign).
* A backward finished by the interpreter after a post-hook dropped a
  gradient finds every pending gradient it needs.

Each case runs under ``cagrad.enable("eager")`` three times (a capture, then
cache hits), against eager on the same program, comparing results and the
hook trace bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import cagrad

from .conftest import same, same_trace

RUNS = 3


def _run(build, use_cagrad: bool, dynamic: bool) -> list:
    out = []
    for _ in range(RUNS):
        torch.manual_seed(0)
        trace: list = []
        if use_cagrad:
            with cagrad.enable("eager", dynamic=dynamic):
                result = build(trace)
        else:
            result = build(trace)
        out.append((result, trace))
    return out


def check(build, dynamic: bool = True, fallback: bool = False) -> list:
    """Eager's and cagrad's results and traces are equal on every run; the
    backward compiles once and then hits the cache (unless ``fallback``)."""
    expected = _run(build, False, dynamic)
    actual = _run(build, True, dynamic)
    for (e, et), (c, ct) in zip(expected, actual):
        assert len(e) == len(c)
        for a, b in zip(e, c):
            same(a, b)
        same_trace(et, ct)
    if fallback:
        assert cagrad.counters["fallbacks"] == RUNS
    else:
        assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
        assert cagrad.counters["cache_hits"] >= 1
    return expected[0][1]


def post_hook(tr: list, label: str, drop: int | None = None):
    def hook(grad_inputs, grad_outputs):
        for i, g in enumerate(grad_inputs):
            tr.append((f"{label}[{i}]", None if g is None else g.clone()))
        if drop is not None:
            return tuple(None if i == drop else g for i, g in enumerate(grad_inputs))
        return None

    return hook


def post_acc_hook(tr: list, label: str):
    def hook(p):
        tr.append((label, None if p.grad is None else p.grad.clone()))

    return hook


def labels_with_none(trace: list) -> list[str]:
    return [label for label, g in trace if g is None]


# -- post-accumulate-grad hooks without a gradient ---------------------------------
def test_post_accumulate_hook_runs_when_a_post_hook_drops_the_only_gradient():
    def build(tr):
        x = torch.randn(1, 3, 1, requires_grad=True)
        parts = x.unbind(1)
        y = parts[2].neg()
        x.register_post_accumulate_grad_hook(post_acc_hook(tr, "x"))
        parts[0].grad_fn.register_hook(post_hook(tr, "unbind", drop=0))
        torch.autograd.backward([y, parts[1]], [torch.ones_like(y), torch.ones_like(parts[1])])
        return [x.grad]

    trace = check(build)
    assert ("x", None) in [(label, g) for label, g in trace if g is None]


def test_post_accumulate_hook_runs_for_a_leaf_that_stopped_requiring_grad():
    def build(tr):
        w = torch.randn(3, requires_grad=True)
        v = torch.randn(3, requires_grad=True)
        loss = (w * v).sum()
        w.register_post_accumulate_grad_hook(post_acc_hook(tr, "w"))
        v.register_post_accumulate_grad_hook(post_acc_hook(tr, "v"))
        w.requires_grad_(False)
        loss.backward()
        return [w.grad, v.grad]

    trace = check(build)
    assert labels_with_none(trace) == ["w"]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_post_accumulate_hooks_clone_is_not_the_grad_it_copied(backend):
    # torch's compiled autograd with inductor returns the leaf's .grad for
    # this clone, so the second backward changes what the first recorded
    # (fuzz/known_issues.toml, torch-ca-inductor-post-accumulate-clone-aliases-grad)
    def build(tr):
        x = torch.tensor(0.5, requires_grad=True)
        loss = x.expand([1]).sum()
        x.register_post_accumulate_grad_hook(lambda p: tr.append(("x", p.grad.detach().clone())))
        for _ in range(2):
            loss.backward(retain_graph=True)
        return x, [x.grad]

    expected: list = []
    x, grads = build(expected)
    actual: list = []
    with cagrad.enable(backend):
        y, got = build(actual)
    same_trace(expected, actual)
    same(grads[0], got[0])
    assert [g.item() for _, g in actual] == [1.0, 2.0]  # d(x)/dx = 1, accumulated twice
    assert all(g.data_ptr() != y.grad.data_ptr() for _, g in actual)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])


def test_a_post_hook_of_split_sees_as_many_grad_outputs_as_split_has_outputs_at_each_size():
    # split(1) of a dimension that grows from 2 to 4 has 4 outputs: a new key
    # (torch's compiled autograd reuses its graph of 2 and hands the hook 2;
    # fuzz/known_issues.toml, torch-ca-split-output-count-size-variant)
    def build(n, tr):
        x = torch.randn(n, requires_grad=True)
        parts = (x * 2).split(1)
        parts[0].grad_fn.register_hook(lambda gi, go: tr.append(("split", len(go), [g is None for g in go])))
        parts[0].sum().backward()
        return x.grad

    sizes = [2, 4, 4, 2]
    expected: list = []
    torch.manual_seed(0)
    grads = [build(n, expected) for n in sizes]
    actual: list = []
    torch.manual_seed(0)
    with cagrad.enable("eager", dynamic=True):
        got = [build(n, actual) for n in sizes]
    assert actual == expected
    assert [n for _, n, _ in actual] == sizes  # one grad_output per output of split
    for a, b in zip(grads, got):
        same(a, b)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["cache_hits"] >= 2


# -- post-hooks under inputs= ---------------------------------------------------------
def test_post_hook_sees_none_for_an_edge_autograd_grad_does_not_need():
    def build(tr):
        x1 = torch.randn(3, requires_grad=True)
        x2 = torch.randn((), requires_grad=True)
        y = x1.clone() * x2
        y.grad_fn.register_hook(post_hook(tr, "mul"))
        return list(torch.autograd.grad(y, [x2], torch.ones_like(y)))

    trace = check(build)
    assert labels_with_none(trace) == ["mul[0]"]


@pytest.mark.parametrize("root", ["leaf", "non_leaf"])
def test_tensor_hooks_of_a_root_that_leads_to_no_input_still_run(root):
    def build(tr):
        c0 = torch.randn(2, 3, requires_grad=True)
        c1 = torch.randn(1, requires_grad=True)
        y = c0 if root == "leaf" else c0 * 2
        y.register_hook(lambda g: tr.append(("tensor", g)))
        if root == "non_leaf":
            y.retain_grad()
            y.grad_fn.register_prehook(lambda g: tr.append(("pre", g)))
            y.grad_fn.register_hook(lambda gi, go: tr.append(("post", gi)))
        c0.register_post_accumulate_grad_hook(lambda p: tr.append(("post_accumulate", p.grad)))
        got = torch.autograd.grad([y], [c1], grad_outputs=[torch.ones(2, 3)], allow_unused=True)
        return [*got, c0.grad, y.grad if root == "non_leaf" else None]

    trace = check(build)
    assert [label for label, _ in trace] == ["tensor"]  # the node and its other hooks do not run


@pytest.mark.parametrize("dynamic", [True, False])
def test_mm_post_hook_under_autograd_grad_of_other_inputs(dynamic):
    # the campaign's MmBackward0 case: mm's second input is not differentiated
    def build(tr):
        x0 = torch.randn(2, 3, requires_grad=True)
        x1 = torch.randn(2, 3, requires_grad=True)
        x2 = torch.randn(3, 4, requires_grad=True)
        y = (x0 * x1).mm(x2)
        y.grad_fn.register_hook(post_hook(tr, "mm"))
        return list(torch.autograd.grad(y.sum(), [x0, x1]))

    trace = check(build, dynamic=dynamic)
    assert labels_with_none(trace) == ["mm[1]"]


def test_post_hook_under_backward_with_inputs():
    def build(tr):
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        y = a.exp() * b.sin()
        y.grad_fn.register_hook(post_hook(tr, "mul"))
        y.sum().backward(inputs=[b])
        return [a.grad, b.grad]

    trace = check(build)
    assert labels_with_none(trace) == ["mul[0]"]


def test_post_hook_of_an_opaque_node_under_autograd_grad():
    # CopySlices runs as it is; eager decides each of its outputs on its own
    def build(tr):
        a = torch.randn(4, requires_grad=True)
        w = torch.randn(2, requires_grad=True)
        b = a.exp()
        b[:2].mul_(w)
        b.grad_fn.register_hook(post_hook(tr, "copy_slices"))
        return list(torch.autograd.grad(b.sum(), [w]))

    trace = check(build)
    assert labels_with_none(trace) == ["copy_slices[0]"]


def test_cat_computes_every_slice_when_one_of_its_inputs_is_needed():
    # cat's inputs are one tensor-list argument: eager computes all slices
    def build(tr):
        a = torch.randn(2, 1, requires_grad=True)
        b = torch.randn(2, 2, requires_grad=True)
        c = torch.randn(2, 3, requires_grad=True)
        y = torch.cat([a.exp(), b, c], 1)
        y.grad_fn.register_hook(post_hook(tr, "cat"))
        return list(torch.autograd.grad(y, [b], torch.randn(2, 6)))

    trace = check(build)
    assert labels_with_none(trace) == []


def test_a_post_hook_that_drops_an_unneeded_gradient():
    def build(tr):
        x1 = torch.randn(3, requires_grad=True)
        x2 = torch.randn(3, requires_grad=True)
        y = x1.sin() * x2.cos()
        y.grad_fn.register_hook(post_hook(tr, "mul", drop=0))
        return list(torch.autograd.grad(y.sum(), [x2]))

    check(build)


# -- post-hooks and invalid edges ------------------------------------------------------
@pytest.mark.parametrize("dynamic", [True, False])
def test_post_hook_sees_cat_slice_for_an_input_without_grad(dynamic):
    def build(tr):
        x2 = torch.randn(1, 3, 2)
        x3 = torch.randn(1, 3, 2, requires_grad=True)
        c0 = torch.randn(1, 3, 1, requires_grad=True)
        y = torch.cat([c0, x2, x3], 2)
        y.grad_fn.register_hook(post_hook(tr, "cat"))
        y.backward(torch.randn(1, 3, 5))
        return [x3.grad, c0.grad]

    trace = check(build, dynamic=dynamic)
    assert labels_with_none(trace) == []


def test_post_hook_sees_cat_slices_of_a_cat_that_runs_as_it_is():
    # two inputs without grad: CatBackward0 is not traced but called at run
    # time; the slices for the invalid edges still reach the post-hook
    def build(tr):
        p = torch.randn(2, 1)
        q = torch.randn(2, 2)
        x = torch.randn(2, 3, requires_grad=True)
        y = torch.cat([p, x, q], 1)
        y.grad_fn.register_hook(post_hook(tr, "cat"))
        (y * y).sum().backward()
        return [x.grad]

    trace = check(build)
    assert labels_with_none(trace) == []


# -- custom Functions: what the backward returned -------------------------------------
class MulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


def test_custom_function_post_hook_sees_an_unneeded_gradient():
    def build(tr):
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        y = MulFn.apply(a.exp(), b)
        y.grad_fn.register_hook(post_hook(tr, "fn"))
        return list(torch.autograd.grad(y.sum(), [b]))

    trace = check(build)
    assert labels_with_none(trace) == []


def test_custom_function_post_hook_sees_a_gradient_for_an_input_without_grad():
    def build(tr):
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3)
        y = MulFn.apply(a, b)
        y.grad_fn.register_hook(post_hook(tr, "fn"))
        y.sum().backward()
        return [a.grad]

    trace = check(build)
    assert labels_with_none(trace) == []


# -- retain_grad ----------------------------------------------------------------------------
def test_retain_grad_twice_is_a_no_op():
    def build(tr):
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        h.retain_grad()
        h.retain_grad()
        (h * h).sum().backward()
        return [x.grad, h.grad]

    check(build)


# -- finishing a backward after a failed speculation ------------------------------------
def test_resume_reads_a_pending_gradient_that_nothing_else_uses():
    # the post-hook drops the gradient the graph assumed, so the interpreter
    # finishes the backward; unbind's node is only captured, and the
    # gradient pending for its uncaptured input 2 (used by nothing in the
    # graph) must still be there for the resume
    def build(tr):
        x = torch.randn(4, requires_grad=True)
        parts = x.unbind(0)
        y = parts[3].exp()
        y.grad_fn.register_hook(post_hook(tr, "exp", drop=0))
        roots = [y.sum(), parts[2].sum(), parts[1].sum()]
        return list(torch.autograd.grad(roots, [parts[1]]))

    check(build)
