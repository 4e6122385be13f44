"""What each autograd node type holds, and which of it cagrad can see.

Every generated backward node (``MulBackward0``, ...) is a C++ struct whose
fields are its saved state. Python sees a field ``f`` as the property
``_saved_<f>`` (and a saved tensor also as ``_raw_saved_<f>``), but only for
field types the Python bindings know how to convert. A cache key that left
out a field the backward formula reads would let two different graphs share
one compiled graph: a silently wrong gradient. So the schema of a node type is
read from the authoritative list of its fields, the generated header
``torch/include/torch/csrc/autograd/generated/Functions.h`` shipped in every
torch wheel, and every field Python cannot see gets a policy:

* ``edge``: the field describes one input of the forward op (its
  ``TypeAndSize``, scalar type, options or layout) and only that input's
  gradient reads it. A node computes an input's gradient only when the edge
  to it is valid (``Node::task_should_compute_output``), and then the edge's
  target records that input's shape, dtype and device in its
  ``_input_metadata``, which is part of the key. Covered.
* ``memory``: the field changes memory use, not values
  (``retain_variables`` picks ``clone()`` or not in the cudnn batch norm and
  RNN formulas). Covered.
* ``split_sizes``: ``CatBackward0`` / ``BlockDiagBackward0`` keep each input's
  sizes. The inputs with a valid edge show their sizes in the key, the node's
  own input metadata gives the total, so the sizes are determined when at
  most one input has no valid edge; otherwise the node is unsupported.
* anything else (``AsStridedBackward0.self_geometry``,
  ``NativeDropoutBackward0.train``, ...): the node is unsupported and its
  backward falls back to eager, with the field named in the reason.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import re
from typing import Any

import torch

from .. import internals

log = logging.getLogger("cagrad")

_HEADER = os.path.join(
    "include", "torch", "csrc", "autograd", "generated", "Functions.h"
)
_STRUCT_RE = re.compile(r"struct TORCH_API (\w+) : public \w+ \{(.*?)\n\};", re.S)
_FIELD_RE = re.compile(r"^([\w:<>, ]+?)\s+(\w+)(?:\s*=.*)?;$")

# hidden fields whose meaning is "a property of the input named by the prefix"
_EDGE_TYPES = (
    "torch::autograd::generated::TypeAndSize",
    "at::ScalarType",
    "at::TensorOptions",
    "at::Layout",
)
_EDGE_SUFFIXES = ("_info", "_scalar_type", "_options", "_layout")
_SYM_TYPES = (
    "c10::SymInt",
    "std::vector<c10::SymInt>",
    "::std::optional<c10::SymInt>",
    "c10::OptionalArray<c10::SymInt>",
)


class NodeKind(enum.Enum):
    GENERATED = "generated"  # a node generated from derivatives.yaml
    ACCUMULATE_GRAD = "accumulate_grad"  # the sink of a leaf's gradient
    CUSTOM_FUNCTION = "custom_function"  # a Python autograd.Function backward
    UNSUPPORTED = "unsupported"


@dataclasses.dataclass(frozen=True)
class NodeSchema:
    """The saved state of one node type, as cagrad keys and lifts it.

    Attributes:
        name: the node's class name.
        kind: how the node is handled.
        tensors: suffixes ``x`` of saved tensors (``_saved_x``/``_raw_saved_x``).
        tensor_lists: suffixes of saved tensor lists.
        values: suffixes of visible non-tensor attributes, in key order.
        sym_values: suffixes of visible ``SymInt``-typed attributes (sizes a
            node keeps): size slots rather than key bytes.
        split_sizes: True for nodes whose hidden per-input sizes must be
            shown to be determined by the edges (``split_sizes`` policy).
        unsupported: ``(reason, detail)`` when the node cannot be compiled.
    """

    name: str
    kind: NodeKind
    tensors: tuple[str, ...] = ()
    tensor_lists: tuple[str, ...] = ()
    values: tuple[str, ...] = ()
    sym_values: tuple[str, ...] = ()
    split_sizes: bool = False
    unsupported: tuple[str, str] | None = None


def header_path() -> str:
    """Path of the generated ``Functions.h`` of the installed torch."""
    return os.path.join(os.path.dirname(torch.__file__), _HEADER)


@functools.cache
def _header_fields() -> dict[str, list[tuple[str, str]]] | None:
    """Struct name -> [(C++ type, field name)], or None without the header."""
    path = header_path()
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        internals.report(
            "functions_header",
            f"cannot read {path} ({e}): backwards with a generated node fall back to eager, "
            "since its hidden fields cannot be checked",
        )
        return None
    structs: dict[str, list[tuple[str, str]]] = {}
    for name, body in _STRUCT_RE.findall(text):
        fields = []
        for raw in body.split("\n"):
            line = raw.strip()
            if not line or "(" in line or line.startswith(("using", "#", "//")):
                continue
            m = _FIELD_RE.match(line)
            if m:
                fields.append((m.group(1).strip(), m.group(2)))
        structs[name] = fields
    # the parse must find what every torch since 2.0 declares: a node that
    # keeps two saved tensors, and its hidden bookkeeping of tensor lists
    if ("SavedVariable", "self_") not in structs.get("MulBackward0", ()) or (
        "SavedVariable",
        "other_",
    ) not in structs.get("MulBackward0", ()):
        internals.report("functions_header", f"{path} does not declare MulBackward0 {{SavedVariable self_, other_}}")
        return None
    internals.report("functions_header", None)
    return structs


def _hidden_policy(struct: str, ctype: str, field: str) -> str | None:
    """The policy of a field Python cannot see, or None if none applies."""
    if ctype in _EDGE_TYPES and field.endswith(_EDGE_SUFFIXES):
        return "edge"
    if ctype == "::std::vector<at::ScalarType>" and field == "tensors_args_scalartypes":
        return "edge"
    if ctype == "bool" and field == "retain_variables":
        return "memory"
    if (struct, field) in (
        ("CatBackward0", "tensors_args_sizes_symint"),
        ("BlockDiagBackward0", "tensors_args_sizes"),
    ):
        return "split_sizes"
    return None


def _generated_schema(cls: type, fields: list[tuple[str, str]]) -> NodeSchema:
    name = cls.__name__
    props = set(dir(cls))
    tensors, tensor_lists, values, sym_values = [], [], [], []
    split_sizes = False
    for ctype, field in fields:
        if field.endswith("_released_") or (ctype == "size_t" and field.endswith("_size_")):
            continue  # bookkeeping of saved tensor lists and of tensor-list inputs
        attr = field[:-1] if field.endswith("_") else field
        if ctype == "SavedVariable":
            tensors.append(attr)
        elif ctype == "std::vector<SavedVariable>":
            tensor_lists.append(attr)
        elif "_saved_" + attr in props:
            (sym_values if ctype in _SYM_TYPES else values).append(attr)
        else:
            policy = _hidden_policy(name, ctype, field)
            if policy is None:
                return NodeSchema(
                    name,
                    NodeKind.UNSUPPORTED,
                    unsupported=(
                        f"hidden_state:{name}",
                        f"{name}.{field} ({ctype}) is not visible from Python, "
                        "so a cache key cannot include it",
                    ),
                )
            split_sizes = split_sizes or policy == "split_sizes"
    for attr in tensors + tensor_lists:
        if "_raw_saved_" + attr not in props:
            return NodeSchema(
                name,
                NodeKind.UNSUPPORTED,
                unsupported=(
                    f"hidden_state:{name}",
                    f"{name} saves tensor {attr!r} without a _raw_saved_ accessor",
                ),
            )
    return NodeSchema(
        name,
        NodeKind.GENERATED,
        tensors=tuple(sorted(tensors)),
        tensor_lists=tuple(sorted(tensor_lists)),
        values=tuple(sorted(values)),
        sym_values=tuple(sorted(sym_values)),
        split_sizes=split_sizes,
    )


_schemas: dict[type, NodeSchema] = {}


def schema_of(node: Any) -> NodeSchema:
    """The :class:`NodeSchema` of ``node``'s type (computed once per type)."""
    cls = type(node)
    schema = _schemas.get(cls)
    if schema is None:
        schema = _schemas[cls] = _compute_schema(cls)
    return schema


def _compute_schema(cls: type) -> NodeSchema:
    name = cls.__name__
    if cls is torch._C._functions.AccumulateGrad:
        return NodeSchema(name, NodeKind.ACCUMULATE_GRAD)
    if issubclass(cls, torch.autograd.function.BackwardCFunction):
        return NodeSchema(name, NodeKind.CUSTOM_FUNCTION)
    headers = _header_fields()
    if getattr(torch._C._functions, name, None) is cls:
        if headers is None:
            return NodeSchema(
                name,
                NodeKind.UNSUPPORTED,
                unsupported=(
                    "internal:functions_header",
                    f"{header_path()}: {internals.why('functions_header')}",
                ),
            )
        fields = headers.get(name)
        if fields is not None:
            return _generated_schema(cls, fields)
    return NodeSchema(
        name,
        NodeKind.UNSUPPORTED,
        unsupported=(f"unsupported_node:{name}", f"no compiled handling for {name} yet"),
    )


# generated node types whose one differentiable input is a tensor list, so
# that all their edges form one index range
_ONE_LIST_INPUT = frozenset(
    {"CatBackward0", "StackBackward0", "BlockDiagBackward0", "NestedTensorFromTensorListBackward0"}
)
# C++ nodes written by hand that decide each output on its own
# (``task_should_compute_output(i)`` per edge; torch/csrc/autograd/functions)
_PER_EDGE = frozenset({"CopySlices", "CopyBackwards"})


def output_ranges(node: Any) -> list[range] | None:
    """How a C++ node groups its outputs when it decides which to compute.

    A generated node computes the gradient of each forward argument only if
    ``Node::task_should_compute_output`` holds for the argument's range of
    edges: one edge for a tensor, one edge per element for a tensor list (a
    ``size_t <arg>_size_`` field in ``Functions.h``), true when any edge of
    the range is valid and, under ``inputs=``, leads to a node the backward
    runs. Returns the ranges covering ``node.next_functions``, or None where
    they are not known (a node type with tensor-list inputs beside others, a
    custom Function, a C++ node not listed here).
    """
    cls = type(node)
    name = cls.__name__
    n = len(node.next_functions)
    if name in _PER_EDGE and getattr(torch._C._functions, name, None) is cls:
        return [range(i, i + 1) for i in range(n)]
    if getattr(torch._C._functions, name, None) is not cls:
        return None
    fields = (_header_fields() or {}).get(name)
    if fields is None:
        return None
    if not any(ctype == "size_t" and field.endswith("_size_") for ctype, field in fields):
        return [range(i, i + 1) for i in range(n)]
    if name in _ONE_LIST_INPUT:
        return [range(n)]
    return None
