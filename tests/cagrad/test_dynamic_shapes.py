"""Dynamic shapes: SizeInput STATIC -> DYNAMIC, symbolic from the start, and
the default's static first capture.

Every step's gradients must equal eager's; the capture counts follow torch's
compiled autograd's rule (checked against it where it runs the same
sequence): with ``dynamic=False`` sizes start static and a backward that
differs only in sizes makes the changed sizes symbols, once; with
``dynamic=True`` sizes are symbols from the first capture and the backend
compiles once; with the default (``dynamic=None``) the first capture is
static and the first backward at other sizes captures the symbolic graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.registry import register_backend

import cagrad

from .conftest import same

BATCHES = [64, 64, 65, 65, 66, 67, 64]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _train(model, batches, make, backward):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for step, n in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        x, y = make(step, n)
        backward(nn.functional.mse_loss(model(x), y))
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def _mlp_batch(step, n):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


_COMPILED: list[torch.fx.GraphModule] = []


@register_backend(name="cagrad_test_counting_eager")
def _counting_eager(gm, example_inputs):
    """The eager backend, counting the graphs it is given."""
    _COMPILED.append(gm)
    return gm.forward


def _symbolic(gm: torch.fx.GraphModule) -> bool:
    """Whether a captured graph's inputs (placeholders, or the items of a
    list placeholder) carry symbolic sizes."""
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, torch.SymInt) or (
                isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape)
            ):
                return True
    return False


@pytest.mark.parametrize("dynamic, captures", [(False, 2), (True, 1), (None, 2)])
def test_mlp_batch_sequence(dynamic, captures):
    model = _mlp()
    twin = copy.deepcopy(model)
    expected = _train(model, BATCHES, _mlp_batch, lambda loss: loss.backward())
    compiled_before = len(_COMPILED)

    def compiled(loss):
        with cagrad.enable("cagrad_test_counting_eager", dynamic=dynamic):
            loss.backward()

    actual = _train(twin, BATCHES, _mlp_batch, compiled)
    for step, (e, a) in enumerate(zip(expected, actual)):
        for i, (x, y) in enumerate(zip(e, a)):
            torch.testing.assert_close(y, x, rtol=0, atol=0, msg=lambda m: f"step {step} param {i}: {m}")
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == captures
    assert cagrad.counters["recompiles_shape"] == captures - 1
    # the backend compiled each captured graph once, whatever the sizes
    assert len(_COMPILED) - compiled_before == captures
    assert cagrad.counters["backend_compiles"] == captures
    # True: symbolic from the start; None: static at 64, symbolic from 65
    want = {True: [True], None: [False, True], False: [False, True]}[dynamic]
    assert [_symbolic(gm) for gm in _COMPILED[compiled_before:]] == want


def test_dynamic_must_be_none_true_or_false():
    with pytest.raises(ValueError, match="dynamic must be None, True or False, not 'yes'"):
        cagrad.enable("eager", dynamic="yes")


class _SeqModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(ids)).mean(1))


def _seq_batch(step, length):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 30, (2, length), generator=g), torch.randn(2, 3, generator=g)


@pytest.mark.parametrize("dynamic", [False, True, None])
def test_sequence_model_with_varying_length(dynamic):
    torch.manual_seed(0)
    model = _SeqModel()
    twin = copy.deepcopy(model)
    lengths = [5, 5, 7, 9, 7, 12]
    expected = _train(model, lengths, _seq_batch, lambda loss: loss.backward())

    def compiled(loss):
        with cagrad.enable("eager", dynamic=dynamic):
            loss.backward()

    actual = _train(twin, lengths, _seq_batch, compiled)
    for step, (e, a) in enumerate(zip(expected, actual)):
        for i, (x, y) in enumerate(zip(e, a)):
            torch.testing.assert_close(y, x, msg=lambda m: f"step {step} param {i}: {m}")
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == (1 if dynamic else 2)  # None: 5 static, then symbolic


@pytest.mark.parametrize(
    "build",
    [
        lambda n: (torch.randn(n, 6, requires_grad=True), lambda x: x.sum(0).exp().sum()),
        lambda n: (torch.randn(n, 6, requires_grad=True), lambda x: x.mean(1, keepdim=True).sin().sum()),
        lambda n: (torch.randn(n, 6, requires_grad=True), lambda x: x[1:].t().reshape(-1).tanh().sum()),
        lambda n: (torch.randn(n, 6, requires_grad=True), lambda x: x.exp().unsqueeze(1).expand(n, 3, 6).sum()),
        lambda n: (torch.randn(n, 6, requires_grad=True), lambda x: torch.cat([x.exp(), torch.ones(2, 6), x]).sum()),
        lambda n: (torch.randn(2 * n, 6, requires_grad=True), lambda x: sum(t.sin().sum() for t in x.split(x.shape[0] // 2, 0))),
        lambda n: (torch.randn(n, 6, requires_grad=True), lambda x: x.exp().select(0, 1).sum() + x[:, :1].squeeze(1).sum()),
    ],
    ids=["sum", "mean", "slice_view", "expand", "cat", "split", "select_squeeze"],
)
def test_size_carrying_nodes_across_sizes(build):
    """Nodes that keep sizes as ints run their Python formula with symbols:
    one capture serves every size, and each size gives eager's gradient."""
    for n in (4, 5, 8, 4):
        torch.manual_seed(n)
        x, f = build(n)
        f(x).backward()
        expected = x.grad
        torch.manual_seed(n)
        x, f = build(n)
        with cagrad.enable("eager", dynamic=True):
            f(x).backward()
        same(expected, x.grad)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1


def test_size_one_is_specialized_and_recaptured():
    """A size traced at 1 is a constant (as in torch's ShapeEnv); another
    value is a new variant, with eager's gradients."""
    for n in (1, 3, 1, 4):
        torch.manual_seed(n)
        w = torch.randn(4, 3, requires_grad=True)
        x = torch.randn(n, 4)
        (x @ w).exp().sum().backward()
        expected = w.grad
        torch.manual_seed(n)
        w = torch.randn(4, 3, requires_grad=True)
        x = torch.randn(n, 4)
        with cagrad.enable("eager", dynamic=True):
            (x @ w).exp().sum().backward()
        same(expected, w.grad)
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["cache_hits"] == 2


def test_matches_torch_compiled_autograd_capture_counts():
    """The peer on the same batch sequence, dynamic=False: both capture twice."""
    import functools

    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["compiled_autograd"]["captures"]
    model = _mlp()
    with compiled_autograd._enable(functools.partial(torch.compile, backend="eager"), dynamic=False):
        _train(model, BATCHES, _mlp_batch, lambda loss: loss.backward())
    torch_captures = torch._dynamo.utils.counters["compiled_autograd"]["captures"] - before
    model = _mlp()
    with cagrad.enable("eager", dynamic=False):
        _train(model, BATCHES, _mlp_batch, lambda loss: loss.backward())
    assert torch_captures == cagrad.counters["captures"] == 2


def test_duck_sized_equal_sizes_split_once_then_every_size_hits():
    """``dynamic=True`` duck-sizes: sizes equal at capture share a symbol
    (the batch of 8 and the layer width of 8 here). A batch that differs
    from the width recaptures once with the batch on a symbol of its own;
    from then on every batch, the width's value included, is a hit, and
    every step's gradients are eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    twin = copy.deepcopy(model)
    batches = [8, 5, 6, 8, 11]

    def step(m, n, backward):
        torch.manual_seed(n)
        m.zero_grad(set_to_none=True)
        backward(m(torch.randn(n, 8)).square().mean())
        return [p.grad.clone() for p in m.parameters()]

    def compiled(loss):
        with cagrad.enable("eager", dynamic=True):
            loss.backward()

    for n in batches:
        expected = step(model, n, lambda loss: loss.backward())
        for e, a in zip(expected, step(twin, n, compiled)):
            same(e, a)
    assert cagrad.counters["captures"] == 2
    assert cagrad.counters["recompiles_shape"] == 1
    assert cagrad.counters["cache_hits"] == len(batches) - 2
    assert cagrad.counters["fallbacks"] == 0


def test_more_variants_than_the_bound_run_in_eager_with_the_reason():
    """Sizes 1 are specialized, so each pattern of 1s among four dims is a
    variant of its own; past MAX_VARIANTS the key sequence falls back (its
    gradients are eager's), counted with the reason."""
    import itertools

    from cagrad.keys.cache import MAX_VARIANTS

    patterns = list(itertools.product((1, 3), repeat=4))
    for shape in patterns:
        x = torch.randn(shape, requires_grad=True)
        (want,) = torch.autograd.grad((x.sin() * 2).sum(), x)
        with cagrad.enable("eager"):
            (x.sin() * 2).sum().backward()
        torch.testing.assert_close(x.grad, want)
    c = cagrad.counters
    assert c["captures"] == MAX_VARIANTS
    assert c["fallback_reasons"] == {"too_many_size_variants": len(patterns) - MAX_VARIANTS}
