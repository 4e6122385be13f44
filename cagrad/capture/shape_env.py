"""The ShapeEnv of a symbolic trace: sizes of 0 and 1 as symbols.

torch's ShapeEnv specializes 0 and 1 (``specialize_zero_one``): a size that
is 0 or 1 when its symbol is made becomes a constant, and every symbol gets
the range ``[2, inf]``. For sizes that change from backward to backward (a
mixture of experts whose router sends an expert no token, one, or many)
that meant one capture per pattern of which sizes were 0, 1 or more, up to
``too_many_size_variants``. The slots that changed since the first capture
are therefore traced with symbols that may be 0 or 1 (:func:`create_symbol`,
range ``[0, inf]``, without sympy's ``positive`` assumption; ``[1, inf]``
with 0 specialized where the storage-size site below is not recognized).

With those symbols the trace asks many questions whose answer differs at 1
(``Ne(s, 1)``, ``s*d >= 2``), nearly all through torch's
``guard_or_false``/``guard_or_true``, which guard on the hint's answer for
a symbol with a hint. Each guard keeps the values on the other side out of
the graph, so the symbols split again. :class:`TraceShapeEnv` answers the
``guard_or_*`` queries of a few torch functions without a guard, each for a
reason that makes the graph, its sizes and the fake tensors' strides the
same as with the guard at every value the variant's check accepts:

* ``torch.fx.passes.shape_prop._extract_tensor_metadata``: the answers only
  fill ``node.meta["tensor_meta"]`` (contiguity and memory-format flags;
  the query's fallback there means "not known", as torch's own
  ``backed_size_oblivious`` answers); the ops, their arguments and
  ``meta["val"]`` do not depend on them.
* ``torch._prims_common.is_contiguous_for_memory_format_or_false``: an
  ``*_or_false`` function returns True only for what holds at every value
  when each undecided query gets its fallback (that is what makes it sound
  for torch's unbacked sizes). So it is first run as a *probe* with every
  undecided query answered by its fallback and any other guard refused;
  where the probe returns True, the real call gets the same answers (no
  guard) and returns True, which holds at every value; else the real call
  guards as before and returns the hint's answer, which the guards keep.
* ``torch._refs._broadcast_shapes``, ``torch._subclasses.fake_impls.
  infer_size`` (the broadcast shape of the binary ops' fast path) and the
  two broadcast-dimension queries of ``torch._prims._broadcast_in_dim_meta``
  (is the size 1; is it the target size): on the fallback path each adds
  ``torch._check(a == b)`` (a guard here) where it assumes that two sizes
  are equal, and with them equal the other path gives the same shape or
  stride. ``should_expand`` in ``torch._refs._maybe_broadcast``: either it
  checks ``a == b`` the same way, or its fallback asks for an ``expand``
  that the other path would skip, and ``expand`` of a tensor to its own
  shape keeps its sizes and strides (the broadcast-dimension queries
  above, and ATen's ``expand``). The new-dimension query of
  ``_broadcast_in_dim_meta`` (stride 0 for a new dimension of size 1, where
  the other path gives another stride) is not one of them: it guards.
* Sizes of 0. ``fake_impls.constructors`` running ``aten.empty_strided``
  on the meta device (every lifted tensor's fake, and the outputs that meta
  functions make with ``empty_strided``): its C++ (``computeStorageNbytes``
  in aten/src/ATen/EmptyTensor.cpp, through ``empty_strided_symint_meta``)
  asks ``guard_or_false(size == 0)`` once per size, in order, to return a
  byte count of 0 early; the fallback computes the strided formula, which
  differs from 0 at 0 only for layouts with gaps or zero strides. The
  answer is only the meta storage's byte count: the fake's sizes, strides,
  offset, dtype and device are the ones passed either way, and the meta
  allocator ignores the count. A fake's storage size is no real one anyway
  (a lifted view's real storage is its base's), nothing in the trace reads
  it for the graph, and hooks cannot reach storages (``untyped_storage``,
  ``set_`` and ``resize_`` are refused in traced hooks). Recognized by the
  stack (the query reaches ``SymNode.guard_or_false`` straight from the C++
  of the ``OpOverload.__call__`` that ``constructors`` makes for
  ``empty_strided``), by the expression (``Eq(size, 0)`` of one of the
  call's sizes, each at most once and in order: a further query guards),
  by the source of ``constructors`` and, the C++ not being readable from
  Python, by the torch version (2.12.1, 2.13.0, 2.14.1: on each the query was seen
  to come once per symbolic size through ``SymNode.guard_or_false``, and
  nothing else is asked from that call).
* ``scatter_gather_dtype_check`` and ``scatter_shape_check`` of
  ``torch._meta_registrations`` (``scatter_add``'s meta, the backward of
  ``gather``): whether the index is empty only decides whether checks run
  (the index's dtype; index sizes no larger than the others'). Both
  functions return nothing; the fallback runs the checks, which either
  pass (the dtype is no symbol; a size check that depends on the values
  is a ``torch._check``, a guard here) or raise, and the trace fails into
  a counted fallback.

The compiler turns this on (``answer_queries``) only for a trace with a
symbol that may be 1 and no node of more than one input: the number of a
node's inputs can follow a size (the outputs of ``x.split(1)``) without a
key field for it, and the contiguity guards of ``tensor_meta`` were what
pinned such a size (docs/checkpointing-and-dynamic-sizes.md).

Each function is recognized by its code object, and only while its source
is one of the versions read for this (torch 2.12.1, 2.13.0 and 2.14.1: a hash of
the source of it and of the functions it calls); with any other source it
guards as before, so a torch that changed one of them costs captures, not
correctness (a torch whose storage-size site is not recognized keeps 0
specialized: with symbols that may be 0, every fake would guard
``Ne(s, 0)``). A backend compiling the graph (AOTAutograd, inductor) asks
in the same ShapeEnv; the queries of its own answered without a guard, and
why, are in :mod:`cagrad.capture.backend_queries`. Every other query (fake
kernels' output strides, C++ autograd formulas, cagrad's own code) guards
as before. torch's
``backed_size_oblivious`` is not used: it answers every such query by its
fallback, which takes the general branch where eager would branch on a
size of 1 (``squeeze``, broadcasting, layouts), a silent difference.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import sympy

from .. import internals
from . import backend_queries

log = logging.getLogger("cagrad")

_SYMBOLIC = "torch.fx.experimental.symbolic_shapes"
ShapeEnv = internals.import_attr("fake_tensor_capture", _SYMBOLIC, "ShapeEnv")
DimDynamic = internals.import_attr("fake_tensor_capture", _SYMBOLIC, "DimDynamic")

# sha256 (first 16 hex digits) of the sources read for the module docstring,
# per function, in torch 2.12.1, 2.13.0 and 2.14.1 (2.14 changed a comment of
# _broadcast_shapes; 2.12's constructors also refuses named tensors)
_AUDITED = {
    "_extract_tensor_metadata": None,  # any source: its results are metadata
    "_broadcast_shapes": {"c3cb6eddc6fdcdb2", "19c3eba9fcaac2f8"},
    "_maybe_broadcast": {"9d63ec7ef7d2f6d7"},
    "infer_size": {"9cd1699ff3093887"},
    "_broadcast_in_dim_meta": {"b1f82204db3830a3"},
    "is_contiguous_for_memory_format_or_false": {"ef05bf3b858e3098"},
    "is_contiguous_for_memory_format": {"6dc8b99bf2613652"},
    "is_contiguous": {"84b17cdf34b996fa"},
    "check_contiguous_sizes_strides": {"eba4d232cddd0629"},
    "is_channels_last_contiguous_2d": {"722c95692d6dee32"},
    "is_channels_last_contiguous_3d": {"16debccc6924701b"},
    "constructors": {"d642508a9a6d67fb", "253421596250a31a", "8f9222721df32f5e"},
    "scatter_gather_dtype_check": {"1abe3a85b5fe5a9f"},
    "scatter_shape_check": {"d8ce544e9a77b6c0"},
}

# the C++ storage-size computation (computeStorageNbytes in
# aten/src/ATen/EmptyTensor.cpp) cannot be hashed: it was read for these
# torch versions only
_AUDITED_CPP = ("2.12.1", "2.13.0", "2.14.1")

# the two queries of _broadcast_in_dim_meta answered without a guard
_BROADCAST_DIM_QUERIES = (
    "guard_or_false(a.shape[original_idx] == 1)",
    "guard_or_false(a.shape[original_idx] == shape[idx])",
)

# the empty-index queries of the scatter meta functions' checks
_SCATTER_QUERIES = {
    "scatter_gather_dtype_check": ("guard_or_true(index.numel() != 0)",),
    "scatter_shape_check": ("guard_or_false(index.numel() == 0)",),
}

METADATA, EXACT, PROBE, STORAGE = "metadata", "exact", "probe", "storage"


def _source_hash(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def _audited(fns: dict[str, Any]) -> bool:
    for name, fn in fns.items():
        want = _AUDITED[name]
        if want is not None and _source_hash(fn) not in want:
            log.info("cagrad: torch's %s is not the version read for sizes of 1; its queries guard", name)
            return False
    return True


def _add_lines(sites: dict[Any, tuple[str, frozenset[int] | None]], fn: Any, queries: tuple[str, ...]) -> None:
    """Makes ``fn`` an ``EXACT`` site for the lines of ``queries`` (each
    found once)."""
    lines, first = inspect.getsourcelines(fn)
    numbers = frozenset(first + i for i, line in enumerate(lines) if any(q in line for q in queries))
    if len(numbers) == len(queries):
        sites[fn.__code__] = (EXACT, numbers)


def _sites() -> tuple[dict[Any, tuple[str, frozenset[int] | None]], Callable[..., Any] | None]:
    """``{code object: (kind, lines or None)}`` of the functions whose
    queries are answered without a guard, and the probed function."""
    sites: dict[Any, tuple[str, frozenset[int] | None]] = {}
    probe = None
    try:
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        sites[_extract_tensor_metadata.__code__] = (METADATA, None)
    except Exception:  # an unknown torch: nothing is answered without a guard
        return {}, None
    try:
        import torch._prims as prims
        import torch._prims_common as common
        import torch._refs as refs

        if _audited({"_broadcast_shapes": refs._broadcast_shapes, "_maybe_broadcast": refs._maybe_broadcast}):
            sites[refs._broadcast_shapes.__code__] = (EXACT, None)
            for const in refs._maybe_broadcast.__code__.co_consts:
                if inspect.iscode(const) and const.co_name == "should_expand":
                    sites[const] = (EXACT, None)
        from torch._subclasses import fake_impls

        if _audited({"infer_size": fake_impls.infer_size}):
            sites[fake_impls.infer_size.__code__] = (EXACT, None)
        if _storage_site_audited():
            sites[fake_impls.constructors.__code__] = (STORAGE, None)
        meta = prims._broadcast_in_dim_meta
        if _audited({"_broadcast_in_dim_meta": meta}):
            _add_lines(sites, meta, _BROADCAST_DIM_QUERIES)
        import torch._meta_registrations as metas

        for name, queries in _SCATTER_QUERIES.items():
            fn = getattr(metas, name)
            if _audited({name: fn}):
                _add_lines(sites, fn, queries)
        names = (
            "is_contiguous_for_memory_format_or_false",
            "is_contiguous_for_memory_format",
            "is_contiguous",
            "check_contiguous_sizes_strides",
            "is_channels_last_contiguous_2d",
            "is_channels_last_contiguous_3d",
        )
        if _audited({name: getattr(common, name) for name in names}):
            probe = common.is_contiguous_for_memory_format_or_false
            sites[probe.__code__] = (PROBE, None)
    except Exception:  # any failure leaves the sites found so far
        log.info("cagrad: reading torch's broadcasting and contiguity functions failed", exc_info=True)
    global _PERM_CODE
    storage_ok = any(kind == STORAGE for kind, _ in sites.values())
    _PERM_CODE = backend_queries.add_sites(sites, storage_ok) if probe is not None else None
    return sites, probe


def _storage_site_audited() -> bool:
    import torch
    from torch._subclasses import fake_impls

    if torch.__version__.split("+")[0] not in _AUDITED_CPP:
        log.info("cagrad: torch %s's storage-size computation was not read; sizes of 0 stay specialized", torch.__version__)
        return False
    return _audited({"constructors": fake_impls.constructors})


_SITES: dict[Any, tuple[str, frozenset[int] | None]] | None = None
_PROBED: Callable[..., Any] | None = None
# compute_elementwise_output_logical_to_physical_perm's code object where its
# permutation probe may run (cagrad.capture.backend_queries)
_PERM_CODE: Any = None

# frames searched above ShapeEnv.evaluate_expr for one of the sites (the
# deepest chain, _extract_tensor_metadata -> ... -> evaluate_expr, is 8)
_MAX_DEPTH = 24


def zero_one_symbols() -> bool:
    """Whether slots that changed are traced as symbols that may be 1 (this
    torch has at least the metadata function; without it such a symbol
    would split on the metadata's guards anyway)."""
    _load()
    return bool(_SITES) and not isinstance(ShapeEnv, internals.Missing)


def zero_symbols() -> bool:
    """Whether those symbols may be 0 too: this torch's storage-size
    computation and ``fake_impls.constructors`` are the ones read for it
    (module docstring)."""
    _load()
    return zero_one_symbols() and any(kind == STORAGE for kind, _ in _SITES.values())


def create_symbol(env: Any, value: int, source: Any, zero_one: bool) -> Any:
    """A symbol of ``env`` for a size slot of ``value`` (``DYNAMIC``: no
    duck sizing, the caller does that), or the constant a specialized value
    becomes.

    ``zero_one``: a value of 0 or 1 is a symbol too
    (``do_not_specialize_zero_one``), of range ``[0, inf]`` where
    :func:`zero_symbols` holds, else ``[1, inf]`` (0 specialized). A symbol
    that may be 0 is made without sympy's ``positive`` assumption, which
    torch's backed size symbols carry and with which sympy decides
    ``Eq(s, 0)`` (and ``6*s < 2``) to be False on its own, wrongly at 0;
    without it every such question is a guard (or one of the queries the
    module docstring lists). Else: torch's default (0 and 1 specialized,
    range ``[2, inf]``).
    """
    from torch.utils._sympy.numbers import int_oo

    if zero_one and zero_symbols():
        sym = env.create_symbol(
            value, source, dynamic_dim=DimDynamic.DYNAMIC, positive=None, do_not_specialize_zero_one=True
        )
        env.constrain_symbol_range(sym, 0, int_oo)
        return sym
    if not zero_one or value == 0:
        return env.create_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC)
    sym = env.create_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC, do_not_specialize_zero_one=True)
    env.constrain_symbol_range(sym, 1, int_oo)
    return sym


def _storage_size_query(ctor: Any, called: Any, expr: Any, start: int) -> int | None:
    """The position among the sizes of the ``aten.empty_strided`` that
    ``fake_impls.constructors`` (frame ``ctor``) runs on the meta device
    whose zero test ``expr`` is, at ``start`` or after; None if the query is
    not one of them or not asked by the C++ of that call (``called``, the
    frame below ``ctor``, is ``OpOverload.__call__``, and the query came from
    C++ straight into ``SymNode.guard_or_false``).

    In the sources read (module docstring) these are the zero tests of
    ``computeStorageNbytes``, asked once per size in order; their answers
    only pick the meta storage's byte count (0, or the strided formula).
    The fake tensor's sizes, strides, offset, dtype and device are the same
    either way. A query past the last size (or one asked twice) guards.
    """
    import torch
    from torch._ops import OpOverload

    empty_strided = torch.ops.aten.empty_strided.default
    if expr.is_number or called is None or called.f_code is not OpOverload.__call__.__code__:
        return None
    if called.f_locals.get("self") is not empty_strided or ctor.f_locals.get("func") is not empty_strided:
        return None
    if not _asked_from_cpp(called):
        return None
    sizes = (ctor.f_locals.get("new_kwargs") or {}).get("size")
    if not isinstance(sizes, (list, tuple)):
        return None
    return backend_queries.zero_test_position(sizes, expr, start)


def _asked_from_cpp(called: Any) -> bool:
    """Whether the innermost ``SymNode.guard_or_false`` frame of the
    current stack was called from C++ inside ``called`` (its Python caller
    is ``called`` itself)."""
    from torch.fx.experimental.sym_node import SymNode

    frame = sys._getframe(1)
    target = SymNode.guard_or_false.__code__
    for _ in range(_MAX_DEPTH):
        if frame is None or frame is called:
            return False
        if frame.f_code is target:
            return frame.f_back is called
        frame = frame.f_back
    return False


def _load() -> None:
    global _SITES, _PROBED
    if _SITES is None:
        _SITES, _PROBED = _sites()


class _ProbeRefused(Exception):
    """A probe asked for a guard (it answers only ``guard_or_*`` queries)."""


def trace_shape_env() -> Any:
    """A fresh :class:`TraceShapeEnv`."""
    return _trace_shape_env_class()()


_cls: Any = None


def _trace_shape_env_class() -> Any:
    global _cls
    if _cls is None:
        _load()

        class TraceShapeEnv(ShapeEnv):  # type: ignore[misc, valid-type]
            """A ShapeEnv that answers the ``guard_or_*`` queries of the
            functions in the module docstring without a guard, where
            ``answer_queries`` is set.

            Attributes:
                answer_queries: whether to (else every query guards, as in
                    torch's ShapeEnv).
                unguarded: how many queries it answered without a guard
                    that the symbols' ranges did not decide.
            """

            unguarded = 0
            # set by the compiler: off, it is torch's ShapeEnv
            answer_queries = False
            _probing = False
            # in a permutation probe (cagrad.capture.backend_queries)
            _perm_probing = False
            # the outermost permutation frame probed and its verdict
            _perm_probed: tuple[Any, bool] | None = None
            _perm_root: Any = None
            # the outermost probed frame and whether its probe returned
            # True (the frame is kept, so that its id is not reused)
            _probed: tuple[Any, bool] | None = None
            # the OpOverload.__call__ frame of the empty_strided whose
            # storage-size queries are being answered, and the position of
            # the next size
            _storage_call: tuple[Any, int] | None = None

            def evaluate_expr(
                self,
                orig_expr: Any,
                hint: Any = None,
                fx_node: Any = None,
                size_oblivious: bool = False,
                fallback_value: bool | None = None,
                *,
                forcing_spec: bool = False,
            ) -> Any:
                if self._probing:
                    if fallback_value is None:
                        raise _ProbeRefused(str(orig_expr))
                    return self._fallback(orig_expr, fallback_value)
                if self._perm_probing:
                    return self._perm_probe_answer(sys._getframe(1), orig_expr, fallback_value)
                if (
                    fallback_value is not None
                    and self.answer_queries
                    and _SITES
                    and self._without_guard(sys._getframe(1), orig_expr)
                ):
                    return self._fallback(orig_expr, fallback_value)
                return super().evaluate_expr(
                    orig_expr, hint, fx_node, size_oblivious, fallback_value, forcing_spec=forcing_spec
                )

            def _fallback(self, expr: Any, fallback_value: bool) -> Any:
                known = self._maybe_evaluate_static(expr)
                if known is not None:
                    return known
                self.unguarded += 1
                return sympy.true if fallback_value else sympy.false

            def _without_guard(self, frame: Any, expr: Any) -> bool:
                """Whether the query asked from ``frame``'s stack is one of
                the sites (module docstring)."""
                first = None
                probed_frame = below = None
                for _ in range(_MAX_DEPTH):
                    if frame is None:
                        break
                    site = _SITES.get(frame.f_code)
                    if site is not None:
                        kind, lines = site
                        if kind == METADATA:
                            return True
                        if first is None:
                            first = (kind, lines, frame, below)
                        if kind == PROBE:
                            probed_frame = frame  # the outermost one wins
                    below, frame = frame, frame.f_back
                if first is None:
                    return False
                kind, lines, at, called = first
                if kind == STORAGE:
                    start = self._storage_call[1] if self._storage_call and self._storage_call[0] is called else 0
                    i = _storage_size_query(at, called, expr, start)
                    if i is None:
                        return False
                    self._storage_call = (called, i + 1)  # the frame is kept: its id is not reused
                    return True
                if kind == backend_queries.WRAPPER_STORAGE:
                    if at.f_lineno not in lines or not _asked_from_cpp(at):
                        return False
                    start = self._storage_call[1] if self._storage_call and self._storage_call[0] is at else 0
                    i = backend_queries.zero_test_position(backend_queries.wrapper_storage_sizes(at), expr, start)
                    if i is None:
                        return False
                    self._storage_call = (at, i + 1)
                    return True
                if kind == EXACT:
                    return lines is None or at.f_lineno in lines
                if kind == backend_queries.EXPAND_STRIDE:
                    return at.f_lineno in lines and backend_queries.expand_keeps_size(at, self.replace)
                if self._probe(probed_frame):
                    return True
                caller = probed_frame.f_back
                return _PERM_CODE is not None and caller is not None and caller.f_code is _PERM_CODE and (
                    self._perm_probe(caller)
                )

            def _perm_probe(self, frame: Any) -> bool:
                if self._perm_probed is not None and self._perm_probed[0] is frame:
                    return self._perm_probed[1]

                def probe(fn: Callable[[], Any]) -> Any:
                    try:
                        self._perm_probing = True
                        # the frames above this one (the real call's
                        # contiguity query among them) are not the probe's
                        self._perm_root = sys._getframe()
                        return fn()
                    except _ProbeRefused:
                        return None
                    finally:
                        self._perm_probing = False
                        self._perm_root = None

                proven = backend_queries.run_perm_probe(frame, probe)
                self._perm_probed = (frame, proven)
                return proven

            def _perm_probe_answer(self, frame: Any, expr: Any, fallback_value: bool | None) -> Any:
                """In a permutation probe: the contiguity queries get their
                fallbacks; any other question the ranges and guards so far
                do not decide is refused."""
                if fallback_value is not None and _PROBED is not None:
                    target = _PROBED.__code__
                    for _ in range(_MAX_DEPTH):
                        if frame is None or frame is self._perm_root:
                            break
                        if frame.f_code is target:
                            return self._fallback(expr, fallback_value)
                        frame = frame.f_back
                known = self._maybe_evaluate_static(expr)
                if known is None:
                    raise _ProbeRefused(str(expr))
                return known

            def _probe(self, frame: Any) -> bool:
                if self._probed is not None and self._probed[0] is frame:
                    return self._probed[1]
                args = frame.f_locals
                try:
                    self._probing = True
                    proven = _PROBED(args["a"], memory_format=args["memory_format"]) is True
                except _ProbeRefused:
                    proven = False
                finally:
                    self._probing = False
                self._probed = (frame, proven)
                return proven

            def forget_probe(self) -> None:
                """Drops the kept frames (at the end of a trace, and of each
                backend compile that asked this ShapeEnv): a frame kept
                keeps its locals alive, its callers' frames and theirs."""
                self._probed = None
                self._perm_probed = None
                self._storage_call = None

        _cls = TraceShapeEnv
    return _cls
