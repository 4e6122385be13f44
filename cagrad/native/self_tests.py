"""Self-tests of cagrad's C++ extension, run when it is loaded
(:func:`cagrad.native.load`): each reader is compared with the Python
attributes it replaces, on tensors and nodes made here. Each raises
RuntimeError saying what differs. (``accumulate`` and ``stealable`` are
compared with the Python code they replace by their user,
:mod:`cagrad.autograd.accumulate`.)
"""

from __future__ import annotations

from typing import Any

import torch


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def release(release: Any) -> None:
    """``release`` frees a C++ node's saved tensors as the engine does."""
    with torch.inference_mode(False), torch.enable_grad():
        y = torch.ones(1, requires_grad=True).exp()  # ExpBackward0 saves its result
    release([None, y.grad_fn])
    try:
        y.grad_fn._saved_result
    except RuntimeError:
        return
    raise RuntimeError("release() left ExpBackward0's saved result in place")


def hookless(hookless: Any, counts: Any) -> None:
    """``hookless(nodes)`` is True exactly where ``counts(node, True)`` is
    None for every node: a node with a live hook, none with a removed one."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.ones(2, requires_grad=True)
        plain, hooked = x.exp().grad_fn, x.sin().grad_fn
    handle = hooked.register_prehook(lambda grad_outputs: None)
    cases = [((plain,), True), ((plain, hooked), False), ((), True)]
    for nodes, expected in cases:
        if hookless(nodes) is not expected:
            raise RuntimeError(f"hookless() of {[type(n).__name__ for n in nodes]} is not {expected}")
    handle.remove()  # an empty hook dict stays in the node's list
    if hookless((plain, hooked)) is not (counts(hooked, True) is None):
        raise RuntimeError("hookless() and counts() disagree on a removed hook")


def _metadata_readers(metadata_key: Any, metadata: Any) -> None:
    """The C++ reader sees the same InputMetadata as ``node._input_metadata``."""
    with torch.inference_mode(False), torch.enable_grad():
        a = torch.ones(3, 4, requires_grad=True)
        b = torch.ones(5, dtype=torch.float64, requires_grad=True)
        node = torch.cat([a.flatten(), b.float()]).grad_fn  # CatBackward0: inputs a's view and b's cast
    for x in (a, b):
        y = (x * 2).grad_fn
        key = metadata_key(y, 0)
        sizes: list = []
        if key is None or not metadata(y, 0, key, sizes) or sizes != list(x.shape):
            raise RuntimeError(f"metadata of a {tuple(x.shape)} {x.dtype} input read as {key}, {sizes}")
        other = metadata_key((x.float() if x.dtype == torch.float64 else x.double()).mul(2).grad_fn, 0)
        if other == key or metadata(y, 0, other, sizes) or metadata_key(y, 1) is not None:
            raise RuntimeError("metadata of another dtype or a missing input reads as the same key")
    if metadata_key(node, 0) is None or metadata_key(node, 1) is not None:
        raise RuntimeError("CatBackward0 has one input")


def _tensor_readers(tensor_key: Any, tensor: Any) -> None:
    """The C++ reader sees a tensor's metadata as its Python attributes do."""
    base = torch.zeros(4, 6, dtype=torch.float64)
    param = torch.nn.Parameter(torch.ones(2, 3))
    for x in (base, base[1:, ::2].t(), param, torch.ones(()), param.detach()):
        key = tensor_key(x, type(x))
        values: list = []
        if key is None or not tensor(x, type(x), key, values):
            raise RuntimeError(f"tensor {tuple(x.shape)} {type(x).__name__} not read")
        if values != [*x.shape, *x.stride(), x.storage_offset()]:
            raise RuntimeError(f"tensor {tuple(x.shape)} read as {values}")
        others = (x.float() if x.dtype == torch.float64 else x.double(), x.detach().requires_grad_(not x.requires_grad))
        for other in others:
            if tensor_key(other, type(x)) == key or tensor(other, type(x), key, values):
                raise RuntimeError(f"another dtype or requires_grad reads as {key}")
    if tensor_key(torch.ones(2).to_sparse(), torch.Tensor) is not None or tensor_key(param, torch.Tensor) is not None:
        raise RuntimeError("a sparse tensor or another type has a key")


def counts(counts: Any) -> None:
    """The extension reads a C++ node and a custom Function node as expected."""
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.ones(1, requires_grad=True)
        outs = (leaf.neg(), _Identity.apply(leaf))  # neither saves a tensor
    for out in outs:
        node = out.grad_fn
        if counts(node, True) is not None:
            raise RuntimeError(f"a fresh {node.name()} reports hooks")
        handle = node.register_prehook(lambda *a: None)
        got = counts(node, True)
        handle.remove()
        if got is None or got[3] != 0 or len(got[4]) != 1:
            raise RuntimeError(f"{node.name()} with one Python pre-hook reports {got}")
        if counts(node, True) is not None:  # the dict stays, empty
            raise RuntimeError(f"{node.name()} with an empty hook dict reports hooks")


def metadata(readers: Any) -> None:
    """All of :class:`cagrad.native.MetadataReaders`."""
    _metadata_readers(readers.metadata_key, readers.metadata)
    _tensor_readers(readers.tensor_key, readers.tensor)
    _ints(readers.ints, readers.int_)
    _order(readers.order)


def _ints(ints: Any, int_: Any) -> None:
    """Ints are appended as int64 (2**63 and up read back as the int64 a
    uint64 stores, ``v - 2**64``); anything else appends nothing and reads
    False."""

    def _int64(v: int) -> int:
        return v - 2**64 if v >= 2**63 else v

    values: list = [7]
    for a in ((3, 2**64 - 1, 0), [5], (), torch.Size([2, 4])):
        if not ints(a, len(a), values) or values[1:] != [_int64(v) for v in a]:
            raise RuntimeError(f"ints({a!r}) appended {values[1:]}")
        del values[1:]
    for a, n in (((1, 2), 3), ((1, 2.0), 2), ((1, None), 2), (None, 0), (3, 1), ((1, 2**64), 2)):
        if ints(a, n, values) or values != [7]:
            raise RuntimeError(f"ints({a!r}, {n}) read as ints ({values[1:]})")
    for a in (0, 2**63, -5):
        if not int_(a, values) or values[1:] != [_int64(a)]:
            raise RuntimeError(f"int_({a!r}) appended {values[1:]}")
        del values[1:]
    for a in (None, 1.5, (1,)):
        if int_(a, values) or values != [7]:
            raise RuntimeError(f"int_({a!r}) read as an int")


def _order(order: Any) -> None:
    """The order of sequence numbers is ``_sequence_nr()``'s, and no node
    may be there twice."""
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.ones(2, requires_grad=True)
        a = x.exp()
        b = a.sin()
        c = _Identity.apply(b)
    nodes = (a.grad_fn, b.grad_fn, c.grad_fn)
    seq = [n._sequence_nr() for n in nodes]
    if not seq[0] < seq[1] < seq[2]:
        raise RuntimeError(f"sequence numbers {seq} do not grow with creation")
    if not order(nodes, b"<<") or order(nodes[::-1], b"<<") or order(nodes, b"<=") or not order(nodes[:1], b""):
        raise RuntimeError(f"order() misreads sequence numbers {seq}")
    # two leaves' AccumulateGrad nodes: one sequence number (the largest)
    with torch.inference_mode(False), torch.enable_grad():
        leaves = (x.exp().grad_fn.next_functions[0][0], (x * 2).grad_fn.next_functions[0][0])
        other = torch.ones(1, requires_grad=True).exp().grad_fn.next_functions[0][0]
    tie = (leaves[0], other)
    if tie[0]._sequence_nr() != tie[1]._sequence_nr():
        raise RuntimeError("AccumulateGrad nodes have sequence numbers of their own")
    if not order(tie, b"=") or order(tie, b"<"):
        raise RuntimeError("order() misreads equal sequence numbers")
    if order(leaves, b"=") or order((nodes[0], *tie, tie[0]), b"<=="):
        raise RuntimeError("order() accepts one node twice")


def collect(collect: Any, readers: Any) -> None:
    """``collect(nodes, program, values, tensors)`` agrees with
    :func:`cagrad.native.guard_program.run` (the Python of each instruction,
    through the single readers ``readers``) on a program that holds, and on
    each instruction changed so that it fails, and on a leaf with a hook."""
    from . import guard_program as gp

    with torch.inference_mode(False), torch.enable_grad():
        # fixed values: a self-test must not draw from the global generator
        # (it runs inside the user's first backward, whose RNG stream eager leaves alone)
        x = torch.linspace(-1.0, 1.0, 96).reshape(2, 3, 4, 4).requires_grad_()
        w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))
        bn = torch.nn.functional.batch_norm(x, None, None, w, None, training=True).grad_fn
        pool = torch.nn.functional.max_pool2d(x, 2).grad_fn
        gelu = torch.nn.functional.gelu(x, approximate="tanh").grad_fn
        mean = x.mean().grad_fn
    leaf = bn.next_functions[0][0]
    nodes = (bn, pool, gelu, mean, leaf)
    tensor_type, param_type = type(x), type(w)
    program = [
        (gp.METADATA, 0, 0, readers.metadata_key(bn, 0)),
        (gp.TENSOR, 0, "_saved_input", tensor_type, readers.tensor_key(x, tensor_type)),
        (gp.TENSOR, 0, "_saved_weight", param_type, readers.tensor_key(w, param_type)),
        (gp.NONE, 0, "_saved_running_mean"),
        (gp.IS, 0, "_saved_training", True),
        (gp.FLOAT, 0, "_saved_eps", 1e-5),
        (gp.INT_SEQ, 1, "_saved_kernel_size", (2, 2)),
        (gp.IS, 1, "_saved_ceil_mode", False),
        (gp.EQ, 2, "_saved_approximate", "tanh"),
        (gp.INT, 3, "_saved_self_sym_numel"),
        (gp.INTS, 3, "_saved_self_sym_sizes", 4),
        (gp.LEAF, 4, tensor_type, readers.tensor_key(x, tensor_type)),
    ]
    wrong = {
        gp.METADATA: lambda op: (*op[:3], op[3] ^ 1),
        gp.TENSOR: lambda op: (*op[:4], op[4] ^ 1),
        gp.NONE: lambda op: (op[0], op[1], "_saved_input"),
        gp.IS: lambda op: (*op[:3], not op[3]),
        gp.FLOAT: lambda op: (*op[:3], -op[3]),
        gp.INT_SEQ: lambda op: (*op[:3], [2, 2]),
        gp.EQ: lambda op: (*op[:3], "none"),
        gp.INT: lambda op: (op[0], op[1], "_saved_self_sym_sizes"),
        gp.INTS: lambda op: (*op[:3], 3),
        gp.LEAF: lambda op: (op[0], op[1], param_type, op[3]),
    }
    variants = [program] + [program[:k] + [wrong[op[0]](op)] + program[k + 1 :] for k, op in enumerate(program)]
    with torch.inference_mode(False), torch.enable_grad():
        hooked = torch.ones(2, requires_grad=True)
        hooked.register_hook(lambda g: g)
        hooked_leaf = hooked.exp().grad_fn.next_functions[0][0]
    cases = [(nodes, tuple(p)) for p in variants]
    cases.append(((hooked_leaf,), ((gp.LEAF, 0, tensor_type, readers.tensor_key(hooked, tensor_type)),)))
    for k, (ns, prog) in enumerate(cases):
        got_v: list = []
        got_t: list = []
        want_v: list = []
        want_t: list = []
        got = collect(ns, prog, got_v, got_t)
        want = gp.run(ns, prog, want_v, want_t, readers)
        if got is not want or (want and (got_v != want_v or [id(t) for t in got_t] != [id(t) for t in want_t])):
            raise RuntimeError(f"collect() of program {k} gives {got}, {got_v} where Python gives {want}, {want_v}")
        if (k == 0) is not want:
            raise RuntimeError(f"program {k} {'fails' if k == 0 else 'holds'} in Python")


def walk(walk: Any) -> None:
    """``walk(starts, steps, count)`` agrees with
    :func:`cagrad.native.guard_program.walk` (``next_functions``) on a graph
    with an absent edge and a node reached twice, and on each step changed
    so that the graph differs."""
    from . import guard_program as gp

    with torch.inference_mode(False), torch.enable_grad():
        x = torch.linspace(-1.0, 1.0, 3).requires_grad_()
        s = x.sin()
        loss = (s * s.detach() + s).sum()
    root = loss.grad_fn  # SumBackward0 <- AddBackward0 <- (MulBackward0, SinBackward0)
    add = root.next_functions[0][0]
    mul, sin = add.next_functions[0][0], add.next_functions[1][0]
    acc = sin.next_functions[0][0]
    if mul.next_functions[0][0] is not sin or mul.next_functions[1][0] is not None:
        raise RuntimeError("walk()'s self-test graph is not the one it expects")
    steps = [
        (0, ((1, 0, type(add)),)),
        (1, ((2, 0, type(mul)), (3, 0, type(sin)))),
        (2, ((3, 0), ())),
        (3, ((4, 0, type(acc)),)),
        (4, ()),
    ]
    wrong = [
        (0, ((1, 1, type(add)),)),
        (1, ((2, 0, type(sin)), (3, 0, type(sin)))),
        (2, ((2, 0), ())),
        (3, ((4, 0, type(acc)), ())),
        (4, ((), )),
    ]
    cases = [tuple(steps)] + [tuple(steps[:k] + [w] + steps[k + 1 :]) for k, w in enumerate(wrong)]
    for k, program in enumerate(cases):
        got = walk((root,), program, 5)
        want = gp.walk((root,), program, 5)
        if (got is None) != (want is None) or (want is not None and any(a is not b for a, b in zip(got, want))):
            raise RuntimeError(f"walk() of steps {k} gives {got} where next_functions give {want}")
        if (k == 0) is (want is None):
            raise RuntimeError(f"steps {k} {'fail' if k == 0 else 'hold'} through next_functions")
    if walk((root,), tuple(steps), 5)[4] is not acc:
        raise RuntimeError("walk() returns another object for AccumulateGrad")


def reclaim(reclaim: Any) -> None:
    """Dead aliases are left alone; a live one is moved to new memory with its
    values; one with a view of it outside the lists stops the reclaim."""
    owner = torch.arange(6.0)
    handed = [owner.detach()]
    if not reclaim(handed, [owner]) or handed[0].data_ptr() != owner.data_ptr():
        raise RuntimeError("reclaim() moved a dead alias")
    kept = handed[0]
    if not reclaim(handed, [owner]) or kept.data_ptr() == owner.data_ptr() or not torch.equal(kept, owner):
        raise RuntimeError("reclaim() did not move a live alias to new memory with its values")
    handed = [owner.detach()]
    view = handed[0][2:]
    if reclaim(handed, [owner]) or view.data_ptr() != owner.data_ptr() + 8:
        raise RuntimeError("reclaim() moved an alias that a view shares")


def sole(sole: Any) -> None:
    """As eager's ``AccumulateGrad`` counts holders (its use count): a
    tensor only the list holds is sole, a view of other memory too, and so
    is a tensor whose memory a detached alias shares; one with another
    Python reference, or a view of it (which holds it), is not."""
    if not sole([torch.arange(6.0)]):
        raise RuntimeError("sole() refused a tensor only the list holds")
    kept = torch.arange(6.0)
    if sole([kept]):
        raise RuntimeError("sole() accepted a tensor a local variable holds")
    if sole([1.0]):
        raise RuntimeError("sole() accepted an item that is not a tensor")
    base = torch.arange(6.0)
    if not sole([base[:2]]) or not sole([torch.arange(6.0).reshape(2, 3).t()]):
        raise RuntimeError("sole() refused a view only the list holds")
    alias = kept.detach()
    box = [kept]
    del kept
    if not sole(box):
        raise RuntimeError("sole() refused a tensor whose memory only a detached alias shares")
    view = box[0][1:]
    if sole(box):
        raise RuntimeError("sole() accepted a tensor a view of it holds")
    del alias, view
