"""Scenarios guarding the fault classes that got past the other checks.

A planted-fault study (issue 38) seeded faults into cagrad and found classes
that neither the tests nor the fuzzer nor the first golden scenarios caught.
Each scenario here pins what a snapshot can show of one class (key bytes,
the run order of the cache keys, the graph text); the first docstring line
names the class. Classes a snapshot cannot show (the size check of a
symbolic variant, the disk cache, a backward started inside another) are
listed in docs/testing.md with the tests that cover them. Registered on
import (:mod:`golden_graphs` imports it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .scenarios import Backward, leaf, scenario

# -- (a) a wrong cache hit that only a value sequence reveals --------------------


@scenario
def key_dim_values_on_a_square_leaf() -> Backward:
    """fault class: a wrong cache hit only a value sequence reveals: cumsum/gather/index_select/flip/roll over dim 1 of a square leaf, told apart by the dim's value alone."""
    # on a (3, 3) leaf every one of these ops has the same shapes over dim 0
    # and dim 1: a key without the dim value would give a backward over the
    # other dim the same key (a hit with the wrong gradients)
    x = leaf(3, 3)
    idx = torch.tensor([[0, 2, 1], [1, 1, 0], [2, 0, 2]])
    c = x.cumsum(dim=1)
    g = x.gather(1, idx)
    s = x.index_select(1, torch.tensor([2, 0]))
    f = x.flip(dims=[1])
    r = x.roll(shifts=1, dims=1)
    return Backward((c * g).sum() + s.sum() + (f * r).sum())


# -- (c) which outputs of a multi-output node are needed -------------------------


class _Noop:
    """A hook that returns None. An object, not a plain function, so
    cagrad's hook tracing (cagrad/hooks/hook_tracing.py) leaves it an opaque
    call, which is what these scenarios show."""

    __name__ = "_noop"

    def __call__(self, *args: object) -> None:
        return None


_noop = _Noop()


@scenario
def grad_inputs_one_output_of_multi_output_node() -> Backward:
    """fault class: which outputs of a multi-output node are needed: grad w.r.t. weights only; post hooks on addmm and mm see None for the unneeded outputs."""
    # under inputs= eager's node computes only the outputs whose edges lead
    # to a node that runs (task_should_compute_output); a node post hook is
    # handed those outputs, None for the others, as the opaque hook calls'
    # arguments in the graph show
    x = leaf(3, 4)
    w, b = leaf(5, 4), leaf(5)
    ln_w = leaf(5)
    v = leaf(5, 2)
    lin = F.linear(x, w, b)  # AddmmBackward0: edges bias, x, w.t()
    lin.grad_fn.register_hook(_noop)
    h = F.layer_norm(lin, (5,), weight=ln_w)
    m = h @ v  # MmBackward0: edges h, v
    m.grad_fn.register_hook(_noop)
    return Backward(m.tanh().sum(), inputs=[w, ln_w])


# -- (d) a single root at a non-zero output of a multi-output node ---------------


@scenario
def root_single_at_output_one() -> Backward:
    """fault class: a single root at a non-zero output: var_mean's mean (output 1) is the only root, its gradient seeded at input_nr 1."""
    x = leaf(3, 4)
    _, mean = torch.var_mean(x, dim=1)
    return Backward(mean, grad_outputs=torch.tensor([1.0, 2.0, 3.0]))


# -- (e) ties in the ready queue --------------------------------------------------


@scenario
def ready_queue_ties() -> Backward:
    """fault class: ties in the ready queue (run order): seven AccumulateGrads of equal priority ready at once, popped in libstdc++'s heap order."""
    # torch.stack's backward readies every leaf's AccumulateGrad at once;
    # they all have priority UINT64_MAX, so the cache keys' order (the run
    # order) is what the heap's tie-breaking leaves
    leaves = [leaf(2) for _ in range(7)]
    return Backward((torch.stack(leaves) * torch.arange(1.0, 8.0).unsqueeze(1)).sum())


# -- (f) a formula wrong only for a nonzero start in a later dimension -----------


@scenario
def sizes_dynamic_views_at_later_dims() -> Backward:
    """fault class: a formula wrong only for a nonzero start in dim > 0: slice, narrow and select backwards in dims 1 and 2 with starts > 0, symbolic sizes."""
    # with dynamic sizes these nodes run cagrad's Python formulas
    # (cagrad.autograd.formulas: SliceBackward0, SelectBackward0), whose
    # start, dim and step arguments the graph shows
    # distinct values where it can (equal values share a symbol: duck
    # sizing); a start of 1 stays a constant (sizes of 1 specialize)
    x = leaf(3, 11, 13)
    a = x[:, 4:9]  # slice dim 1, start 4, end 9
    n = x.narrow(2, 1, 5)  # narrow: a slice in dim 2, start 1, end 6
    s = x.select(1, 7)  # select dim 1, index 7
    t = x[:, :, 10::2]  # slice dim 2, start 10, step 2
    return Backward(a.pow(2).sum() + n.sin().sum() + (s * s).sum() + t.exp().sum(), dynamic=True)


# -- (h) a traced hook's captured values -----------------------------------------


def _scaled_hook(scale: float, shift: float):
    def hook(g: torch.Tensor, k: float = shift) -> torch.Tensor:
        return torch.tanh(g) * scale + k

    return hook


@scenario
def traced_hook_captured_values() -> Backward:
    """fault class: a traced hook's captured values: one hook code, three (closure, default) values, baked into the graph and told apart by fingerprint."""
    # hooks A and B differ only in a closure cell, A and C only in a default
    # value: three distinct fingerprints, three sets of constants
    x = leaf(3, 4)
    h = x.exp()
    h.register_hook(_scaled_hook(0.25, 1.5))  # A
    y = x.sin()
    y.register_hook(_scaled_hook(-3.0, 1.5))  # B
    z = x.cos()
    z.register_hook(_scaled_hook(0.25, 0.5))  # C
    return Backward((h * y + z).sum())


# -- (i) double backward ------------------------------------------------------------


@scenario
def double_backward_create_graph() -> Backward:
    """fault class: double backward: the create_graph=True backward itself, whose saved tensors enter the graph differentiable (no detach)."""
    x = leaf(3)
    w = leaf(3)
    y = (x.tanh() * w * x).sum()
    return Backward(y, inputs=[x], create_graph=True)
