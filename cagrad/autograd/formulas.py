"""Python backward formulas for nodes that keep sizes as plain ints.

Calling a C++ node during a trace bakes the sizes it saved
(``SumBackward0.self_sym_sizes``, ...) into the graph as constants. With
dynamic sizes the graph must use the lifted ``SymInt``\\ s instead, so the
nodes below get a Python formula that does what the C++ ``apply`` does, op
for op (the formulas of tools/autograd/derivatives.yaml and
torch/csrc/autograd/FunctionsManual.cpp: ``sum_backward``,
``mean_backward``, ``unsqueeze_to``, ``mm_mat1_backward``, ...), with the
node's ``SymInt`` fields passed in. Nodes not listed keep their sizes static
(part of the size check), which cagrad logs.

A formula receives the node, its incoming gradients, ``sym(attr)`` (the
attribute with its sizes as SymInts) and ``edge_metadata(i)`` (shape, dtype,
device of the gradient edge ``i`` expects, shapes symbolic), and returns one
gradient (or None) per edge, before ``validate_outputs``. Saved tensors are
read as the node would read them (``node._saved_x``), which during a trace
yields their fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .validate import sum_to

aten = torch.ops.aten

Formula = Callable[[Any, list, Callable[[str], Any], Callable[[int], Any]], list]
FORMULAS: dict[str, Formula] = {}
_INT64_MAX = (1 << 63) - 1


class NonStridedGradient(Exception):
    """The node returns a gradient that is not strided (sparse): it cannot be
    traced, and runs as it is instead (see :mod:`cagrad.capture.compiler`)."""


def formula(*names: str) -> Callable[[Formula], Formula]:
    def register(fn: Formula) -> Formula:
        for name in names:
            FORMULAS[name] = fn
        return fn

    return register


def _signed(d: int) -> int:
    # some bindings hand int64 dims out as uint64 (see cagrad.keys.cache_key)
    return d - (1 << 64) if d >= (1 << 63) else d


def _wrap(d: int, ndim: int) -> int:
    # at::maybe_wrap_dim
    d = _signed(d)
    n = max(ndim, 1)
    return d + n if d < 0 else d


def _valid(edges: Sequence[Any]) -> list[bool]:
    return [fn is not None for fn, _ in edges]


def _only_if(edges: Sequence[Any], i: int, make: Callable[[], Any]) -> Any:
    return make() if edges[i][0] is not None else None


# -- reductions ---------------------------------------------------------------
def _unsqueeze_multiple(g: torch.Tensor, dims: Sequence[int], n_dims: int) -> torch.Tensor:
    if len(dims) == 1:
        return g.unsqueeze(_signed(dims[0]))
    wanted = {_wrap(d, n_dims) for d in dims}
    for i in range(n_dims):
        if i in wanted:
            g = g.unsqueeze(i)
    return g


def _sum_backward(g: torch.Tensor, sizes: Sequence[Any], dims: Any, keepdim: bool) -> torch.Tensor:
    if not keepdim and len(sizes) > 0 and dims:
        g = _unsqueeze_multiple(g, dims, len(sizes))
    return g.expand(sizes)


@formula("SumBackward0")
def _sum0(node, grads, sym, md):
    return [grads[0].expand(sym("self_sym_sizes"))]


@formula("SumBackward1")
def _sum1(node, grads, sym, md):
    return [_sum_backward(grads[0], sym("self_sym_sizes"), node._saved_dim, node._saved_keepdim)]


@formula("MeanBackward0")
def _mean0(node, grads, sym, md):
    return [aten.div.Scalar(grads[0].expand(sym("self_sym_sizes")), sym("self_sym_numel"))]


@formula("MeanBackward1")
def _mean1(node, grads, sym, md):
    sizes = sym("self_sym_sizes")
    dims = node._saved_dim
    if not dims:
        n = sym("self_sym_numel")
    else:
        n = 1
        if len(sizes) > 0:
            for d in dims:
                n = n * sizes[_wrap(d, len(sizes))]
    g = _sum_backward(grads[0], sizes, dims, node._saved_keepdim)
    return [aten.div.Scalar(g, n)]


@formula("ExpandBackward0")
def _expand(node, grads, sym, md):
    return [sum_to(grads[0], sym("self_sym_sizes"))]


# -- prod: traced always, symbolic or not --------------------------------------
# On real tensors the C++ ProdBackward nodes pick a formula from the data
# (no zero in the input: grad * result / input; otherwise a division-free
# product of the other elements), but on a fake or other subclass-like input
# they always take the division-free one, which for a reduced size of 1 is the
# incoming gradient itself: a create_graph backward then returned a gradient
# with no graph (eager's has one) and different second-order gradients. The
# formulas below compute both and select by the data, so the traced graph
# does what eager does for every input.
ALWAYS: set[str] = {"ProdBackward0", "ProdBackward1"}


def _others_product(grad: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``grad`` times the product of the other elements along ``dim`` (keepdim
    layout), without dividing: exclusive products from both ends."""
    if x.numel() == 0:
        return grad.expand_as(x)
    n = x.shape[dim]
    if n == 1:
        return grad
    one = torch.ones_like(x.narrow(dim, 0, 1))
    before = torch.cat([one, x.narrow(dim, 0, n - 1)], dim).cumprod(dim)
    after = torch.cat([one, x.narrow(dim, 1, n - 1).flip(dim)], dim).cumprod(dim).flip(dim)
    return grad * (before * after).conj()


def _prod_backward(grad: torch.Tensor, x: torch.Tensor, result: torch.Tensor, safe: torch.Tensor) -> torch.Tensor:
    is_zero = x == 0
    # where a zero makes the quotient unused, its input is masked so that a
    # second backward through the unused quotient gives 0, not 0 * inf
    quotient = grad * (result / torch.where(is_zero, torch.ones_like(x), x)).conj()
    # the quotient first: where there is no zero the result takes its layout,
    # as eager's does
    return torch.where(is_zero.any().logical_not(), quotient, safe)


#: nodes whose formula branches on grad mode (see :func:`runs_as_is`)
GRAD_MODE_FORMULAS = frozenset(
    {"SiluBackward0", "MishBackward0", "LogitBackward0", "NativeGroupNormBackward0", "NativeDropoutBackward0"}
)


def runs_as_is(node: Any, name: str) -> bool:
    """Whether a node of ``name`` must run as it is (opaque) in a
    ``create_graph`` backward, because no traced graph can do what eager does.

    ProdBackward0/1 whose reduced extent is 1 (one element, or a ``dim`` of
    size 1): without a zero in the input eager's gradient is ``grad * result /
    input`` (differentiable), with one it is ``grad`` itself (no graph of its
    own when ``grad`` has none), so whether the gradient requires grad depends
    on the data.

    (A non-contiguous saved input also runs the node itself, with or without
    ``create_graph``: eager's quotient takes the input's layout, its zero-safe
    path a contiguous one; see ``Collector._traceable``.)

    CumprodBackward0: on a fake input the C++ node takes a path whose second
    derivative is NaN where the input holds zeros (eager's, chosen by the
    data, is finite), so under ``create_graph`` it runs on the real tensors.

    :data:`GRAD_MODE_FORMULAS`: the formula asks ``GradMode::is_enabled()``
    (``tools/autograd/derivatives.yaml``: ``silu``, ``mish``, ``logit``,
    ``native_group_norm``, ``native_dropout``) and with grad mode on takes
    an ``infinitely_differentiable_*`` composite; the trace runs under
    ``no_grad`` and would record the other branch, whose own derivative is
    not implemented (the second backward raised where eager's does not).
    """
    if name == "CumprodBackward0" or name in GRAD_MODE_FORMULAS:
        return True
    if name not in ALWAYS:
        return False
    fn, nr = node.next_functions[0]
    if fn is None:
        return False
    shape = list(fn._input_metadata[nr].shape)
    if not shape:
        return False  # 0-dim: eager returns grad for any data
    if name == "ProdBackward0":
        n = 1
        for s in shape:
            n *= s
        return n == 1
    return shape[_wrap(node._saved_dim, len(shape))] == 1


@formula("ProdBackward0")
def _prod0(node, grads, sym, md):
    x = node._saved_self
    grad = grads[0]
    if x.dim() == 0:
        return [grad]
    safe = _others_product(grad, x.contiguous().view(-1), 0).view_as(x)
    return [_prod_backward(grad, x, node._saved_result, safe)]


@formula("ProdBackward1")
def _prod1(node, grads, sym, md):
    x = node._saved_self
    grad = grads[0]
    if x.dim() == 0:
        return [grad]
    dim = _wrap(node._saved_dim, x.dim())
    result = node._saved_result
    if not node._saved_keepdim:
        grad = grad.unsqueeze(dim)
        result = result.unsqueeze(dim)
    return [_prod_backward(grad, x, result, _others_product(grad, x, dim))]


# -- views ----------------------------------------------------------------------
@formula("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0")
def _reshape(node, grads, sym, md):
    return [grads[0].reshape(sym("self_sym_sizes"))]


@formula("SelectBackward0")
def _select(node, grads, sym, md):
    return [
        aten.select_backward.default(
            grads[0], sym("self_sym_sizes"), _signed(node._saved_dim), sym("index")
        )
    ]


@formula("SliceBackward0")
def _slice(node, grads, sym, md):
    start = sym("start")
    end = sym("end")
    return [
        aten.slice_backward.default(
            grads[0],
            sym("self_sym_sizes"),
            _signed(node._saved_dim),
            0 if start is None else start,
            _INT64_MAX if end is None else end,
            sym("step"),
        )
    ]


@formula("DiagonalBackward0")
def _diagonal(node, grads, sym, md):
    return [
        aten.diagonal_backward.default(
            grads[0],
            sym("self_sym_sizes"),
            _signed(node._saved_offset),
            _signed(node._saved_dim1),
            _signed(node._saved_dim2),
        )
    ]


def _unsqueeze_to_all(g: torch.Tensor, sizes: Sequence[Any]) -> torch.Tensor:
    for d, s in enumerate(sizes):
        if s == 1:
            g = g.unsqueeze(d)
    return g


def _unsqueeze_to_dim(g: torch.Tensor, dim: int, sizes: Sequence[Any]) -> torch.Tensor:
    d = _wrap(dim, len(sizes))
    if len(sizes) > 0 and sizes[d] == 1:
        return g.unsqueeze(d)
    return g


def _unsqueeze_to_dims(g: torch.Tensor, dims: Sequence[int], sizes: Sequence[Any]) -> torch.Tensor:
    wanted = {_wrap(d, len(sizes)) for d in dims}
    for d, s in enumerate(sizes):
        if d in wanted and s == 1:
            g = g.unsqueeze(d)
    return g


@formula(
    "SqueezeBackward0",
    "SqueezeBackward1",
    "SqueezeBackward2",
    "SqueezeBackward3",
    "SqueezeBackward4",
    "SqueezeBackward5",
)
def _squeeze(node, grads, sym, md):
    sizes = sym("self_sym_sizes")
    dim = getattr(node, "_saved_dim", None)
    if dim is None:
        return [_unsqueeze_to_all(grads[0], sizes)]
    if isinstance(dim, (tuple, list)):
        return [_unsqueeze_to_dims(grads[0], dim, sizes)]
    return [_unsqueeze_to_dim(grads[0], dim, sizes)]


@formula("IndexSelectBackward0")
def _index_select(node, grads, sym, md):
    g = grads[0]
    zeros = g.new_zeros(sym("self_sym_sizes"))
    return [zeros.index_add(_signed(node._saved_dim), node._saved_index, g)]


# -- split / cat ------------------------------------------------------------------
def _split_with_sizes_backward(
    grads: Sequence[Any], split_sizes: Sequence[Any], dim: int, sizes: Sequence[Any], dtype: Any, device: Any
) -> torch.Tensor:
    dim = _wrap(dim, len(sizes))
    parts = []
    for g, length in zip(grads, split_sizes):
        if g is None:
            shape = list(sizes)
            shape[dim] = length
            g = torch.zeros(shape, dtype=dtype, device=device)
        parts.append(g)
    return torch.cat(parts, dim)


@formula("SplitBackward0")
def _split(node, grads, sym, md):
    sizes = sym("self_sym_sizes")
    split_size = sym("split_size")
    dim = _signed(node._saved_dim)
    n = len(grads)
    split_sizes = [split_size] * n
    split_sizes[-1] = split_size - (split_size * n - sizes[_wrap(dim, len(sizes))])
    if node.next_functions[0][0] is None:
        return [None]
    _, dtype, device = md(0)
    return [_split_with_sizes_backward(grads, split_sizes, dim, sizes, dtype, device)]


@formula("SplitWithSizesBackward0")
def _split_with_sizes(node, grads, sym, md):
    if node.next_functions[0][0] is None:
        return [None]
    _, dtype, device = md(0)
    return [
        _split_with_sizes_backward(
            grads, sym("split_sizes"), _signed(node._saved_dim), sym("self_sym_sizes"), dtype, device
        )
    ]


@formula("CatBackward0")
def _cat(node, grads, sym, md):
    # cat_tensors_backward, with each input's size along dim read from the
    # edge's metadata (the node keeps them hidden); at most one input has no
    # edge (cagrad.autograd.node_schema, policy split_sizes), and its size is what the
    # others leave of the total. Like the C++ node it returns a slice for
    # every input, that one included (validate_outputs skips its edge, a
    # node post-hook sees it)
    g = grads[0]
    edges = node.next_functions
    ndim = g.dim()
    dim = _wrap(node._saved_dim, ndim)
    shapes = [None if fn is None else md(i)[0] for i, (fn, _) in enumerate(edges)]
    lengths = []
    for shape in shapes:
        if shape is None:
            lengths.append(None)
        elif len(shape) == 1 and ndim != 1 and shape[0] == 0:
            lengths.append(0)  # a legacy empty input, skipped by cat
        else:
            lengths.append(shape[dim])
    missing = [i for i, n in enumerate(lengths) if n is None]
    if missing:
        lengths[missing[0]] = g.shape[dim] - sum(n for n in lengths if n is not None)
    outs: list[Any] = []
    offset = 0
    for shape, n in zip(shapes, lengths):
        if shape is not None and len(shape) == 1 and ndim != 1 and shape[0] == 0:
            outs.append(torch.zeros((0,), dtype=g.dtype, device=g.device))
            continue
        outs.append(g.narrow(dim, offset, n))
        offset = offset + n
    return outs


# -- matmul -----------------------------------------------------------------------
def _maybe_multiply(t: torch.Tensor, s: Any) -> torch.Tensor:
    return t if s == 1 else t * s


def _mm_mat1_backward(grad, mat2, sizes, strides, alpha):
    if strides[0] == 1 and strides[1] == sizes[0]:
        return _maybe_multiply(mat2.conj().mm(grad.t()).t(), alpha)
    return _maybe_multiply(grad.mm(mat2.t().conj()), alpha)


def _mm_mat2_backward(grad, mat1, sizes, strides, alpha):
    if strides[0] == 1 and strides[1] == sizes[0]:
        return _maybe_multiply(grad.t().mm(mat1.conj()).t(), alpha)
    return _maybe_multiply(mat1.t().conj().mm(grad), alpha)


@formula("MmBackward0")
def _mm(node, grads, sym, md):
    g = grads[0]
    edges = node.next_functions
    return [
        _only_if(edges, 0, lambda: _mm_mat1_backward(
            g, node._saved_mat2, sym("self_sym_sizes"), sym("self_sym_strides"), 1)),
        _only_if(edges, 1, lambda: _mm_mat2_backward(
            g, node._saved_self, sym("mat2_sym_sizes"), sym("mat2_sym_strides"), 1)),
    ]


@formula("AddmmBackward0")
def _addmm(node, grads, sym, md):
    g = grads[0]
    edges = node.next_functions
    alpha, beta = node._saved_alpha, node._saved_beta
    return [
        _only_if(edges, 0, lambda: _maybe_multiply(g, beta)),
        _only_if(edges, 1, lambda: _mm_mat1_backward(
            g, node._saved_mat2, sym("mat1_sym_sizes"), sym("mat1_sym_strides"), alpha)),
        _only_if(edges, 2, lambda: _mm_mat2_backward(
            g, node._saved_mat1, sym("mat2_sym_sizes"), sym("mat2_sym_strides"), alpha)),
    ]


# -- normalization and embedding -----------------------------------------------------
@formula("NativeLayerNormBackward0")
def _layer_norm(node, grads, sym, md):
    mask = _valid(node.next_functions)
    out = aten.native_layer_norm_backward.default(
        grads[0],
        node._saved_input,
        sym("normalized_shape"),
        node._saved_result1,
        node._saved_result2,
        node._saved_weight,
        node._saved_bias,
        mask,
    )
    return [o if m else None for o, m in zip(out, mask)]


@formula("EmbeddingBackward0")
def _embedding(node, grads, sym, md):
    if node._saved_sparse:
        raise NonStridedGradient("EmbeddingBackward0 with sparse=True returns a sparse gradient")
    return [
        aten.embedding_backward.default(
            grads[0],
            node._saved_indices,
            sym("weight_sym_argsize_0"),
            sym("padding_idx"),
            node._saved_scale_grad_by_freq,
            node._saved_sparse,
        )
    ]


def apply(name: str, node: Any, grads: list, sym: Callable[[str], Any], md: Callable[[int], Any]) -> list:
    """Runs the formula of node type ``name``; undefined in, undefined out."""
    if all(g is None for g in grads):
        return [None] * len(node.next_functions)
    return FORMULAS[name](node, grads, sym, md)
