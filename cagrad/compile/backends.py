"""compiler_fn: from a backend name or callable to ``GraphModule -> callable``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import torch
import torch.fx

from ..counters import counters
from ..errors import Unsupported

CompilerFn = Union[str, Callable[[torch.fx.GraphModule], Callable[..., Any]]]

# (backend, aten op) pairs whose compiled result is known to be wrong; a graph
# holding one runs in eager instead. Found by the differential tests:
# inductor's code around aten._cudnn_rnn_backward (a list of weight gradients
# that are views of one buffer) returns a wrong weight_hh_l1 gradient for a
# 2-layer nn.LSTM on CUDA (torch 2.11; tests/test_models_cuda.py, lstm), while
# eager and aot_eager are exact.
_DENYLIST: dict[str, tuple[Any, ...]] = {
    "inductor": (
        torch.ops.aten._cudnn_rnn_backward.default,
        torch.ops.aten.miopen_rnn_backward.default,
    ),
}


def check_graph(compiler_fn: CompilerFn, gm: torch.fx.GraphModule) -> None:
    """Raises Unsupported if ``gm`` holds an op ``compiler_fn`` gets wrong.

    Raises:
        cagrad.Unsupported: reason ``backend_denylist:<backend>:<op>``;
            ``empty_broadcast:inductor`` for an inductor graph holding an
            expanded empty tensor (:func:`_empty_broadcast`);
            ``one_element_scatter_add:inductor`` for one that adds an
            expanded tensor into a one-element CUDA tensor
            (:func:`_one_element_broadcast_scatter`).
    """
    if compiler_fn == "inductor":
        empty = _empty_broadcast(gm)
        if empty is not None:
            raise Unsupported(
                "empty_broadcast:inductor",
                f"{empty} has no elements and every stride 0; inductor's kernels may load its "
                "element 0 from its null address where eager reads nothing",
            )
        scatter = _one_element_broadcast_scatter(gm)
        if scatter is not None:
            raise Unsupported(
                "one_element_scatter_add:inductor",
                f"{scatter}: inductor's CUDA kernel for it adds once per lane of a block, "
                "not once per element (see cagrad/compile/backends.py)",
            )
    denied = _DENYLIST.get(compiler_fn) if isinstance(compiler_fn, str) else None
    if not denied:
        return
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in denied:
            op = node.target.name()
            raise Unsupported(
                f"backend_denylist:{compiler_fn}:{op.split('::')[-1]}",
                f"{compiler_fn} is known to compile {op} wrongly (see cagrad/compile/backends.py)",
            )


def _empty_broadcast(gm: torch.fx.GraphModule) -> str | None:
    """Names a value of ``gm`` (an input it reads or a result) that is a
    tensor with no elements and every stride 0 (an ``expand``ed empty
    tensor), or None. Sizes 0 and 1 are never symbolic in a capture, so such
    a value is empty on every call of the graph.

    Why: inductor (torch 2.11, H100) compiled the gradient of an empty slice
    ``x[..., 0:0:2]``, expanded with every stride 0 and read by a later
    graph segment, into a kernel that loads its element 0 unmasked (with
    every stride 0 the index does not depend on the loop) and masks the
    value after. Torch gives every empty tensor a null data pointer, so the
    load was an illegal memory access (a fuzz campaign's neighbour program,
    ``slice`` end 1 -> 0); eager reads nothing. An empty tensor with a
    nonzero stride (cuDNN batch norm's empty reserve) is indexed by the loop
    and its loads are masked."""
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "call_function" else None
        if (
            isinstance(val, torch.Tensor) and val.layout == torch.strided
            and any(type(n) is int and n == 0 for n in val.shape)
            and all(type(s) is int and s == 0 for s in val.stride())
        ):
            return f"{node.name} (shape {list(val.shape)}, strides {list(val.stride())})"
    return None


# ops that add their source into their result at indices it reads (inductor
# lowers them to atomic adds), with where the source is among the arguments
_SCATTER_ADDS = {
    torch.ops.aten.index_add.default: 3,
    torch.ops.aten.scatter_add.default: 3,
    torch.ops.aten.scatter_reduce.two: 3,
    torch.ops.aten.index_reduce.default: 3,
    torch.ops.aten.index_put.default: 2,
    torch.ops.aten._unsafe_index_put.default: 2,
}


def _one_element_broadcast_scatter(gm: torch.fx.GraphModule) -> str | None:
    """Names a node of ``gm`` that adds a source with every stride 0 and
    more than one element into a one-element CUDA tensor (``index_add`` and
    its kin, :data:`_SCATTER_ADDS`; ``index_put`` only with
    ``accumulate=True``), or None. Size 1 is never symbolic in a capture, so
    the result has one element on every call; a source whose element count
    is a symbol counts as more than one.

    Why: inductor (torch 2.11, H100) compiles
    ``zeros(1).index_add(0, index, g.expand(n))`` (the backward of
    ``index_select`` on a one-element leaf) into one Triton kernel whose
    store index and source index do not depend on the loop; its
    ``tl.atomic_add`` then has no mask, and every lane of the block adds: 4
    for n = 3, 8 for n = 5, 128 for n = 70, where eager gives n. A dense
    source, or a result of two elements, compiles right; CPU inductor
    (torch 2.13) too. Found by a CUDA fuzz campaign (seed 41); in
    ``fuzz/known_issues.toml`` as ``inductor-cuda-index-add-one-element-unmasked-atomic``."""
    for node in gm.graph.nodes:
        source_at = _SCATTER_ADDS.get(node.target) if node.op == "call_function" else None
        if source_at is None or len(node.args) <= source_at:
            continue
        if node.target in (torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default):
            accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
            if accumulate is not True:
                continue
        val, src = node.meta.get("val"), node.args[source_at]
        src_val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if not (isinstance(val, torch.Tensor) and isinstance(src_val, torch.Tensor)):
            continue
        if val.device.type != "cuda" or val.layout != torch.strided or src_val.layout != torch.strided:
            continue
        if _static_numel(val) == 1 and _static_numel(src_val) != 1 and all(
            type(s) is int and s == 0 for s in src_val.stride()
        ):
            return f"{node.name} ({node.target.name()} of an expanded {list(src_val.shape)} into {list(val.shape)})"
    return None


def _static_numel(t: torch.Tensor) -> int | None:
    """The element count, or None where a size is a symbol."""
    n = 1
    for d in t.shape:
        if type(d) is not int:
            return None
        n *= d
    return n


def resolve(compiler_fn: CompilerFn) -> Callable[..., Callable[..., Any]]:
    """Turns ``compiler_fn`` into ``compile(graph_module, symbolic,
    static_first=False) -> callable`` (``static_first``: see
    :func:`cagrad.compile.direct_compile.compile_graph`; whole-graph backwards).

    A string names a ``torch.compile`` backend (``"eager"``, ``"aot_eager"``,
    ``"inductor"``, or any registered one): the backend compiles the graph
    directly, with the trace's fake values as example inputs and no Dynamo
    (:mod:`cagrad.compile.direct_compile`): a graph traced with dynamic sizes is
    compiled for any value of them that its check accepts, a static one for
    its sizes (a graph with a 0-dim CPU tensor beside CUDA tensors is called
    through :class:`_WithoutAliasCheck`). Compile under the grad mode the
    graph runs in. A segment of a ``create_graph=True`` backward that reads
    an opaque call's result goes through ``torch.compile(gm, backend=name,
    dynamic=symbolic)`` instead, whose guards cover that result's
    ``requires_grad``. ``symbolic`` is kept for callables that want it. A
    callable gets the graph module alone.

    Raises:
        TypeError: if ``compiler_fn`` is neither.
        ValueError: if the backend name is not registered with torch.compile.
    """
    if isinstance(compiler_fn, str):
        resolved = _resolved.get(compiler_fn)
        if resolved is None:
            resolved = _resolved[compiler_fn] = _resolve_name(compiler_fn)
        return resolved
    if callable(compiler_fn):
        user_fn = compiler_fn
        return lambda gm, symbolic, static_first=False: user_fn(gm)
    raise TypeError(
        "cagrad.enable: compiler_fn must be a torch.compile backend name or a "
        f"callable GraphModule -> callable, got {type(compiler_fn).__name__}"
    )


_resolved: dict[str, Callable[..., Callable[..., Any]]] = {}
"""Backend names resolved so far (every ``cagrad.enable`` resolves its
backend; a name is looked up in torch's registry once)."""


def _resolve_name(compiler_fn: str) -> Callable[..., Callable[..., Any]]:
    from torch._dynamo.backends.registry import list_backends

    known = set(list_backends(exclude_tags=())) | {"eager", "aot_eager", "inductor"}
    if compiler_fn not in known:
        raise ValueError(
            f"cagrad: unknown torch.compile backend {compiler_fn!r}; "
            f"registered: {sorted(known)}"
        )
    from torch._dynamo.backends.registry import lookup_backend

    from . import direct_compile

    backend = lookup_backend(compiler_fn)

    def compile_with_backend(gm: torch.fx.GraphModule, symbolic: bool, static_first: bool = False) -> Callable[..., Any]:
        compiled = direct_compile.compile_graph(backend, gm, compiler_fn, static_first)
        counters.bump("backend_compiles")
        if compiled is None:
            counters.bump("dynamo_compiles")
            compiled = torch.compile(gm, backend=compiler_fn, dynamic=symbolic)
        return _WithoutAliasCheck(compiled) if _scalar_beside_cuda(gm) else compiled

    return compile_with_backend


def _scalar_beside_cuda(gm: torch.fx.GraphModule) -> bool:
    """The graph reads a 0-dim CPU tensor (a lifted scalar) and a CUDA tensor
    from its inputs (the fake values of its ``inputs[i]`` nodes)."""
    cpu_scalar = cuda = False
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "call_function" else None
        if isinstance(val, torch.Tensor) and node.args and getattr(node.args[0], "name", None) == "inputs":
            cpu_scalar |= val.device.type == "cpu" and val.dim() == 0
            cuda |= val.device.type == "cuda"
    return cpu_scalar and cuda


class _WithoutAliasCheck:
    """Calls a compiled graph with ``torch._functorch.config.
    check_custom_op_aliasing`` off.

    Why: with that check on (the default on torch 2.11), AOTAutograd runs a
    graph's first call under a dispatch mode that checks custom ops for
    aliasing, and in it the ``.item()`` that inductor's CUDA code calls on a
    0-dim CPU tensor input fails ("_local_scalar_dense() Expected a value of
    type 'Tensor' ... found type 'float'"): every backward with a lifted
    scalar (``x * 0.25``) fell back (``compile_failed``), and torch's own
    compiled autograd raises the same error. The check is a diagnostic for
    custom ops, and AOTAutograd keeps it pending until a call runs with it on,
    so it stays off on every call (about 3 us each), and only for graphs that
    need it (:func:`_scalar_beside_cuda`). Measured on the device: H200,
    torch 2.11.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        import torch._functorch.config as functorch_config

        if not hasattr(functorch_config, "check_custom_op_aliasing"):
            return self.fn(*args)
        before = functorch_config.check_custom_op_aliasing
        functorch_config.check_custom_op_aliasing = False
        try:
            return self.fn(*args)
        finally:
            functorch_config.check_custom_op_aliasing = before
