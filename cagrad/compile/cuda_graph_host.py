"""The host (CPU) inputs of a CUDA-graphed backward, and the inputs no kernel reads.

A CUDA graph holds the values of the host tensors it was recorded with (a
kernel launch reads them from the host), so small CPU inputs are part of a
graph's key (:class:`_HostInputs`), and inputs no kernel reads (a philox
seed and offset passed to an attention backward whose ``dropout_p`` is 0)
are left out of it (:func:`unread_host_inputs`). Used by
:class:`cagrad.compile.cuda_graphs.CudaGraphed`; the rules are its module's
docstring's.
"""

from __future__ import annotations

import math
import operator

import torch

MAX_HOST_VALUES = 8
"""Most elements a host (CPU) input of a CUDA-graphed backward may have: its
values are part of the graph's key and compared on every call."""


def _host_inputs_ok(inputs: list, host: list[int]) -> bool:
    """Whether a graph with these host inputs (positions) may be recorded:
    some input is on CUDA (there is GPU work to replay) and every host input
    is a small dense CPU tensor (read by value, :meth:`_HostInputs.key`)."""
    return len(host) < len(inputs) and all(
        inputs[i].device.type == "cpu" and inputs[i].layout == torch.strided and inputs[i].numel() <= MAX_HOST_VALUES
        for i in host
    )


# arguments that carry a random-number generator's state into an op, read
# by its kernels only when the op's dropout_p is not 0 (the attention
# backwards: _scaled_dot_product_{flash,efficient,cudnn}_attention_backward,
# _flash_attention_backward, _efficient_attention_backward)
_RNG_ARGUMENTS = frozenset({"philox_seed", "philox_offset", "rng_state"})


def unread_host_inputs(graph_module: torch.fx.GraphModule) -> frozenset[int]:
    """Positions ``j`` of the graph inputs (``inputs[j]``) whose values no
    kernel reads: inputs the graph does not use, and inputs passed (directly
    or through ``detach``/``alias``) only as the RNG state of ops whose
    ``dropout_p`` argument is the constant 0. A transformer's attention
    backward takes a philox seed and offset that change at every forward even
    without dropout; leaving them out of a graph's key is what lets such a
    backward replay. The op schemas name the arguments, so the rule holds
    for any op with these argument names."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return frozenset()
    unread = set()
    for node in placeholders[0].users:
        if node.op == "call_function" and node.target is operator.getitem and type(node.args[1]) is int:
            if _only_unread_rng_state(node):
                unread.add(node.args[1])
    return frozenset(unread)


def _only_unread_rng_state(node: torch.fx.Node) -> bool:
    for user in node.users:
        if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
            return False
        if user.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            if not _only_unread_rng_state(user):
                return False
            continue
        names = [a.name for a in user.target._schema.arguments]
        bound = dict(zip(names, user.args))
        bound.update(user.kwargs)
        dropout_p = bound.get("dropout_p")
        if type(dropout_p) not in (int, float) or dropout_p != 0:
            return False
        as_rng = [name for name, value in bound.items() if value is node]
        if not as_rng or _count_uses(user, node) != len(as_rng) or any(name not in _RNG_ARGUMENTS for name in as_rng):
            return False
    return True


def _count_uses(user: torch.fx.Node, node: torch.fx.Node) -> int:
    """How many times ``node`` appears in ``user``'s arguments (in lists too)."""
    count = 0

    def visit(n: torch.fx.Node) -> torch.fx.Node:
        nonlocal count
        count += n is node
        return n

    torch.fx.node.map_arg((user.args, user.kwargs), visit)
    return count


class _HostInputs:
    """The host (CPU) inputs of one compiled backward, read by value.

    Which inputs are on the host, and each one's dtype and rank, are fixed
    by the cache key (it holds every lifted tensor's device, dtype and
    rank), and each one's shape by the sizes; so they are sorted out on the
    first call, and checked (:func:`_host_inputs_ok`) once per tuple of
    sizes.

    Attributes:
        positions: the host inputs' positions in the graph's inputs.
    """

    __slots__ = ("positions", "scalars", "small", "checked")

    def __init__(self, inputs: list, unread: frozenset[int]) -> None:
        self.positions = [i for i, t in enumerate(inputs) if not t.is_cuda]
        keyed = [i for i in self.positions if i not in unread]
        self.scalars = [i for i in keyed if inputs[i].dim() == 0]
        self.small = [i for i in keyed if inputs[i].dim() != 0]
        self.checked: set[tuple] = set()

    def ok(self, inputs: list, size_key: tuple) -> bool:
        """Whether these inputs may be recorded at these sizes (see :func:`_host_inputs_ok`)."""
        if size_key in self.checked:
            return True
        if not _host_inputs_ok(inputs, self.positions):
            return False
        self.checked.add(size_key)
        return True

    def key(self, inputs: list) -> tuple:
        """The host inputs' part of a graph's key: their values (0-dim ones
        by ``item()``, about 0.1 us each), and the sign of each zero among
        them: -0.0 equals 0.0 but is another operand (``x * -0.0`` has
        other signs). A NaN never equals itself, so a call with one records
        a graph of its own until the bound, then runs without one."""
        values = tuple([inputs[i].item() for i in self.scalars])
        if self.small:
            values += tuple([v for i in self.small for v in inputs[i].reshape(-1).tolist()])
        if 0 in values:
            return values, tuple([math.copysign(1.0, v) for v in values if type(v) is float and v == 0])
        return values, ()
