"""compiler_fn: from a backend name or callable to ``GraphModule -> callable``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import torch
import torch.fx

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
        cagrad.Unsupported: reason ``backend_denylist:<backend>:<op>``.
    """
    denied = _DENYLIST.get(compiler_fn) if isinstance(compiler_fn, str) else None
    if not denied:
        return
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in denied:
            from .errors import Unsupported

            op = node.target.name()
            raise Unsupported(
                f"backend_denylist:{compiler_fn}:{op.split('::')[-1]}",
                f"{compiler_fn} is known to compile {op} wrongly (see cagrad/backends.py)",
            )


def resolve(compiler_fn: CompilerFn) -> Callable[[torch.fx.GraphModule, bool], Callable[..., Any]]:
    """Turns ``compiler_fn`` into ``compile(graph_module, symbolic) -> callable``.

    A string names a ``torch.compile`` backend (``"eager"``, ``"aot_eager"``,
    ``"inductor"``, or any registered one): the graph is passed to
    ``torch.compile(gm, backend=name, dynamic=symbolic)``: a graph traced
    with dynamic sizes is compiled for any value of them (no backend
    recompile when they change), a static one for its sizes. A callable gets
    the graph module alone.

    Raises:
        TypeError: if ``compiler_fn`` is neither.
        ValueError: if the backend name is not registered with torch.compile.
    """
    if isinstance(compiler_fn, str):
        from torch._dynamo.backends.registry import list_backends

        known = set(list_backends(exclude_tags=())) | {"eager", "aot_eager", "inductor"}
        if compiler_fn not in known:
            raise ValueError(
                f"cagrad: unknown torch.compile backend {compiler_fn!r}; "
                f"registered: {sorted(known)}"
            )
        name = compiler_fn

        def compile_with_backend(gm: torch.fx.GraphModule, symbolic: bool) -> Callable[..., Any]:
            return torch.compile(gm, backend=name, dynamic=symbolic)

        return compile_with_backend
    if callable(compiler_fn):
        user_fn = compiler_fn
        return lambda gm, symbolic: user_fn(gm)
    raise TypeError(
        "cagrad.enable: compiler_fn must be a torch.compile backend name or a "
        f"callable GraphModule -> callable, got {type(compiler_fn).__name__}"
    )
