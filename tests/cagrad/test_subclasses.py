"""Tensor subclasses in a backward (cagrad.keys.subclasses).

A traceable wrapper subclass (``TwoTensor``) compiles: lifted as its inner
tensors, traced through its ``__torch_dispatch__``, a subclass gradient
rebuilt after the graph. Gradients and ``.grad`` (class, both inner tensors
bit for bit, outer and inner strides) are compared with eager autograd run
on copies of the same inputs; the capture and hit counts, and the counted
reason of every subclass that falls back, are checked.
"""

from __future__ import annotations

import pytest
import torch

import cagrad

try:
    from torch.testing._internal.two_tensor import TwoTensor
except Exception:  # noqa: BLE001 - torch without its testing package
    TwoTensor = None

pytestmark = pytest.mark.skipif(TwoTensor is None, reason="torch.testing._internal.two_tensor not importable")

if TwoTensor is not None:

    class TaggedTwoTensor(TwoTensor):
        """A TwoTensor whose flatten metadata holds a tag (its ops return
        plain TwoTensors, as TwoTensor's dispatch builds them)."""

        tag = 0

        def __tensor_flatten__(self):
            names, _ = super().__tensor_flatten__()
            return names, {"tag": self.tag}

        @staticmethod
        def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
            t = TaggedTwoTensor(inner["a"], inner["b"], outer_size, outer_stride)
            t.tag = ctx["tag"]
            return t

    class SameMetadataTwoTensor(TwoTensor):
        """Another class with TwoTensor's flatten metadata (None)."""

        @staticmethod
        def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
            return SameMetadataTwoTensor(inner["a"], inner["b"], outer_size, outer_stride)

    class LooseTwoTensor(TwoTensor):
        """A TwoTensor whose b may sit at another storage offset than a
        (TwoTensor's own constructor asserts they match): inner metadata
        the outer tensor does not mirror."""

        @staticmethod
        def __new__(cls, a, b, outer_size=None, outer_stride=None, *, requires_grad=None):
            return torch.Tensor._make_wrapper_subclass(
                cls,
                a.shape if outer_size is None else outer_size,
                strides=a.stride() if outer_stride is None else outer_stride,
                storage_offset=a.storage_offset(),
                dtype=a.dtype,
                layout=a.layout,
                device=a.device,
                requires_grad=a.requires_grad if requires_grad is None else requires_grad,
            )

        @staticmethod
        def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
            return LooseTwoTensor(inner["a"], inner["b"], outer_size, outer_stride)

    class UnkeyableTwoTensor(TwoTensor):
        """A TwoTensor whose flatten metadata is an object cagrad cannot key."""

        def __tensor_flatten__(self):
            names, _ = super().__tensor_flatten__()
            return names, object()

        @staticmethod
        def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
            return UnkeyableTwoTensor(inner["a"], inner["b"], outer_size, outer_stride)

    class TensorCtxTwoTensor(TwoTensor):
        """A TwoTensor whose flatten metadata holds a tensor (hashable by
        identity, compared elementwise: not a value cagrad can key)."""

        scale = torch.ones(2)

        def __tensor_flatten__(self):
            names, _ = super().__tensor_flatten__()
            return names, {"scale": self.scale}

        @staticmethod
        def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
            return TensorCtxTwoTensor(inner["a"], inner["b"], outer_size, outer_stride)

    class HashRaisesTwoTensor(TwoTensor):
        """A TwoTensor whose flatten metadata's hash raises."""

        class Meta:
            def __eq__(self, other):
                return True

            def __hash__(self):
                raise ValueError("no hash today")

        def __tensor_flatten__(self):
            names, _ = super().__tensor_flatten__()
            return names, self.Meta()

        @staticmethod
        def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
            return HashRaisesTwoTensor(inner["a"], inner["b"], outer_size, outer_stride)


class PlainSubclass(torch.Tensor):
    """A subclass with no ``__torch_dispatch__`` and no flatten protocol."""


def _two(shape, cls=None, transpose=False, tag=0, requires_grad=True):
    cls = cls or TwoTensor
    a, b = torch.randn(*shape), torch.randn(*shape)
    if transpose:
        a, b = a.t(), b.t()
    t = cls(a, b)
    if tag:
        t.tag = tag
    return t.requires_grad_(requires_grad)


def _clone(t):
    """A copy with ``t``'s strides and storage offset."""
    base = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype)
    return base.as_strided(t.shape, t.stride(), t.storage_offset()).copy_(t)


def _copy(t):
    """A fresh leaf with ``t``'s class, tag, inner values and strides."""
    if isinstance(t, TwoTensor):
        c = type(t)(_clone(t.a), _clone(t.b))
        if hasattr(t, "tag"):
            c.tag = t.tag
        return c.requires_grad_(t.requires_grad)
    return t.detach().clone().requires_grad_(t.requires_grad)


def _same_grad(actual, expected):
    assert type(actual) is type(expected), (type(actual), type(expected))
    if expected is None:
        return
    assert actual.shape == expected.shape and actual.stride() == expected.stride()
    if isinstance(expected, TwoTensor):
        for name in ("a", "b"):
            x, y = getattr(actual, name), getattr(expected, name)
            assert type(x) is type(y) and x.stride() == y.stride(), name
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _compare(fn, make, steps=3, backend="eager", dynamic=None):
    """Runs ``fn(*make())`` forward and backward ``steps`` times in eager and
    under cagrad (fresh inputs each step, ``.grad`` accumulated over two
    backwards on the last); every ``.grad`` must be eager's."""
    for step in range(steps):
        inputs = make()
        copies = [_copy(t) for t in inputs]
        repeat = 2 if step == steps - 1 else 1
        for _ in range(repeat):
            fn(*copies).backward()
        with cagrad.enable(backend, dynamic=dynamic):
            for _ in range(repeat):
                fn(*inputs).backward()
        for x, y in zip(inputs, copies):
            if y.requires_grad:
                _same_grad(x.grad, y.grad)


def _counts():
    c = cagrad.counters
    return c["captures"], c["cache_hits"], c["fallbacks"], c["guard_hits"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_two_tensor_leaf_compiles(backend):
    _compare(lambda x: (x.sin() * x).sum(), lambda: [_two((3, 4))], backend=backend)
    assert _counts() == (1, 3, 0, 0), dict(cagrad.counters)


def test_two_tensor_intermediate_and_transposed_leaf():
    # saved intermediates (exp's result, matmul's operands) are TwoTensors
    _compare(lambda x: (x.exp() @ x.t()).tanh().sum(), lambda: [_two((4, 3), transpose=True)])
    assert _counts() == (1, 3, 0, 0), dict(cagrad.counters)


def test_plain_leaf_with_two_tensor_gradient():
    # w is a plain leaf; its gradient goes through t and is a TwoTensor
    _compare(
        lambda w, t: (w * t).sin().sum(),
        lambda: [torch.randn(3, 4, requires_grad=True), _two((3, 4), requires_grad=False)],
    )
    assert _counts() == (1, 3, 0, 0), dict(cagrad.counters)


def test_autograd_grad_of_two_tensor():
    x = _two((3,))
    y = _copy(x)
    (expected,) = torch.autograd.grad((y * y).sum(), [y])
    with cagrad.enable("eager"):
        (actual,) = torch.autograd.grad((x * x).sum(), [x])
    _same_grad(actual, expected)
    assert cagrad.counters["captures"] == 1 and cagrad.counters["fallbacks"] == 0


def test_changed_flatten_metadata_recaptures():
    _compare(lambda x: (x * x).sum(), lambda: [_two((3,), cls=TaggedTwoTensor, tag=1)], steps=2)
    assert _counts() == (1, 2, 0, 0)
    _compare(lambda x: (x * x).sum(), lambda: [_two((3,), cls=TaggedTwoTensor, tag=2)], steps=2)
    assert _counts() == (2, 4, 0, 0)


def test_other_subclass_type_or_inner_metadata_recaptures():
    _compare(lambda x: (x * x).sum(), lambda: [_two((3,))], steps=1)
    _compare(lambda x: (x * x).sum(), lambda: [_two((3,), cls=TaggedTwoTensor)], steps=1)
    assert _counts() == (2, 2, 0, 0)  # each: a capture, then a hit (.grad accumulated)
    # the same shape with transposed inner tensors: their layout is keyed
    # (static size slots) and the gradient follows it
    _compare(lambda x: (x * x).sum(), lambda: [_two((3, 3))], steps=1)
    _compare(lambda x: (x * x).sum(), lambda: [_two((3, 3), transpose=True)], steps=1)
    assert _counts() == (4, 4, 0, 0)


def test_other_class_with_the_same_metadata_recaptures():
    _compare(lambda x: (x * x).sum(), lambda: [_two((3,))], steps=1)
    _compare(lambda x: (x * x).sum(), lambda: [_two((3,), cls=SameMetadataTwoTensor)], steps=1)
    assert _counts() == (2, 2, 0, 0)


def test_inner_tensor_metadata_recaptures():
    # the same outer tensor; only b's storage offset differs
    def make(offset):
        def build():
            b = torch.randn(4)[offset : offset + 3]
            return [LooseTwoTensor(torch.randn(3), b).requires_grad_(True)]

        return build

    _compare(lambda x: (x * x).sum(), make(0), steps=1)
    _compare(lambda x: (x * x).sum(), make(1), steps=1)
    assert _counts() == (2, 2, 0, 0)


def test_hit_guard_stays_off(caplog):
    # a guard reads plain tensors' metadata: every hit takes the full path
    with caplog.at_level("DEBUG", logger="cagrad.guards"):
        _compare(lambda x: (x * 2).sum(), lambda: [_two((2,))], steps=3)
    assert cagrad.counters["guard_hits"] == 0 and cagrad.counters["cache_hits"] == 3
    assert "no guard for this graph: a tensor subclass" in caplog.text


def test_gradient_passed_through_is_copied_as_eager_copies_it():
    # AddBackward0 hands the root gradient on as it is: eager's
    # AccumulateGrad copies it (the caller holds it), so must cagrad
    g = TwoTensor(torch.ones(3), torch.full((3,), 2.0))
    x = _two((3,))
    y = _copy(x)
    (y + 0).backward(g)
    with cagrad.enable("eager"):
        for _ in range(2):
            x.grad = None
            (x + 0).backward(g)
    _same_grad(x.grad, y.grad)
    for t in (x.grad, y.grad):
        assert t is not g and t.a.data_ptr() != g.a.data_ptr() and t.b.data_ptr() != g.b.data_ptr()
    assert _counts() == (1, 1, 0, 0)


def _falls_back(fn, x, reason):
    y = _copy(x) if isinstance(x, TwoTensor) else x.detach().clone().requires_grad_(True)
    fn(y).backward()
    with cagrad.enable("eager"):
        fn(x).backward()
    _same_grad(x.grad, y.grad)
    assert cagrad.counters["captures"] == 0
    assert dict(cagrad.counters["fallback_reasons"]) == {reason: 1}, dict(cagrad.counters["fallback_reasons"])


@pytest.mark.parametrize("name", ["UnkeyableTwoTensor", "TensorCtxTwoTensor", "HashRaisesTwoTensor"])
def test_unkeyable_flatten_metadata_falls_back(name):
    _falls_back(lambda x: (x * x).sum(), _two((3,), cls=globals()[name]), "tensor_subclass")


def test_subclass_without_flatten_protocol_falls_back():
    x = torch.randn(3).as_subclass(PlainSubclass).requires_grad_(True)
    y = torch.randn(3).as_subclass(PlainSubclass).requires_grad_(True)
    (y.sin() * y).sum().backward()
    with cagrad.enable("eager"):
        (x.sin() * x).sum().backward()
    assert type(x.grad) is type(y.grad)
    assert dict(cagrad.counters["fallback_reasons"]) == {"tensor_subclass": 1}


def test_class_defined_in_a_function_falls_back():
    class Local(TwoTensor):
        pass

    _falls_back(lambda x: (x * x).sum(), _two((3,), cls=Local), "tensor_subclass")


def test_create_graph_with_subclass_falls_back():
    x = _two((3,))
    y = _copy(x)
    (gy,) = torch.autograd.grad((y * y * y).sum(), [y], create_graph=True)
    with cagrad.enable("eager"):
        (gx,) = torch.autograd.grad((x * x * x).sum(), [x], create_graph=True)
    _same_grad(gx.detach(), gy.detach())
    assert gx.requires_grad and gy.requires_grad
    assert dict(cagrad.counters["fallback_reasons"]) == {"tensor_subclass": 1}


def test_subclass_with_hook_falls_back():
    # a hook on the subclass leaf makes the graph segmented (opaque calls)
    seen = []

    def fn(x):
        x.register_hook(lambda g: seen.append(type(g)) or None)
        return (x * x).sum()

    _falls_back(fn, _two((3,)), "tensor_subclass")
    assert seen == [TwoTensor, TwoTensor]


def test_matches_torch_compiled_autograd():
    # torch's own compiled autograd on the same program: same .grad
    ca = pytest.importorskip("torch._dynamo.compiled_autograd")
    x = _two((3, 4))
    y = _copy(x)
    with ca._enable(torch.compile(backend="eager", fullgraph=True)):
        (y.cos() * y).sum().backward()
    torch._dynamo.reset()
    with cagrad.enable("eager"):
        (x.cos() * x).sum().backward()
    _same_grad(x.grad, y.grad)
    assert cagrad.counters["captures"] == 1 and cagrad.counters["fallbacks"] == 0


@pytest.mark.parametrize("dynamic", [None, True])
def test_other_sizes_make_static_variants(dynamic):
    # a subclass's sizes stay static: each size is a variant of its own,
    # and a size seen before hits its variant
    for n in (3, 5, 7, 3, 5):
        _compare(lambda x: (x * x).sum(), lambda n=n: [_two((n,))], steps=1, dynamic=dynamic)
    assert _counts() == (3, 7, 0, 0), dict(cagrad.counters)


def test_pure_tensor_hook_on_subclass_leaf_is_traced():
    for _ in range(3):
        x = _two((3,))
        y = _copy(x)
        for t in (x, y):
            t.register_hook(lambda g: g * 2)
        (y.sin() * y).sum().backward()
        with cagrad.enable("eager"):
            (x.sin() * x).sum().backward()
        _same_grad(x.grad, y.grad)
    assert _counts() == (1, 2, 0, 0)
    assert cagrad.counters["hooks_traced"] >= 1
