"""The op catalog: every op the fuzzer can put in a program.

Each :class:`OpSpec` knows

* its arity (``min_arity`` .. ``max_arity``) and its attribute schema
  (``attrs``: name -> :class:`Attr`), checked by :func:`check_attrs`;
* its shape rule ``infer(input_shapes, attrs) -> [output shape, ...]``
  (raises :class:`ShapeError`) and dtype rule (``promote``, ``same``: inputs
  must agree, or ``attr``: the ``dtype`` attribute);
* its torch implementation ``impl(tensors, attrs)``, and ``code(args,
  attrs)``: the same thing as a torch expression, for readable reproducers;
* how to generate it: ``accepts(first_shape)`` says whether a value of that
  shape can be its first input, and ``plan(draw, first_shape)`` draws the
  shapes its other inputs need plus its attributes (``draw`` is Hypothesis'
  draw function).

Ops that could blow values up use tame variants so that float32 comparisons
stay meaningful: ``log`` is ``log1p(|x|)``, ``sqrt`` is ``sqrt(|x| + 1)``,
``reciprocal`` is ``1 / (|x| + 1)``, ``div`` is ``x / (|y| + 1)``, ``exp``
clamps its input to [-10, 10] and ``pow`` takes small integer exponents.

New ops are added with :func:`register`; the IR, the strategies and the
interpreter only go through this table. Two families live in modules of
their own: :mod:`fuzz.ops_custom` (custom ``autograd.Function`` s from
:mod:`fuzz.functions`, category ``custom``) and :mod:`fuzz.ops_inplace`
(in-place ops on views of a fresh copy, category ``inplace_view``, and the
rare ``mul_inplace`` that writes into an earlier value, category
``inplace``); :mod:`fuzz.ops_graph` adds multi-output and
``(values, indices)`` ops and ``fn_inner_grad`` for the graph features
(:mod:`fuzz.ir_graph`), and :mod:`fuzz.ops_dynamic` (random ops, category
``random``, and ops whose values decide sizes, category ``dynamic``).
Hooks are not ops: they are a program-level list (see
:mod:`fuzz.ir`).
"""

from __future__ import annotations

# isort: off
# the vocabulary, re-exported: the rest of the fuzzer reads the catalog here
from fuzz.op_spec import (  # noqa: F401
    ATTR_KINDS,  # noqa: F401
    Attr,  # noqa: F401
    AttrError,  # noqa: F401
    DTypeError,  # noqa: F401
    DrawFn,  # noqa: F401
    MAX_DIM,  # noqa: F401
    MAX_RANK,  # noqa: F401
    OPS,  # noqa: F401
    OpSpec,  # noqa: F401
    Plan,  # noqa: F401
    Shape,  # noqa: F401
    ShapeError,  # noqa: F401
    SpecError,  # noqa: F401
    TORCH_DTYPES,  # noqa: F401
    broadcast,  # noqa: F401
    categories,  # noqa: F401
    check_attrs,  # noqa: F401
    check_into,  # noqa: F401
    draw_broadcast_partner,  # noqa: F401
    draw_into_partner,  # noqa: F401
    get,  # noqa: F401
    names,  # noqa: F401
    norm_dim,  # noqa: F401
    norm_dims,  # noqa: F401
    register,  # noqa: F401
)

# importing the op modules registers their ops
from fuzz import ops_math as _ops_math  # noqa: F401
from fuzz import ops_shape as _ops_shape  # noqa: F401
from fuzz import ops_custom as _ops_custom  # noqa: F401
from fuzz import ops_inplace as _ops_inplace  # noqa: F401
from fuzz import ops_graph as _ops_graph  # noqa: F401
from fuzz import ops_dynamic as _ops_dynamic  # noqa: F401
from fuzz.op_spec import order_catalog as _order_catalog
# isort: on

#: The catalog's order (the order the strategies draw from: keep it; a new
#: module goes last): by module, in this order, each module's ops in the
#: order it registers them, whichever module a process imported first.
MODULE_ORDER = (
    "fuzz.ops_math",
    "fuzz.ops_shape",
    "fuzz.ops_custom",
    "fuzz.ops_inplace",
    "fuzz.ops_graph",
    "fuzz.ops_dynamic",
)
_order_catalog(MODULE_ORDER)
