"""cagrad's C++ extension (:mod:`cagrad.native`) against eager autograd.

The extension's functions replace Python code on the cache-hit path; each is
self-tested when loaded, and here the backwards that use them (guarded hits,
accumulation into ``.grad``) are compared with eager's on the cases where
eager's ``AccumulateGrad::accumulateGrad`` behaves differently: leaves of
every stride pattern (the gradient layout contract), ``.grad`` unset, dense
or sparse, and a leaf whose ``requires_grad`` was switched off after the
forward. Each case runs with the C++ accumulation and with the Python one.
"""

from __future__ import annotations

import pytest
import torch

import cagrad
from cagrad import native
from cagrad.autograd import accumulate

from .conftest import run_both, same


def test_every_function_passes_its_self_test(built):
    """A reader or the accumulation that failed its self-test would be
    switched off with a warning; on this torch none may be."""
    assert native.metadata_fns() is not None
    assert native.collect_fn() is not None
    assert native.walk_fn() is not None
    assert accumulate._native_fns() is not None
    # each switched off on its own (a survivor of the mutation run made
    # hookless()'s self-test fail, and only a warning said so)
    assert native.hookless_fn() is not None
    assert native.sole_fn() is not None
    assert native.reclaim_fn() is not None


def test_loading_the_extension_leaves_the_rng_as_it_was(built, monkeypatch):
    """The extension loads in the first backward that needs it, and its
    self-tests draw random tensors: that backward must leave the CPU RNG
    where eager leaves it (a later ``torch.randn`` drew other values)."""
    monkeypatch.setattr(native, "_native", None)  # load (and self-test) again
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert native.load() is not None
    assert torch.equal(torch.get_rng_state(), before)


def test_collects_self_test_rejects_a_runner_that_disagrees(built):
    from cagrad.native import self_tests

    readers = native.metadata_fns()
    with pytest.raises(RuntimeError, match="collect"):
        self_tests.collect(lambda nodes, program, values, tensors: True, readers)

    def skips_leaves(nodes, program, values, tensors):
        return native.collect_fn()(nodes, tuple(op for op in program if op[0] != 9), values, tensors)

    with pytest.raises(RuntimeError, match="collect"):
        self_tests.collect(skips_leaves, readers)


def test_collects_self_test_rejects_a_runner_with_the_right_verdict_and_wrong_outputs(built):
    """A runner that accepts and rejects as Python does but fills in a wrong
    value, or the wrong tensors, fails the self-test too (a survivor of the
    mutation run, docs/mutation-testing.md: the check of the values was
    weakened and no killer noticed)."""
    from cagrad.native import self_tests

    readers = native.metadata_fns()
    real = native.collect_fn()

    def extra_value(nodes, program, values, tensors):
        ok = real(nodes, program, values, tensors)
        values.append(-1)
        return ok

    def extra_tensor(nodes, program, values, tensors):
        ok = real(nodes, program, values, tensors)
        tensors.append(torch.zeros(()))
        return ok

    for runner in (extra_value, extra_tensor):
        with pytest.raises(RuntimeError, match="collect"):
            self_tests.collect(runner, readers)


def test_walks_self_test_rejects_a_walk_that_disagrees(built):
    from cagrad.native import guard_program as gp
    from cagrad.native import self_tests

    def lenient(starts, steps, count):  # accepts every graph that differs
        got = gp.walk(starts, steps, count)
        return got if got is not None else tuple(starts) + (None,) * (count - len(starts))

    with pytest.raises(RuntimeError, match="walk"):
        self_tests.walk(lenient)

    def no_identity(starts, steps, count):  # a node reached again not compared
        return gp.walk(starts, tuple((src, tuple(e for e in edges if len(e) != 2)) for src, edges in steps), count)

    with pytest.raises(RuntimeError, match="walk"):
        self_tests.walk(no_identity)


def test_walk_says_what_is_malformed(built):
    walk = native.walk_fn()
    x = torch.randn(3, requires_grad=True)
    root = x.exp().sum().grad_fn
    exp = root.next_functions[0][0]
    cases = [
        (((5, ()),), 1, "not discovered yet"),
        (((0, ((2, 0, type(exp)),)),), 2, "not the next one"),
        (((0, ((1, 0, type(exp)),)),), 3, "fewer nodes than count"),
        (((0, ((1,),)),), 2, "an edge is"),
        (((0,),), 1, "a step is"),
    ]
    for steps, count, message in cases:
        with pytest.raises(ValueError, match=message):
            walk((root,), steps, count)
    with pytest.raises(TypeError, match="walk"):
        walk([root], (), 1)
    assert walk((root,), ((0, ((1, 0, type(exp)),)),), 2) == (root, exp)


def test_collect_says_which_instruction_is_malformed(built):
    from cagrad.native import guard_program as gp

    collect = native.collect_fn()
    x = torch.randn(3, requires_grad=True)
    node = x.exp().grad_fn
    values: list = []
    cases = [
        ((gp.NONE, 1, "_saved_result"), "names no node"),
        ((gp.NONE, 0), "has 2 items"),
        ((gp.TENSOR, 0, "_saved_result", int, 0), "not a tensor type"),
        ((42, 0, "_saved_result"), "unknown instruction 42"),
        ((gp.FLOAT, 0, "_saved_result", 1), "not a float"),
    ]
    for op, message in cases:
        with pytest.raises(ValueError, match=message):
            collect((node,), (op,), values, [])
    with pytest.raises(TypeError, match="collect"):
        collect([node], (), values, [])
    # an attribute that raises propagates: the guard counts it a miss
    y = x.exp()
    y.sum().backward()
    with pytest.raises(RuntimeError, match="freed"):
        collect((y.grad_fn,), ((gp.TENSOR, 0, "_saved_result", torch.Tensor, 0),), values, [])


def _leaf(kind: str) -> torch.Tensor:
    base = torch.randn(4, 6, 2, 3)
    if kind == "contiguous":
        x = base
    elif kind == "transposed":
        x = base.transpose(0, 3).contiguous().transpose(0, 3)  # dense, other strides
    elif kind == "channels_last":
        x = base.contiguous(memory_format=torch.channels_last)
    elif kind == "size_one":
        x = torch.randn(4, 1, 2, 3).transpose(1, 2).contiguous().transpose(1, 2).expand(4, 1, 2, 3)
    else:  # "strided_view": not dense, so .grad is contiguous
        x = torch.randn(8, 6, 2, 3)[::2]
    return x.clone(memory_format=torch.preserve_format).requires_grad_() if kind != "strided_view" else x.requires_grad_()


def _preset(kind: str, like: torch.Tensor) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "dense":
        return torch.ones_like(like).detach()
    if kind == "dense_transposed":
        return torch.ones(like.shape[::-1]).permute(3, 2, 1, 0)
    return torch.ones_like(like).detach().to_sparse()


@pytest.mark.parametrize("path", ["cpp", "python"])
@pytest.mark.parametrize("preset", ["none", "dense", "dense_transposed", "sparse"])
@pytest.mark.parametrize("leaf_kind", ["contiguous", "transposed", "channels_last", "size_one", "strided_view"])
@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
def test_accumulation_into_grad_matches_eager(built, monkeypatch, path, preset, leaf_kind):
    """Values, layout, strides and ``.grad`` identity after two backwards
    (the second a guarded hit), against eager's."""
    if path == "python":
        monkeypatch.setattr(accumulate, "_native", False)

    def build():
        w = _leaf(leaf_kind)
        other = torch.randn(4, 6, 2, 3, requires_grad=True)  # a second leaf: its grad is contiguous
        results = []
        for step in range(2):
            w.grad = _preset(preset, w) if step == 0 else w.grad
            before = w.grad
            # the gradient of w is a permuted, non-contiguous tensor before the
            # contract lays it out; of `other` a fresh contiguous one
            loss = (w.permute(3, 1, 2, 0).sin() * 2).sum() + (other * w.detach()).square().sum()
            loss.backward()
            results.append((w.grad.clone() if w.grad.layout == torch.strided else w.grad.to_dense(),
                            w.grad.layout, w.grad.stride() if w.grad.layout == torch.strided else None,
                            w.grad is before, other.grad.stride()))
        return results

    expected, actual = run_both(build)
    for e, a in zip(expected, actual):
        same(e[0], a[0])
        assert e[1:] == a[1:]
    assert cagrad.counters["captures"] == 1 and cagrad.counters["guard_hits"] >= 1, dict(cagrad.counters)


@pytest.mark.parametrize("path", ["cpp", "python"])
def test_a_leaf_that_stopped_requiring_grad_gets_none(built, monkeypatch, path):
    """``requires_grad_(False)`` between forward and backward: eager's
    AccumulateGrad leaves ``.grad`` alone."""
    if path == "python":
        monkeypatch.setattr(accumulate, "_native", False)

    def build():
        a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        grads = []
        for _ in range(2):
            loss = (a * b).sum()
            b.requires_grad_(False)
            loss.backward()
            b.requires_grad_(True)
            grads.append((a.grad.clone(), b.grad))
        return grads

    expected, actual = run_both(build)
    for (ea, eb), (aa, ab) in zip(expected, actual):
        same(ea, aa)
        assert eb is None and ab is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_two_leaves_with_one_grad_tensor_get_both_gradients(built, device):
    """``a.grad`` and ``b.grad`` are one tensor (a user's assignment): eager
    adds each gradient into it in turn; one multi-tensor kernel would add both
    at once (a race on CUDA), so cagrad adds them one after the other."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def build():
        a = torch.randn(256, 64, device=device, requires_grad=True)
        b = torch.randn(256, 64, device=device, requires_grad=True)
        out = []
        for _ in range(2):  # the second backward is a guarded hit
            shared = torch.ones(256, 64, device=device)
            a.grad = b.grad = shared
            (a.sin() * b.cos()).sum().backward()
            out.append((shared.clone(), a.grad is shared and b.grad is shared))
        return out

    expected, actual = run_both(build)
    for (e, e_same), (a, a_same) in zip(expected, actual):
        same(e, a)
        assert e_same and a_same


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(((2, 3), (3, 1), 0), id="dense"),
        pytest.param(((4, 3), (0, 1), 2), id="expanded"),
        pytest.param(((3, 4), (0, 0), 1), id="one-element"),
    ],
)
def test_reclaim_moves_a_live_output_out_of_the_graph_memory(built, layout):
    """A live alias of a CUDA graph's output (a kept ``.grad``) is moved to
    memory of its own before the next replay writes over the output; an
    expanded output (stride 0, which no copy may write) keeps its strides and
    values. Checked on CPU tensors standing in for the graph's pool: after the
    move, writing over the pool leaves the alias as it was."""
    size, stride, offset = layout
    # the only holder of its memory (no view base), as a graph's output is
    owner = torch.arange(8.0).as_strided(size, stride, offset).detach()
    pool = owner.data_ptr() - offset * owner.element_size()  # untyped_storage() would be one more holder
    handed = owner.detach()
    expected = handed.clone()
    assert native.reclaim_fn()([handed], [owner]) is True
    assert handed.data_ptr() != pool + offset * owner.element_size()
    assert handed.stride() == owner.stride() and handed.size() == owner.size()
    torch.tensor([], dtype=owner.dtype).set_(owner.untyped_storage()).fill_(-1.0)  # the next replay
    assert handed.data_ptr() != owner.data_ptr()
    torch.testing.assert_close(handed, expected, rtol=0, atol=0)
