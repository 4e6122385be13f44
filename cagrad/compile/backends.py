"""compiler_fn: from a backend name or callable to ``GraphModule -> callable``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import torch
import torch.fx

from .. import logs
from ..counters import counters
from ..errors import Unsupported
from ..preserve import preserved
from . import marked_sizes

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
            ``one_element_scatter_add:inductor`` for one that adds into a
            one-element CUDA tensor at indices (:func:`_one_element_scatter`).
    """
    if compiler_fn == "inductor":
        empty = _empty_broadcast(gm)
        if empty is not None:
            raise Unsupported(
                "empty_broadcast:inductor",
                f"{empty} has no elements and every stride 0; inductor's kernels may load its "
                "element 0 from its null address where eager reads nothing",
            )
        scatter = _one_element_scatter(gm)
        if scatter is not None:
            raise Unsupported(
                "one_element_scatter_add:inductor",
                f"{scatter}: inductor's CUDA kernel for such an add may add once per lane of "
                "a block, not once per element (see cagrad/compile/backends.py)",
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


# ops that add a source into their result at indices they read (inductor
# lowers them to atomic adds)
_PUTS = frozenset({
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._unsafe_index_put.default,
    torch.ops.aten._index_put_impl_.default,
})  # these add only with accumulate=True (their fourth argument)
_SCATTER_ADDS = _PUTS | frozenset({
    torch.ops.aten.index_add.default,
    torch.ops.aten.index_add_.default,
    torch.ops.aten.scatter_add.default,
    torch.ops.aten.scatter_add_.default,
    torch.ops.aten.scatter_reduce.two,
    torch.ops.aten.scatter_reduce_.two,
    torch.ops.aten.index_reduce.default,
    torch.ops.aten.index_reduce_.default,
    torch.ops.aten.embedding_dense_backward.default,
})


def _one_element_scatter(gm: torch.fx.GraphModule) -> str | None:
    """Names a node of ``gm`` that adds into a one-element CUDA tensor at
    indices it reads (``index_add`` and its kin, :data:`_SCATTER_ADDS`;
    ``index_put`` only with ``accumulate=True``), or None. Size 1 is never
    symbolic in a capture, so the result has one element on every call.

    Why: inductor (torch 2.11, H100) compiles
    ``zeros(1).index_add(0, index, g.expand(n))`` (the backward of
    ``index_select`` on a one-element leaf) into one Triton kernel whose
    store index and source index do not depend on the loop; its
    ``tl.atomic_add`` then has no mask, and every lane of the block adds: 4
    for n = 3, 8 for n = 5, 128 for n = 70, where eager gives n. A source
    read from memory compiled right, but one that inductor computes in the
    kernel from a broadcast value does not: a traced tensor hook that scales
    the expanded gradient first gave the same wrong sums (H100 campaign,
    seed 41). Which sources inductor fuses is inductor's choice, so every
    such add into one CUDA element is named, whatever its source. A result
    of two elements, and CPU inductor (torch 2.13), compile right. In
    ``fuzz/known_issues.toml`` as
    ``inductor-cuda-index-add-one-element-unmasked-atomic``."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SCATTER_ADDS:
            continue
        if node.target in _PUTS:
            accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
            if accumulate is not True:
                continue
        val = node.meta.get("val")
        if (
            isinstance(val, torch.Tensor) and val.device.type == "cuda"
            and val.layout == torch.strided and _static_numel(val) == 1
        ):
            return f"{node.name} ({node.target.name()} into {list(val.shape)})"
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
    callable gets the graph module alone; a symbolic graph whose sizes
    include a dimension marked with ``torch._dynamo.mark_dynamic`` reaches
    it with its sizes read from tensors (:mod:`cagrad.compile.marked_sizes`).

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

        def compile_with_user_fn(gm: torch.fx.GraphModule, symbolic: bool, static_first: bool = False) -> Any:
            if symbolic and marked_sizes.wants_size_tensors(gm):
                # a mark_dynamic'ed dimension: sizes as tensor dimensions Dynamo keeps symbolic
                with preserved():
                    return marked_sizes.calling_with_size_tensors(user_fn(marked_sizes.with_size_tensors(gm)))
            with preserved():  # eager runs no compiler: what it changes must not show
                return user_fn(gm)

        return compile_with_user_fn
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
        # eager runs no compiler: what it changes, or warns, must not show
        with preserved(), logs.torch_warnings_held("compile"):
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
