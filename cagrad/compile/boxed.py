"""Boxed calls: a compiled graph frees each input once it is done with it.

Eager autograd frees a node's saved tensors as soon as that node has run
(``retain_graph=False``), so a backward's peak memory holds only the saved
tensors of the nodes still to run. A compiled backward reads every saved
tensor as a graph input; called the usual way, ``fn(*args)``, the argument
tuple keeps every input alive until the whole graph returns, and the peak
holds all of them plus the gradients (transformer layer on the H100: 120 MiB
against eager's 72).

A *boxed* callable takes one list and empties it once it has read it (the
calling convention AOTAutograd and inductor use inside, and the one torch's
compiled autograd reaches through Dynamo's ``flatten_graph_inputs``); each
input then lives only as long as the code that reads it. cagrad's side of the
bargain (:mod:`cagrad.compiled_backward`): on a backward without
``retain_graph`` it releases the saved tensors it lifted before the call, and
hands over the only other list that holds them.

* ``"eager"``: the backend returns the graph's own ``forward``;
  :func:`boxed_graph_module` rewrites the graph to read its inputs from one
  list argument, and FX's code generation drops each value after its last
  use. The compiled callable is that ``forward``, not the module.
* ``"aot_eager"``, ``"inductor"``: the graph is handed over wrapped in
  Dynamo's ``GmWrapper``, which makes ``aot_module_simplified`` return its
  boxed ``forward(list)``.
* any other backend is called unboxed.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from .. import logs
from ..preserve import preserved

BOXED_BACKENDS = ("eager", "aot_eager", "inductor")
"""Backend names compiled into boxed callables (see the module docstring)."""


def boxed_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` rewritten in place to take its placeholders as one list.

    The new graph reads ``args[i]`` for the i-th old placeholder, then
    empties ``args``; FX's generated code sets each value to None after its
    last use, so an input is freed there unless the caller holds it too.

    Args:
        gm: a graph with flat placeholders (tensors, SymInts) only.

    Returns:
        ``gm``, recompiled; called as ``gm(args)`` with a list, which it
        empties.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(placeholders[0] if placeholders else None):
        args = graph.placeholder("args")
    last = args
    for i, ph in enumerate(placeholders):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (args, i))
        last.meta.update(ph.meta)
        ph.replace_all_uses_with(last)
        graph.erase_node(ph)
    with graph.inserting_after(last):
        graph.call_method("clear", (args,))
    gm.recompile()
    return gm


def _as_is(args: list) -> list:
    return args


def compile_boxed(
    backend: Callable[..., Any],
    name: str | None,
    gm: torch.fx.GraphModule,
    examples: Sequence[Any],
    inputs_keyed: bool = False,
) -> tuple[Callable[..., Any], bool]:
    """Compiles ``gm`` with ``backend``; boxed where the backend allows it.

    Call it inside the ``TracingContext`` the backend needs.

    Args:
        backend: the Dynamo backend callable.
        name: its registered name, or None when unknown.
        gm: the flat graph (:func:`cagrad.compile.direct_compile.flat_graph`).
        examples: one example (fake tensor or SymInt) per placeholder.
        inputs_keyed: every tensor input's sizes, strides and storage offset
            are in the cache key and its SizeCheck, which a call has passed
            (a whole-graph backward; a segment also reads what opaque calls
            return). inductor then compiles without its per-call
            ``assert_size_stride`` of each input (``size_asserts``), a
            second layer of the check cagrad has already made.

    Returns:
        ``(fn, boxed)``: with ``boxed`` True, call ``fn(args_list)`` (it
        empties the list); else ``fn(*args)``.

    The compile leaves the process state as it found it
    (:func:`cagrad.preserve.preserved`: random generators, flags, configs)
    and shows no warning of torch's (:func:`cagrad.logs.torch_warnings_held`):
    eager autograd compiles nothing. That holds for the compiles made after
    the capture too (a graph's symbolic code at its first call at other
    sizes, a static specialization), inside a later backward.
    """
    with preserved(), logs.torch_warnings_held("compile"):
        try:
            return _compile_boxed(backend, name, gm, examples, inputs_keyed)
        finally:
            _forget_frames(examples)


def _forget_frames(examples: Sequence[Any]) -> None:
    """Drops the frames that cagrad's ShapeEnv kept while the backend
    asked it questions (``forget_probe`` of
    :mod:`cagrad.capture.shape_env`): a kept frame keeps its locals, and the
    compile's callers hold the backward's collected tensors (the program's
    leaves and saved activations among them), which then outlived the
    program for as long as the compiled graph was cached
    (:mod:`harness.lifetimes` found it)."""
    envs: dict[int, Any] = {}
    for e in examples:
        node = getattr(e, "node", None) if isinstance(e, torch.SymInt) else None
        env = node.shape_env if node is not None else getattr(getattr(e, "fake_mode", None), "shape_env", None)
        if env is not None:
            envs[id(env)] = env
    for env in envs.values():
        forget = getattr(env, "forget_probe", None)
        if forget is not None:
            forget()


def _compile_boxed(
    backend: Callable[..., Any],
    name: str | None,
    gm: torch.fx.GraphModule,
    examples: Sequence[Any],
    inputs_keyed: bool,
) -> tuple[Callable[..., Any], bool]:
    if name == "eager":
        # its forward, as Dynamo's eager backend returns: a call to the module
        # itself runs nn.Module's hook dispatch and FX's traceback wrapper:
        # 3.0 against 1.8 us a call, warm (a DDP backward makes one per segment)
        return boxed_graph_module(gm).forward, True
    if name in BOXED_BACKENDS:
        from torch._dynamo.utils import GmWrapper

        options = contextlib.nullcontext()
        if name == "inductor" and inputs_keyed:
            from torch._inductor import config

            options = config.patch(size_asserts=False)
        with options:
            return backend(GmWrapper(gm, _as_is), list(examples)), True
    return backend(gm, list(examples)), False


__all__ = ["BOXED_BACKENDS", "boxed_graph_module", "compile_boxed"]
