"""The size queries of a backend's compile answered without a guard.

A graph traced with symbols that may be 0 or 1 (:mod:`cagrad.capture.shape_env`)
is compiled by ``"aot_eager"`` or ``"inductor"`` in the trace's ShapeEnv,
and every guard their code records joins the graph's SizeCheck
(:func:`cagrad.keys.sizes.tighten`). AOTAutograd's functionalization, the
decompositions' meta functions and inductor's lowerings ask ``guard_or_*``
questions of their own whose answer differs at 0 or 1; each guard kept the
other side's values out of the graph, so a mixture of experts whose
experts receive 0, 1 or more tokens recaptured per pattern under inductor
(6 captures and 2 fallbacks in 50 steps, docs/checkpointing-and-dynamic-sizes.md).

The queries below are answered by their fallback without a guard, each
because the compiled code is the same, or right, at every value the
variant accepts. Each is recognized by its code object and line, and only
while its source is one read for this (a hash, torch 2.12.1, 2.13.0 and 2.14.1;
any other source guards as before):

* ``torch._inductor.lowering.broadcast_symbolic_shapes``: its two
  ``is_size_one_or_false`` queries. On the fallback path it calls
  ``sizevars.check_equals(x, y)``, a guard here (the symbols are backed),
  and with ``x == y`` the other paths give the same size (``x``, or ``y``,
  which is equal). The broadcast shape, and so every lowering using it, is
  the same at every value the guards accept.
* ``torch._inductor.lowering.broadcast_tensors``: whether an input is
  expanded to that shape (``is_size_one_or_false`` of each size and the
  target's, compared). With the fallbacks a size is "1" only where it is
  the constant 1; each other size of an input was guarded equal to the
  target's (above), so where the answers differ the input needs the
  ``expand``, and where they agree it does not, or the ``expand`` to its
  own size is the identity.
* ``torch._inductor.ir.ExpandView``: ``_normalize_size`` asks whether an
  input size is 1 only to skip a sanity check (the sizes it returns are
  the same either way). ``create`` asks it to give the dimension stride 0;
  that query is answered without a guard only where the view's size there
  is the same expression as the input's (no broadcast in that dimension),
  because where that size is 1 the dimension's index is always 0 and its
  stride is never used; an expand of a size that may be 1 to another size
  guards as before.
* ``torch._inductor.fx_passes.joint_graph.constant_fold_uniform_value``:
  the contiguity test (C++ ``is_contiguous``, whose queries are
  ``guard_or_false(numel == 0)`` and ``guard_or_false(size == 1)``) that
  decides whether a node of one uniform value becomes a contiguous
  ``full``. With the fallbacks it is True only for strides that are the
  contiguous ones at every value (the ``*_or_false`` argument of
  :mod:`cagrad.capture.shape_env`), where the ``full`` has the node's
  layout; False only skips the folding, which is always right.
* ``FunctionalTensor.__new__`` (AOTAutograd's functionalization): the
  wrapper's ``_make_wrapper_subclass`` computes its storage's byte count
  (C++ ``computeStorageNbytes``), asking ``guard_or_false(size == 0)``
  once per size, as for the fakes ``fake_impls.constructors`` makes (same
  reasons, same recognition by stack and by order of the sizes; the
  torch versions whose C++ was observed, 2.12.1, 2.13.0 and 2.14.1).
* ``torch._prims_common.compute_elementwise_output_logical_to_physical_perm``
  (``meta_index_Tensor`` on the source restrided with zero strides, in the
  decomposition of ``index_select``'s backward): its fast path returns the
  identity where every tensor is contiguous (channels-last only for four
  dimensions). Where the probe of :mod:`cagrad.capture.shape_env` cannot
  prove the contiguity for every value, the whole function is run once
  more as a *permutation probe*: its contiguity queries answered with their
  fallbacks (False: the general path) and any other question that the
  ranges and guards so far do not decide refused. If the probe finishes,
  the general path decided nothing from the values, so it returns the same
  permutation at every value; if that permutation is the identity (no
  ambiguity flagged) and no tensor has four dimensions, the fast path, at
  the values where it applies, returns the same. Then the contiguity
  queries are answered by their fallbacks, and the real call takes the
  general path without a guard.

Every other query of a backend's compile guards as before (inductor's
``s <= 4096`` of its CPU reductions among them).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("cagrad")

# sha256 (first 16 hex digits) of the sources read, torch 2.12.1, 2.13.0 and
# 2.14.1 (2.14 changed a comment of constant_fold_uniform_value; 2.12's passes
# no pin_memory to the full it folds into, and its FunctionalTensor.__new__
# maps storages to inference-mode bases otherwise: no size query changes)
AUDITED = {
    "broadcast_symbolic_shapes": {"5357278f723a3fcb"},
    "is_size_one_or_false": {"ecd2a4066417ce24"},
    "broadcast_tensors": {"ffc0834bd11f8d04"},
    # 2.14 turned their asserts into raises
    "ExpandView._normalize_size": {"47939e7cc1d6d76c", "cbf66620cae18f93"},
    "ExpandView.create": {"5accde0d9eba114b", "cb7ddccdf741dbfe"},
    "constant_fold_uniform_value": {"add2dfc4ef1b1c52", "4b3e25230c0dcfca", "114d5788e3d0e285"},
    "FunctionalTensor.__new__": {"5c2d745d035422aa", "3461a9769a625930"},
    "compute_elementwise_output_logical_to_physical_perm": {"8f547e8cf62053bd"},
}

EXACT, WRAPPER_STORAGE, EXPAND_STRIDE = "exact", "wrapper_storage", "expand_stride"


def _source_hash(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def _audited(name: str, fn: Any) -> bool:
    if _source_hash(fn) in AUDITED[name]:
        return True
    log.info("cagrad: torch's %s is not the version read for backend size queries; its queries guard", name)
    return False


def _lines(fn: Any, needle: str, count: int) -> frozenset[int] | None:
    """The line numbers of ``fn``'s lines holding ``needle`` (None unless
    there are exactly ``count``)."""
    lines, first = inspect.getsourcelines(fn)
    numbers = frozenset(first + i for i, line in enumerate(lines) if needle in line)
    return numbers if len(numbers) == count else None


def add_sites(sites: dict[Any, tuple[str, frozenset[int] | None]], storage_ok: bool) -> Any:
    """Adds the backend compile's sites (module docstring) to ``sites``
    (``{code object: (kind, lines)}``); returns the code object of
    ``compute_elementwise_output_logical_to_physical_perm`` where its
    permutation probe may run, else None.

    ``storage_ok``: the storage-size queries of this torch's C++ were
    observed (:mod:`cagrad.capture.shape_env`).
    """
    perm_code = None
    try:
        from torch._inductor import lowering
        from torch._inductor.sizevars import SizeVarAllocator

        fn = lowering.broadcast_symbolic_shapes
        if _audited("broadcast_symbolic_shapes", fn) and _audited(
            "is_size_one_or_false", SizeVarAllocator.is_size_one_or_false
        ):
            lines = _lines(fn, "is_size_one_or_false(", 2)
            if lines is not None:
                sites[fn.__code__] = (EXACT, lines)
            tensors = inspect.unwrap(lowering.broadcast_tensors)
            if _audited("broadcast_tensors", tensors):
                for const in tensors.__code__.co_consts:
                    if inspect.iscode(const) and "is_size_one_or_false" in const.co_names:
                        sites[const] = (EXACT, None)
        from torch._inductor.ir import ExpandView

        fn = ExpandView._normalize_size
        if _audited("ExpandView._normalize_size", fn):
            lines = _lines(fn, "is_size_one_or_false(", 1)
            if lines is not None:
                sites[fn.__code__] = (EXACT, lines)
        fn = ExpandView.create.__func__
        if _audited("ExpandView.create", fn):
            lines = _lines(fn, "is_size_one_or_false(size)", 1)
            if lines is not None:
                sites[fn.__code__] = (EXPAND_STRIDE, lines)
    except Exception:  # noqa: BLE001 - no inductor: nothing to answer for it
        log.info("cagrad: reading inductor's broadcasting failed", exc_info=True)
    try:
        from torch._inductor.fx_passes import joint_graph

        fn = joint_graph.constant_fold_uniform_value
        if _audited("constant_fold_uniform_value", fn):
            lines = _lines(fn, ".is_contiguous(memory_format=torch.contiguous_format)", 1)
            if lines is not None:
                sites[fn.__code__] = (EXACT, lines)
    except Exception:  # noqa: BLE001
        log.info("cagrad: reading inductor's constant folding failed", exc_info=True)
    try:
        from torch._subclasses.functional_tensor import FunctionalTensor

        fn = FunctionalTensor.__new__
        if storage_ok and _audited("FunctionalTensor.__new__", fn):
            lines = _lines(fn, "_make_wrapper_subclass(", 1)
            if lines is not None:
                sites[fn.__code__] = (WRAPPER_STORAGE, lines)
    except Exception:  # noqa: BLE001
        log.info("cagrad: reading FunctionalTensor failed", exc_info=True)
    try:
        import torch._prims_common as common

        fn = common.compute_elementwise_output_logical_to_physical_perm
        if _audited("compute_elementwise_output_logical_to_physical_perm", fn):
            perm_code = fn.__code__
    except Exception:  # noqa: BLE001
        log.info("cagrad: reading compute_elementwise_output_logical_to_physical_perm failed", exc_info=True)
    return perm_code


def expand_keeps_size(frame: Any, replace: Callable[[Any], Any]) -> bool:
    """In an ``ExpandView.create`` frame asking whether the input's
    dimension ``size`` is 1 (to give it stride 0): whether the view's size
    there is the same expression (then the dimension's index is 0 wherever
    the size is 1, and its stride is never used)."""
    import sympy

    args = frame.f_locals
    new_size, new_stride, size = args.get("new_size"), args.get("new_stride"), args.get("size")
    if not isinstance(new_size, (list, tuple)) or not isinstance(new_stride, list) or size is None:
        return False
    j = len(new_stride)
    if j >= len(new_size):
        return False
    return replace(sympy.sympify(new_size[j])) == replace(sympy.sympify(size))


def zero_test_position(sizes: Any, expr: Any, start: int) -> int | None:
    """The position among ``sizes`` (at ``start`` or after) of the size
    whose zero test ``expr`` is, or None."""
    import sympy
    import torch

    if sizes is None or expr.is_number:
        return None
    for i in range(start, len(sizes)):
        s = sizes[i]
        if isinstance(s, torch.SymInt) and expr == sympy.Eq(s.node.expr, 0):
            return i
    return None


def wrapper_storage_sizes(frame: Any) -> Any:
    """The sizes of the tensor a ``FunctionalTensor.__new__`` frame wraps
    (its storage-size queries are about these), or None."""
    elem = frame.f_locals.get("elem")
    shape = getattr(elem, "shape", None)
    return tuple(shape) if shape is not None else None


def run_perm_probe(frame: Any, probe: Callable[[Callable[[], Any]], Any]) -> bool:
    """Whether the ``compute_elementwise_output_logical_to_physical_perm``
    call of ``frame`` returns the fast path's permutation at every value
    (module docstring). ``probe(fn)`` runs ``fn`` in the ShapeEnv's
    permutation-probe mode and returns its result, or raises."""
    import torch

    args = frame.f_locals
    tensors = args.get("tensors")
    if not isinstance(tensors, tuple) or not tensors:
        return False
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    ndim = tensors[0].ndim
    if ndim == 4 or any(t.ndim != ndim for t in tensors):
        return False
    fn = frame.f_globals.get("compute_elementwise_output_logical_to_physical_perm")
    if fn is None or fn.__code__ is not frame.f_code:
        return False
    ambiguity_check = bool(args.get("ambiguity_check", False))
    # the real call filtered and checked ``tensors`` already
    result = probe(lambda: fn(*tensors, _skip_checks=True, ambiguity_check=ambiguity_check))
    return result is not None and list(result[0]) == list(range(ndim)) and not result[1]
