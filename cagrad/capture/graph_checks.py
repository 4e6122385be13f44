"""Checks and passes on a captured graph: what a backward with a tensor
subclass does not compile, the renumbering of a placeholder's reads to the
items used, which outputs alias inputs, and which lifted tensors hold a
nested int."""

from __future__ import annotations

import torch
import torch.fx

from .. import internals
from ..autograd import run_context
from ..errors import Unsupported
from .traced import OPAQUE_TARGETS


def check_subclass_capture(symbolic: bool) -> None:
    """What a backward with a tensor subclass does not compile (see
    :mod:`cagrad.keys.subclasses`)."""
    if run_context.create_graph():
        raise Unsupported(
            "tensor_subclass",
            "create_graph=True with a tensor subclass (a rebuilt subclass gradient has no graph)",
        )
    if symbolic:
        raise Unsupported("tensor_subclass", "dynamic sizes in a backward with a tensor subclass")


def check_no_opaque_calls(graph: torch.fx.Graph) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target in OPAQUE_TARGETS:
            raise Unsupported(
                "tensor_subclass",
                f"a tensor subclass in a backward with opaque calls ({node.meta.get('autograd_node', node.name)})",
            )


def prune(graph: torch.fx.Graph, placeholder: str) -> list[int]:
    """Renumbers ``<placeholder>[i]`` reads so the list holds only used items."""
    ph = next(n for n in graph.nodes if n.op == "placeholder" and n.target == placeholder)
    reads = sorted(
        (u for u in ph.users if u.op == "call_function" and u.args[0] is ph),
        key=lambda u: u.args[1],
    )
    used = []
    for new_index, user in enumerate(reads):
        used.append(user.args[1])
        user.args = (ph, new_index)
    return used


def returns_input(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[bool]:
    """Per traced output, whether it is one of the graph's inputs itself.

    Eager's ``AccumulateGrad`` takes a gradient as ``.grad`` uncopied when
    nothing else holds that tensor (torch/csrc/autograd/functions/
    accumulate_grad.h: its use count): an input of the backward (a
    ``grad_tensors`` tensor the caller holds, a saved tensor) passed through
    unchanged is copied, while a view the backward made of one (``CatBackward``
    narrows its gradient) is a tensor of its own and is taken, so the leaf's
    ``.grad`` shares the caller's memory. The trace keeps that distinction by
    identity: a view op gives a new fake.
    """
    ids = {id(t) for t in inputs}
    return [id(o) in ids for o in outputs]


def holds_nested_int(t: torch.Tensor) -> bool:
    """Whether ``t`` is a nested tensor's offsets (or lengths), holding its
    nested int, or a view of a nested tensor or of such a tensor (a
    ``values()`` saved for a node)."""
    registry = internals.nested_int_registry()
    if registry is None:
        return False
    base = t._base
    return t in registry or (base is not None and (base.is_nested or base in registry))
