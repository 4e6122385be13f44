"""Opaque calls in the trace: what the engine does that cannot be traced
(hooks that do not trace, nodes run as they are, accumulation, a custom
Function's backward) becomes one ``call_function`` to
:mod:`cagrad.capture.runtime_ops`, whose outputs are fresh fakes with the
layout the engine guarantees (:func:`cagrad.capture.layouts.spec_of`); a
hook dict accepted by :mod:`cagrad.hooks.hook_tracing` is recorded as traced
ops instead.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx

from .. import internals
from ..autograd.walk import MUST_BE_NONE, PASS, THIS_CALL, Obj, ResumePoint
from ..counters import counters
from ..errors import HookTraceFailed, Unsupported
from . import runtime_ops
from .layouts import spec_of
from .traced import NON_STRIDED
from .warnings_in_trace import warnings_refused

track_tensor_tree = internals.import_attr(
    "fake_tensor_capture", "torch.fx.experimental.proxy_tensor", "track_tensor_tree"
)

log = logging.getLogger("cagrad")

# hook calls whose dict may be traced (Collector.traced_hooks): op -> what
# its hooks are called in logs and node tags
TRACEABLE_HOOKS = {
    "tensor_pre_hooks": "tensor hook",
    "node_pre_hooks": "node pre-hook",
    "node_post_hooks": "node post-hook",
}


class _Passed:
    """An item of an opaque call's result that the trace does not look at
    (:data:`~cagrad.autograd.walk.PASS`): later opaque calls get it as it is."""

    __slots__ = ("proxy",)

    def __init__(self, proxy: torch.fx.Proxy) -> None:
        self.proxy = proxy


class OpaqueCalls:
    """Mixin of :class:`~cagrad.capture.compiler.AutogradCompilerInstance`:
    the ``opaque`` step :class:`cagrad.autograd.walk.BackwardWalk` calls.
    Reads its ``tracer``, ``collector``, ``hooks_proxy``, ``profile`` and
    ``accumulate_at_end``, and calls its ``_proxy``, ``_name``, ``_fake``,
    ``_last_node`` and ``_tag_since``."""

    tracer: Any
    collector: Any
    hooks_proxy: Any
    profile: dict | None
    accumulate_at_end: bool

    def _arg(self, a: Any) -> Any:
        if isinstance(a, Obj):
            return self.hooks_proxy[a.index]
        if isinstance(a, _Passed):
            return a.proxy
        if isinstance(a, torch.Tensor):
            return self._proxy(a)
        if isinstance(a, (list, tuple)):
            return [self._arg(x) for x in a]
        return a

    def opaque(self, op: str, args: tuple, result: Any, origin: str, resume: Any, pos: int) -> Any:
        if op in TRACEABLE_HOOKS and args[0].index in self.collector.traced_hooks:
            traced = self._trace_hooks(op, args[0].index, args[1:], origin)
            if traced is not None:
                return traced[0]
        target = getattr(runtime_ops, op)
        proxy = self.tracer.create_proxy("call_function", target, tuple(self._arg(a) for a in args), {})
        node = proxy.node
        node.meta["autograd_node"] = origin
        # whose call or hook it is (a segmented run releases the saved
        # tensors of every earlier node before it: cagrad.run.runtime)
        node.meta["cagrad_pos"] = pos
        if op == "accumulate" and args[2] is not None and args[2].index in self.collector.ddp_python_hooks:
            node.meta["cagrad_ddp_python_hooks"] = True
        if result is None:
            return None
        if isinstance(result, list):
            specs = [
                r if r is MUST_BE_NONE else None if r is PASS else spec_of(r) for r in result
            ]
            outs: list = []
            for i, spec in enumerate(specs):
                if result[i] is PASS:
                    # not checked (spec None): the value goes on as it is
                    item = proxy[i]
                    item.node.meta["autograd_node"] = origin
                    outs.append(_Passed(item))
                    continue
                if spec is None or spec is MUST_BE_NONE:
                    outs.append(None)
                    continue
                item = proxy[i]
                item.node.meta["autograd_node"] = origin
                fake = self._fake(spec)
                track_tensor_tree(fake, item, constant=None, tracer=self.tracer)
                outs.append(fake)
        else:
            specs = spec_of(result)
            outs = self._fake(specs)
            track_tensor_tree(outs, proxy, constant=None, tracer=self.tracer)
        node.meta["cagrad_spec"] = specs
        if resume is not None:
            pos, phase, buffers, captured, inputs = resume()
            if NON_STRIDED in (self.profile or {}).get((pos, phase), ()):
                raise Unsupported(
                    "non_strided_tensor",
                    f"{origin} returned a non-strided (sparse) gradient that the graph "
                    "would use as a strided one",
                )
            node.meta["cagrad_resume"] = ResumePoint(
                pos,
                phase,
                {k: [self._name(v) for v in vs] for k, vs in buffers.items()},
                [self._name(v) for v in captured],
                [] if inputs is None else [node.name if v is THIS_CALL else self._name(v) for v in inputs],
            )
        return outs

    def _trace_hooks(self, op: str, index: int, args: tuple, origin: str) -> tuple[Any] | None:
        """Records one hook dict (``hooks[index]``, each hook accepted by
        :mod:`cagrad.hooks.hook_tracing`) as traced ops on its gradients
        (``args``: ``op``'s arguments after the dict); returns ``(result,)``
        (the new gradient, or list of them for node hooks), or None (nothing
        recorded) where a hook does not trace (it reads a value, or returns
        what eager would reject): the caller then records the opaque call,
        which runs the hooks, and raises eager's error, at run time. A None
        gradient is handed to the hooks as eager does; one that returns a
        tensor for it fails here.
        """
        hooks = self.collector.objects[index]
        kind = TRACEABLE_HOOKS[op]
        graph = self.tracer.graph
        marker = self._last_node()
        try:
            with warnings_refused():  # a hook that warns runs opaque, warning every backward
                result = getattr(runtime_ops, "traced_" + op)(hooks, *args)
        except Exception as e:  # noqa: BLE001 - any failure: the hooks run opaque
            node = self._last_node()
            while node is not marker:
                prev = node.prev
                graph.erase_node(node)
                node = prev
            counters.bump("hooks_opaque")
            log.info("%s: %s run opaque (%s: %s)", origin, kind, type(e).__name__, e)
            if self.accumulate_at_end:
                # the leaves would be accumulated after an opaque hook that
                # might read them: trace again with every hook opaque
                raise HookTraceFailed("hook_trace_failed", f"{origin}: {type(e).__name__}") from e
            return None
        self._tag_since(marker, f"{origin} {kind}")
        counters.bump("hooks_traced")
        return (result,)
