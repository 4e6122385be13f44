"""The registry of golden-graph scenarios.

A scenario is a named, deterministic function that runs a small forward pass
(float32 on CPU, small shapes) and returns a :class:`Backward`: what
:func:`cagrad.capture` needs to trace that forward's backward. Register one
with :func:`scenario`::

    @scenario
    def views() -> Backward:
        \"\"\"view, transpose, slice, select, expand\"\"\"
        x = leaf(2, 3, 4)
        return Backward(x.transpose(0, 1)[1:].sum())

The name is the function's name (or ``@scenario("name")``); the first line of
the docstring is the scenario's one-line description, stored in its snapshot.
:func:`build` runs a scenario under a forked RNG seeded with 0, so the global
RNG is untouched and every run builds the same tensors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

SEED = 0
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclasses.dataclass
class Backward:
    """What :func:`cagrad.capture` takes: ``capture(outputs, grad_outputs, inputs)``.

    Attributes:
        outputs: the root tensor(s) of the backward.
        grad_outputs: their gradients (None: implicit ones for scalars).
        inputs: None for ``autograd.backward``; tensors for ``autograd.grad``.
        dynamic: capture with every size that may be dynamic as a symbol.
        create_graph: capture the backward as ``create_graph=True`` runs it.
    """

    outputs: torch.Tensor | Sequence[torch.Tensor]
    grad_outputs: torch.Tensor | Sequence[torch.Tensor | None] | None = None
    inputs: torch.Tensor | Sequence[torch.Tensor] | None = None
    dynamic: bool = False
    create_graph: bool = False


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One registered scenario.

    Attributes:
        name: the registry key and the snapshot's file stem.
        description: the first docstring line (empty without a docstring).
        fn: builds the forward and returns its :class:`Backward`.
    """

    name: str
    description: str
    fn: Callable[[], Backward]


REGISTRY: dict[str, Scenario] = {}


def scenario(arg: str | Callable[[], Backward]) -> Callable:
    """Registers a scenario: ``@scenario`` or ``@scenario("name")``.

    Raises:
        ValueError: a name that is not ``[a-z][a-z0-9_]*`` (it becomes a file
            name) or that is already registered.
    """

    def register(fn: Callable[[], Backward], name: str) -> Callable[[], Backward]:
        if not _NAME.match(name):
            raise ValueError(f"scenario name {name!r} must match {_NAME.pattern}")
        if name in REGISTRY:
            raise ValueError(f"scenario {name!r} is already registered")
        doc = (fn.__doc__ or "").strip().splitlines()
        REGISTRY[name] = Scenario(name, doc[0].strip() if doc else "", fn)
        return fn

    if isinstance(arg, str):
        return lambda fn: register(fn, arg)
    return register(arg, arg.__name__)


def names() -> list[str]:
    """All registered scenario names, sorted."""
    return sorted(REGISTRY)


def get(name: str) -> Scenario:
    """The scenario called ``name``.

    Raises:
        KeyError: no such scenario (the message lists the known ones).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no scenario {name!r}; known: {', '.join(names())}") from None


def build(name: str) -> Backward:
    """Runs scenario ``name``'s forward with the RNG seeded to :data:`SEED`.

    The global RNG state is restored afterwards.
    """
    sc = get(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return sc.fn()


def leaf(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A random CPU leaf that requires grad."""
    return torch.randn(*shape, dtype=dtype).requires_grad_()


# -- the scenarios -------------------------------------------------------------


@scenario
def mlp_step() -> Backward:
    """nn.Sequential(Linear, ReLU, Linear, GELU, Linear) with an MSE loss."""
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 4),
    )
    x = torch.randn(2, 8)
    target = torch.randn(2, 4)
    return Backward(F.mse_loss(model(x), target))


@scenario
def broadcast() -> Backward:
    """(3,1) * (1,4) + (4,): broadcast grads are summed back to each shape."""
    a, b, c = leaf(3, 1), leaf(1, 4), leaf(4)
    return Backward((a * b + c).sum())


@scenario
def broadcast_dtype_promotion() -> Backward:
    """float32 (3,4) * float64 (4,): grads are cast back to each leaf's dtype."""
    a = leaf(3, 4)
    b = leaf(4, dtype=torch.float64)
    return Backward((a * b).sum())


@scenario
def reduction_dims() -> Backward:
    """sum(dim=1, keepdim), mean over (0, 2), amax(dim=-1) of one (2,3,4) leaf."""
    x = leaf(2, 3, 4)
    s = x.sum(dim=1, keepdim=True)  # (2,1,4)
    m = x.mean(dim=(0, 2))  # (3,)
    a = x.amax(dim=-1)  # (2,3)
    return Backward((s * s).sum() + (a * m).sum())


@scenario
def views() -> Backward:
    """view, transpose, permute, slice, select, unsqueeze/expand, reshape."""
    x = leaf(2, 3, 4)
    v = x.view(6, 4).t()  # (4,6)
    p = x.permute(2, 0, 1)[1:, :, 0]  # (3,2)
    e = x.select(1, 2).unsqueeze(1).expand(2, 5, 4)  # (2,5,4)
    r = x.transpose(0, 2).reshape(-1)  # non-contiguous reshape copies
    return Backward(v.sum() + (p * p).sum() + e.sum() + (r * r).sum())


@scenario
def matmul_chain() -> Backward:
    """(2,3)@(3,4)@(4,5), then a batched matmul against a (4,5,2) leaf."""
    a, b, c = leaf(2, 3), leaf(3, 4), leaf(4, 5)
    d = leaf(4, 5, 2)
    ab_c = a @ b @ c  # (2,5)
    batched = torch.matmul(ab_c, d)  # broadcast bmm -> (4,2,2)
    return Backward(batched.sum())


@scenario
def softmax() -> Backward:
    """softmax and log_softmax over the last dim, then a weighted NLL."""
    x = leaf(3, 5)
    target = torch.tensor([0, 4, 2])
    p = torch.softmax(x, dim=-1)
    logp = torch.log_softmax(x * 2.0, dim=-1)
    return Backward(F.nll_loss(logp, target) + (p * p).sum())


@scenario
def shared_subexpression() -> Backward:
    """h = sin(x) feeds three consumers: its grads are summed in the buffer."""
    x = leaf(4, 3)
    h = x.sin()
    return Backward((h * h + h.exp() + h.t().sum(dim=0).unsqueeze(1)).sum())


@scenario
def two_losses() -> Backward:
    """backward([loss_a, loss_b]) over a shared trunk: a GraphRoot, two roots."""
    x = leaf(3, 4)
    w = leaf(4, 4)
    trunk = torch.tanh(x @ w)
    loss_a = trunk.pow(2).mean()
    loss_b = trunk.abs().sum()
    return Backward([loss_a, loss_b])


@scenario
def multi_root_grad_outputs() -> Backward:
    """two non-scalar roots with explicit grad_outputs, one of them a view."""
    x = leaf(2, 3)
    y = x.exp()
    z = (x * 3.0).t()
    return Backward([y, z], grad_outputs=[torch.randn(2, 3), torch.randn(3, 2)])


@scenario
def autograd_grad_inputs() -> Backward:
    """autograd.grad w.r.t. an intermediate and one of two leaves."""
    x, w = leaf(3, 4), leaf(4, 2)
    h = x.cos()
    out = (h @ w).sigmoid().sum()
    return Backward(out, inputs=[h, w])


@scenario
def leaf_used_twice() -> Backward:
    """one weight used by two matmuls: AccumulateGrad sums both grads."""
    w = leaf(4, 4)
    x = torch.randn(2, 4)
    h = torch.relu(x @ w)
    return Backward((h @ w).sum())


def _double_grad(g: torch.Tensor) -> torch.Tensor:
    return g * 2


@scenario
def tensor_and_leaf_hooks() -> Backward:
    """a tensor hook and a leaf hook (pure: traced into the graph) and retain_grad (an opaque call), in eager's order."""
    x = leaf(3, 4)
    h = x.exp()
    h.register_hook(_double_grad)
    h.retain_grad()
    x.register_hook(_double_grad)
    return Backward((h * h).sum())


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


@scenario
def custom_function() -> Backward:
    """a custom autograd.Function between traced nodes: its backward traced with PyNode's steps."""
    x = leaf(2, 3)
    return Backward(_Cube.apply(x.tanh()).sum())


_CUBE_CALLS: list[int] = []


class _CountedCube(_Cube):
    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        _CUBE_CALLS.append(1)  # a side effect: the backward runs opaque
        return _Cube.backward(ctx, g)


@scenario
def custom_function_opaque() -> Backward:
    """a custom autograd.Function whose backward has a side effect: called as PyNode would."""
    x = leaf(2, 3)
    return Backward(_CountedCube.apply(x.tanh()).sum())


@scenario
def inplace_on_view() -> Backward:
    """mul_ on a slice of an intermediate: a CopySlices node run as it is."""
    x, w = leaf(4, 3), leaf(3)
    y = x * 1
    y[1:].mul_(w)
    return Backward((y * y).sum())


@scenario
def mlp_dynamic_batch() -> Backward:
    """an MLP step traced with dynamic sizes: sizes[j] symbols, Python formulas."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(5, 4)
    return Backward(net(x).pow(2).mean(), dynamic=True)
