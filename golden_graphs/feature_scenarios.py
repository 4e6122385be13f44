"""Scenarios pinning one cagrad feature each: hooks, custom Functions,
views, roots, sizes, torch.compile'd forwards, double backward,
checkpointing, distributed-style hooks, sparse gradients, and every kind of
value a key holds. Registered on import (:mod:`golden_graphs` imports it);
the first docstring line of each says what it pins.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.aot_autograd as aot_autograd
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from .scenarios import Backward, leaf, scenario


def _double(g: torch.Tensor) -> torch.Tensor:
    return g * 2


class _Noop:
    """A hook that returns None. An object, not a plain function, so
    cagrad's hook tracing (cagrad/hooks/hook_tracing.py) leaves it an opaque
    call, which is what these scenarios show."""

    __name__ = "_noop"

    def __call__(self, *args: object) -> None:
        return None


_noop = _Noop()


class _Opaque:
    """Calls ``fn``; an object, so it stays an opaque call (see _Noop)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__

    def __call__(self, *args: object) -> Any:
        return self.fn(*args)


# -- hooks ---------------------------------------------------------------------


@scenario
def node_pre_hook() -> Backward:
    """grad_fn.register_prehook on a MulBackward0: its pre-hooks run opaque before the node."""
    x = leaf(3, 4)
    y = x * 3.0
    y.grad_fn.register_prehook(_Opaque(lambda grads: (grads[0] * 2,)))
    return Backward(y.sin().sum())


@scenario
def traced_node_hooks() -> Backward:
    """pure node pre- and post-hooks on a TanhBackward0 and a pure tensor hook: all traced inline, in eager's order."""
    x = leaf(3, 4)
    h = x * 3.0
    t = h.tanh()
    t.register_hook(_double)
    t.grad_fn.register_prehook(lambda grads: (grads[0] + 1,))
    t.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (grad_inputs[0] * grad_outputs[0],))
    return Backward(t.sin().sum())


@scenario
def node_post_hook() -> Backward:
    """grad_fn.register_hook (a post hook) on an ExpBackward0: an opaque call after the node."""
    x = leaf(3, 4)
    y = x.exp()
    y.grad_fn.register_hook(_noop)
    return Backward((y * y).sum())


@scenario
def post_accumulate_grad_hook() -> Backward:
    """a leaf's register_post_accumulate_grad_hook: an opaque call after AccumulateGrad."""
    w = leaf(4, 3)
    w.register_post_accumulate_grad_hook(_noop)
    return Backward((torch.randn(2, 4) @ w).relu().sum())


@scenario
def retain_grad_only() -> Backward:
    """retain_grad() on an intermediate, no other hook: the retain_grad call alone."""
    x = leaf(2, 5)
    h = x.tanh()
    h.retain_grad()
    return Backward(h.pow(2).sum())


@scenario
def root_tensor_hook() -> Backward:
    """a tensor hook on the root itself: it rewrites the root gradient before the first node."""
    x = leaf(4)
    y = x * x
    y.register_hook(_double)
    return Backward(y, grad_outputs=torch.ones(4))


@scenario
def hooks_of_every_kind() -> Backward:
    """tensor pre, node pre, node post, retain_grad and post-accumulate hooks in one graph."""
    x = leaf(3, 3)
    h = x.sigmoid()
    h.register_hook(_double)
    h.retain_grad()
    h.grad_fn.register_prehook(lambda grads: None)
    h.grad_fn.register_hook(_noop)
    x.register_post_accumulate_grad_hook(_noop)
    return Backward((h @ h).sum())


# -- custom Functions -----------------------------------------------------------


class _ScaleOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k
        return x * k

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.k, None


_SCALE_CALLS: list[int] = []


class _ScaleOpaque(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        _SCALE_CALLS.append(1)  # a side effect: the backward runs opaque
        return g * ctx.k, None


@scenario
def custom_function_once_differentiable() -> Backward:
    """a @once_differentiable custom Function with a non-tensor input: is_variable_input (True, False)."""
    x = leaf(2, 3)
    return Backward(_ScaleOnce.apply(x.cos(), 2.5).sum())


class _SplitNonDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = x.argmax(dim=1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x)
        return x.exp(), idx

    @staticmethod
    def backward(ctx, g: torch.Tensor, g_idx: torch.Tensor | None) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * x.exp()


@scenario
def custom_function_non_differentiable_output() -> Backward:
    """a custom Function with a mark_non_differentiable output: one gradient edge used."""
    x = leaf(3, 4)
    y, idx = _SplitNonDiff.apply(x)
    return Backward((y * idx.unsqueeze(1)).sum())


class _NoMaterialize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        return a * 2, b * 3

    @staticmethod
    def backward(ctx, ga: torch.Tensor | None, gb: torch.Tensor | None) -> tuple:
        return (None if ga is None else ga * 2), (None if gb is None else gb * 3)


@scenario
def custom_function_no_materialize() -> Backward:
    """set_materialize_grads(False), one of two outputs unused: the other gradient stays None."""
    a, b = leaf(2, 2), leaf(2, 2)
    out_a, _ = _NoMaterialize.apply(a, b)
    return Backward(out_a.sum())


# -- views and in-place ---------------------------------------------------------


@scenario
def copyslices_index_put() -> Backward:
    """y[idx] = v on an intermediate: index_put_ under a CopySlices node."""
    x, v = leaf(5, 3), leaf(2, 3)
    y = x.clone()
    y[torch.tensor([0, 3])] = v * 2
    return Backward(y.pow(2).sum())


@scenario
def view_replay_chain() -> Backward:
    """add_ on a view of a view (t()[0]): the view chain replayed under CopySlices."""
    x = leaf(3, 4)
    y = x * 2.0
    y.t()[1].add_(torch.ones(3))
    return Backward((y * y).sum())


# -- roots, inputs, retain_graph ------------------------------------------------


@scenario
def grad_inputs_intermediate_only() -> Backward:
    """autograd.grad w.r.t. an intermediate only: leaves are not accumulated, nodes below not needed."""
    x = leaf(3, 3)
    h = x.exp()
    return Backward((h.sin() * h).sum(), inputs=[h])


@scenario
def grad_inputs_unused_branch() -> Backward:
    """autograd.grad w.r.t. one of two leaves: the other branch's nodes have needed = False."""
    a, b = leaf(3), leaf(3)
    return Backward((a.exp() + b.log1p()).sum(), inputs=[b])


@scenario
def three_roots_mixed() -> Backward:
    """three roots: a scalar with an implicit gradient, a vector and a view, explicit gradients."""
    x = leaf(2, 3)
    s = x.sum()
    v = x.mean(dim=0)
    t = x.t()
    return Backward([s, v, t], grad_outputs=[None, torch.ones(3), torch.full((3, 2), 0.5)])


@scenario
def retain_graph_second_backward() -> Backward:
    """the graph captured after an eager backward(retain_graph=True): same keys as the first."""
    x = leaf(3, 4)
    loss = (x.sin() @ x.t()).sum()
    loss.backward(retain_graph=True)
    return Backward(loss)


@scenario
def frozen_input_invalid_edges() -> Backward:
    """an input that does not require grad and a detached branch: invalid edges (N) in the keys."""
    x = leaf(3, 3)
    c = torch.randn(3, 3)
    return Backward((x * c + x.detach().exp() * x).sum())


@scenario
def grad_already_set() -> Backward:
    """a leaf whose .grad is set before the backward: AccumulateGrad keyed the same, sums in place."""
    w = leaf(3, 2)
    w.grad = torch.ones(3, 2)
    return Backward((torch.randn(4, 3) @ w).sum())


@scenario
def segmented_opaque_calls() -> Backward:
    """traced ops between a node post hook, an opaque custom Function and a sparse-grad opaque node: the segment cuts."""
    emb = torch.nn.Embedding(6, 3, sparse=True)
    x = leaf(2, 3)
    h = x.exp()
    h.grad_fn.register_hook(_noop)
    y = _ScaleOpaque.apply(h.sin(), 0.5)
    e = emb(torch.tensor([1, 4]))
    return Backward((y.cos() * e).sum())


# -- sizes -----------------------------------------------------------------------


def _mlp_batch(batch: int, dynamic: bool) -> Backward:
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    return Backward(net(torch.randn(batch, 4)).sum(), dynamic=dynamic)


@scenario
def sizes_static_before_recompile() -> Backward:
    """an MLP at batch 3 with static sizes: the first compile, sizes baked into the graph."""
    return _mlp_batch(3, dynamic=False)


@scenario
def sizes_dynamic_after_recompile() -> Backward:
    """the same MLP at batch 7 after the size change: recompiled with symbolic sizes, same keys."""
    return _mlp_batch(7, dynamic=True)


# -- compiled forwards, double backward, checkpointing ---------------------------


def _compiled_region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * 2


@scenario
def compiled_forward_aot() -> Backward:
    """a torch.compile'd (aot_eager) forward: its AOT backward inlined as one CompiledFunction node."""
    torch._dynamo.reset()
    # the key holds the AOT id, a process-wide counter: start it at 0 so
    # that the snapshot does not depend on what was compiled before
    aot_autograd.AOT_COUNTER = itertools.count()
    fn = torch.compile(_compiled_region, backend="aot_eager", fullgraph=True)
    x, w = leaf(2, 3), leaf(3, 3)
    return Backward(fn(x, w).exp().sum())


@scenario
def double_backward() -> Backward:
    """the second backward of a gradient taken with create_graph=True: backward-of-backward nodes."""
    x = leaf(3)
    y = (x.tanh() * x).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    return Backward(g.pow(2).sum())


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w).sin()


@scenario
def checkpoint_non_reentrant() -> Backward:
    """torch.utils.checkpoint(use_reentrant=False): nodes whose saved tensors recompute, run opaque."""
    x, w = leaf(2, 3), leaf(3, 3)
    return Backward(checkpoint(_block, x, w, use_reentrant=False).sum())


@scenario
def checkpoint_reentrant() -> Backward:
    """torch.utils.checkpoint(use_reentrant=True): one CheckpointFunction custom Function node."""
    x, w = leaf(2, 3), leaf(3, 3)
    return Backward(checkpoint(_block, x, w, use_reentrant=True).sum())


# -- distributed-style hooks (no process group) ----------------------------------


def _ddp_style(params: list[torch.Tensor]) -> None:
    """DDP's Reducer hooks every parameter's AccumulateGrad from C++ and, when
    the last bucket is ready, queues a final callback. No process group may be
    created in the golden run, so this uses the Python shape of the same
    thing: a post-accumulate-grad hook per parameter that, on the first
    one, queues an engine callback (where the allreduce would be awaited)."""
    state = {"queued": False}

    def hook(p: torch.Tensor) -> None:
        if not state["queued"]:
            state["queued"] = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: state.update(queued=False))

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


@scenario
def ddp_style_hooks() -> Backward:
    """DDP-shaped: post-accumulate hooks on every parameter queue an engine callback (no process group)."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    _ddp_style(list(net.parameters()))
    return Backward(net(torch.randn(3, 4)).pow(2).sum())


class _PreBackward(torch.autograd.Function):
    """FSDP2's RegisterPostBackwardFunction shape: identity forward, its
    backward marks the module's backward done (where FSDP2 reshards)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g


@scenario
def fsdp_style_hooks() -> Backward:
    """FSDP2-shaped: identity custom Function on inputs, pre-backward tensor hook on outputs queueing a callback, post-accumulate hooks."""
    lin = torch.nn.Linear(3, 3)
    x = _PreBackward.apply(torch.randn(2, 3).requires_grad_())
    out = lin(x)

    def pre_backward(g: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(_noop)
        return g

    out.register_hook(pre_backward)
    for p in lin.parameters():
        p.register_post_accumulate_grad_hook(_noop)
    return Backward(out.sum())


# -- sparse gradients ------------------------------------------------------------


@scenario
def sparse_embedding() -> Backward:
    """nn.Embedding(sparse=True): its backward node runs opaque and yields a sparse .grad."""
    emb = torch.nn.Embedding(10, 3, sparse=True)
    return Backward(emb(torch.tensor([[1, 2], [4, 1]])).tanh().sum())


# -- every kind of value a key holds ----------------------------------------------


@scenario
def key_floats_and_optionals() -> Backward:
    """float attributes (leaky_relu slope, pow exponent) and optional scalars (clamp min only): f and N tags."""
    x = leaf(3, 4)
    y = F.leaky_relu(x, 0.125).pow(2.5).clamp(min=-0.5)
    return Backward((y + F.elu(x, alpha=0.75)).sum())


@scenario
def key_bools_lists_optional_floats() -> Backward:
    """bilinear upsampling: align_corners (bool), output_size/input_size (lists), scales (optional floats)."""
    x = leaf(1, 2, 3, 3)
    return Backward(F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=True).sum())


@scenario
def key_dtypes_and_casts() -> Backward:
    """float32 -> float64 -> bfloat16 casts and sum(dtype=float64): dtypes in attributes and metadata."""
    x = leaf(3, 4)
    y = x.to(torch.float64).exp().to(torch.bfloat16)
    return Backward(y.float().sum() + x.sum(dtype=torch.float64).float())


@scenario
def key_devices_and_layouts() -> Backward:
    """new_ones/to(device) on CPU and a contiguous(channels_last) copy: device and memory-format values."""
    x = leaf(1, 2, 3, 3)
    y = x.to("cpu", copy=True).contiguous(memory_format=torch.channels_last)
    return Backward((y * y.new_ones(y.shape)).sum())


@scenario
def key_negative_and_large_ints() -> Backward:
    """dims -1/-2 (zigzag, one byte) and diagonal offset 150 (beyond one byte: the 3-byte size)."""
    x = leaf(2, 160)
    d = x.diagonal(offset=150).sum()
    t = x.transpose(-1, -2).softmax(dim=-2)
    return Backward(d + t.sum(dim=-1).pow(2).sum())


@scenario
def key_complex_conj_bits() -> Backward:
    """a complex64 leaf through conj() and a real view: dtype complex64 and (conj, neg) bits in the key."""
    x = leaf(3, dtype=torch.complex64)
    y = x * x.conj()
    return Backward(torch.view_as_real(y).sum() + x.abs().sum())


@scenario
def key_int_lists_and_strs() -> Backward:
    """F.pad's list of ints, sum over a dim list, and gelu(approximate='tanh'): a str attribute."""
    x = leaf(2, 3, 4)
    y = F.pad(x, [1, 2, 0, 1]).sum(dim=[0, 2])
    return Backward(F.gelu(y, approximate="tanh").sum())


@scenario
def key_half_precision() -> Backward:
    """a float16 leaf in mixed arithmetic with float32: f16 metadata, grads cast back."""
    a = leaf(3, 3, dtype=torch.float16)
    b = leaf(3, 3)
    return Backward((a.float() @ b).sum() + (a * 2).float().sum())
