"""cagrad's C++ extension: reads of torch's autograd objects that the hook
check and the hit path make on every backward, where the Python attributes
cost about ten times more.

The extension (:file:`cagrad_ext.cpp`, built by :mod:`cagrad.native.build`
on first need) provides:

* ``counts(node, all_lists)``: a node's hook lists, classified
  (:mod:`cagrad.autograd._hook_counts`); ``hookless(nodes)``: whether no
  node of a tuple has any (the hit guards' check, one call for all nodes).
* ``release(nodes)``: ``Node::release_variables()`` of each node, what the
  engine calls after running a node without ``retain_graph``
  (``call_function`` in torch/csrc/autograd/engine.cpp), about 20 ns a node.
* the hit guards' readers (:class:`MetadataReaders`, used by
  :mod:`cagrad.keys.hit_path`): a node's ``InputMetadata`` and a strided
  tensor's metadata compared against one packed integer, sizes appended to
  the guard's value list; tuples of ints and ints appended the same way;
  the order of a tuple of nodes' sequence numbers (and that none is there
  twice).
* ``reclaim(handed, owners)``: before a CUDA graph replays into the memory
  of its outputs, what was handed out of it after the last replay is dead or
  moved to new memory (:func:`reclaim_fn`); ``device_frees(device)``: how
  often the CUDA caching allocator has given memory back to the driver
  (:func:`device_frees_fn`, for a CUDA graph's early replay);
* ``walk(starts, steps, count)``: a hit guard's structure check along the
  captured dependency walk, in one call (:func:`walk_fn`);
* ``collect(nodes, program, values, tensors)``: a hit guard's checks of
  every node's attributes and metadata, as a program
  (:mod:`cagrad.native.guard_program`), in one call (:func:`collect_fn`);
* ``sole(box)``: whether a gradient in a one-item list is held by nothing
  else, so that it may become a ``.grad`` uncopied (:func:`sole_fn`);
* ``accumulate(variables, grads, stealable)``: eager's ``AccumulateGrad``
  for plain dense leaves and gradients with grad mode off (the case of every
  backward without ``create_graph``), see :func:`accumulate_fn`; and
  ``stealable(outs, aliases)``, which of a graph's outputs may become a
  ``.grad`` uncopied (:func:`cagrad.autograd.accumulate.stealable_outputs`).

Every function is compared with what the Python attributes or cagrad's
Python code give when the extension is loaded (:mod:`cagrad.native.self_tests`;
the accumulation by :mod:`cagrad.autograd.accumulate`, whose Python code it
replaces): a function that fails its self-test is not used (a warning is
logged) and its callers use Python. If the extension cannot be built
(no compiler) a warning is logged once per process and :func:`load`
returns None.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import internals
from ..preserve import preserved
from . import self_tests
from .build import build_cagrad_ext

log = logging.getLogger("cagrad")


class MetadataReaders(NamedTuple):
    """The extension's readers for the hit guards (see :func:`metadata_fns`)."""

    metadata_key: Callable[[Any, int], int | None]
    metadata: Callable[[Any, int, int, list], bool]
    tensor_key: Callable[[Any, type], int | None]
    tensor: Callable[[Any, type, int, list], bool]
    ints: Callable[[Any, int, list], bool]
    int_: Callable[[Any, list], bool]
    order: Callable[[tuple, bytes], bool]


@dataclasses.dataclass(frozen=True)
class Native:
    """The loaded extension's functions; ``metadata`` is None where a reader
    failed its self-test (``accumulate`` and ``stealable`` are self-tested
    by their user, :mod:`cagrad.autograd.accumulate`)."""

    counts: Callable[[Any, bool], Any]
    release: Callable[[Any], None]
    metadata: MetadataReaders | None
    accumulate: Callable[[list, list, list], list]
    stealable: Callable[[list, list], list]
    reclaim: Callable[[list, list], bool] | None
    hookless: Callable[[tuple], bool] | None = None
    device_frees: Callable[[int], int] | None = None
    sole: Callable[[list], bool] | None = None
    collect: Callable[[tuple, tuple, list, list], bool] | None = None
    walk: Callable[[tuple, tuple, int], tuple | None] | None = None


_lock = threading.Lock()
_native: Native | bool | None = None  # None: not tried yet; False: unavailable


def load() -> Native | None:
    """The extension, built and self-tested on first call; None where it
    cannot be built or its hook reader fails its self-test (warned once).

    The first call builds and self-tests it in a thread of its own, so the
    self-tests see none of the caller's thread-local state: not a functorch
    transform around the first backward (``torch.func.grad``, ``vmap``: a
    self-test's custom Function fails under them, which would leave the
    process without the extension), nor the caller's dispatch modes, grad
    mode or CUDA stream; the process-wide state they touch is put back
    (:func:`cagrad.preserve.preserved`).
    """
    global _native
    if _native is None:
        with _lock:
            if _native is None:
                with preserved():  # the build and self-tests leave the user's state alone
                    _native = _in_own_thread(_load) or False
    return _native or None


def _in_own_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run in a new thread (joined); its exception is re-raised here."""
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller)
            error.append(e)

    thread = threading.Thread(target=target, name="cagrad-native-load", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _load() -> Native | None:
    try:
        module = build_cagrad_ext()
        self_tests.counts(module.counts)
        self_tests.release(module.release)
    except Exception as e:  # noqa: BLE001  (no compiler, a compile or load error)
        # as text: a log record that kept the exception would keep the
        # frames of the backward that loaded the extension (and its saved
        # tensors) alive
        detail = getattr(e, "stderr", None) or str(e)
        internals.report("native_extension", f"{type(e).__name__}: {detail}")
        log.warning(
            "cagrad cannot detect hooks added from C++ (%s: %s): they would not run in compiled backwards; "
            "install a C++ compiler to enable the check",
            type(e).__name__,
            detail,
        )
        return None
    internals.report("native_extension", None)
    metadata = None
    try:
        metadata = MetadataReaders(
            module.metadata_key, module.metadata, module.tensor_key, module.tensor, module.ints, module.int_,
            module.order,
        )
        self_tests.metadata(metadata)
    except Exception as e:  # noqa: BLE001  (guards read the metadata in Python then)
        metadata = None
        log.warning("cagrad's C++ metadata reader failed its self-test (%s); hit guards read it in Python", str(e))
    reclaim = _tested(module.reclaim, self_tests.reclaim, "reclaim of CUDA-graph outputs", "outputs are copied")
    hookless = _tested(
        module.hookless, lambda fn: self_tests.hookless(fn, module.counts), "hookless()",
        "hit guards check hooks node by node",
    )  # fmt: skip
    sole = _tested(module.sole, self_tests.sole, "sole()", "segmented runs copy gradients into .grad")
    collect = None
    if metadata is not None:  # its reference runs through the readers
        collect = _tested(
            module.collect, lambda fn: self_tests.collect(fn, metadata), "collect()", "hit guards check in Python"
        )
    walk = _tested(module.walk, self_tests.walk, "walk()", "hit guards walk the graph in Python")
    return Native(
        module.counts, module.release, metadata, module.accumulate, module.stealable, reclaim, hookless,
        module.device_frees, sole, collect, walk,
    )


def _tested(fn: Callable[..., Any], self_test: Callable[[Any], None], name: str, instead: str) -> Any:
    """``fn`` if ``self_test(fn)`` passes, else None with a warning saying
    what cagrad does ``instead`` (its Python)."""
    try:
        self_test(fn)
    except Exception as e:  # noqa: BLE001  (its callers use Python then)
        log.warning("cagrad's C++ %s failed its self-test (%s); %s", name, str(e), instead)
        return None
    return fn


def hookless_fn() -> Callable[[tuple], bool] | None:
    """``hookless(nodes) -> bool``: whether ``counts(node, True)`` is None
    for every node of the tuple (no live hook of any kind on any of them),
    in one call; None if unavailable.

    Raises (the returned function):
        TypeError: ``nodes`` is not a tuple, or an item is not an autograd node.
    """
    native = load()
    return native.hookless if native is not None else None


def collect_fn() -> Callable[[tuple, tuple, list, list], bool] | None:
    """The C++ ``collect(nodes, program, values, tensors) -> bool``, or None
    if unavailable (then the hit guards run a Python line per check).

    Runs a hit guard's per-node checks, given as a program of instructions
    (:mod:`cagrad.native.guard_program` lists them and gives their Python),
    against the tuple ``nodes``; size values and lifted tensors are
    appended to the two lists as it goes. False at the first instruction
    that does not hold.

    Raises (the returned function):
        TypeError: arguments of other types.
        ValueError: a malformed instruction, or an index that names no node.
        RuntimeError: an attribute's (a saved tensor freed or modified in place).
    """
    native = load()
    return native.collect if native is not None else None


def walk_fn() -> Callable[[tuple, tuple, int], tuple | None] | None:
    """The C++ ``walk(starts, steps, count) -> tuple | None``, or None if
    unavailable (then the hit guards unpack each node's ``next_functions``).

    A hit guard's structure check: from the nodes ``starts``, along
    ``steps`` (:mod:`cagrad.native.guard_program` gives their form and their
    Python), comparing each node's edge count, input numbers, absent edges,
    the identity of nodes reached again and the type of new ones; returns
    the discovered nodes' Python objects by index, or None where the graph
    differs.

    Raises (the returned function):
        TypeError: arguments of other types.
        ValueError: malformed steps.
        RuntimeError: a node without a Python object.
    """
    native = load()
    return native.walk if native is not None else None


def metadata_fns() -> MetadataReaders | None:
    """The hit guards' C++ readers, or None if unavailable.

    ``metadata_key(node, input_nr) -> int | None`` packs what a guard compares
    of input ``input_nr``'s metadata (dtype, device, rank) into one integer;
    None for metadata it does not compare this way (nested, a symbolic size,
    no such input). ``metadata(node, input_nr, key, sizes) -> bool``: whether
    the metadata has ``key`` now; if so its sizes are appended to the list
    ``sizes``. About 60 ns a call where the Python attributes of
    ``node._input_metadata`` cost about 600 ns. ``tensor_key(x, type) -> int |
    None`` packs a strided tensor's layout, dtype, device, requires_grad and
    rank (None: ``x`` is not exactly of ``type``, not strided, nested, or
    symbolic); ``tensor(x, type, key, values) -> bool``: whether ``x`` is of
    ``type`` with ``key`` now; if so its sizes, strides and storage offset
    are appended to ``values``. ``ints(a, n, values) -> bool``: whether ``a``
    is a tuple or list of ``n`` ints; if so they are appended to ``values``
    as int64 (a value a binding handed out as uint64, 2**63 and up, is read
    back as the int64 it stores, as
    :func:`cagrad.keys.compiled_node_args._int64` does); nothing is appended
    otherwise. ``int_(a, values) -> bool``: the same for one int.
    ``order(nodes, relation) -> bool``: whether the sequence numbers of a
    tuple of nodes relate pairwise as ``relation`` says (bytes, one per
    adjacent pair: ``b"<"`` or ``b"="``), with no node there twice (the hit
    guards' check that the captured nodes are distinct objects).

    Raises (the returned functions):
        TypeError: ``node`` is not an autograd node, or another argument type.
        ValueError: ``order``'s relation has the wrong length.
    """
    native = load()
    return native.metadata if native is not None else None


def accumulate_fns() -> tuple[Callable[[list, list, list], list], Callable[[list, list], list]] | None:
    """The C++ ``(accumulate, stealable)``, or None if the extension is
    unavailable; not self-tested here (their user,
    :mod:`cagrad.autograd.accumulate`, compares them with its Python code).

    ``accumulate(variables, grads, stealable) -> list[int]``: for each ``i``
    (three lists of one length: leaf tensors, their gradients, whether each
    gradient may become ``.grad`` without a copy), with grad mode off, where
    the leaf is exactly a ``torch.Tensor`` or ``nn.Parameter`` and the
    gradient exactly a ``torch.Tensor``, both strided and not nested, of one
    dtype, device and shape, the gradient not requiring grad, and ``.grad``
    unset or strided: what ``AccumulateGrad::accumulateGrad``
    (torch/csrc/autograd/functions/accumulate_grad.h) does without
    ``create_graph``. ``.grad`` unset: the gradient becomes ``.grad`` where
    stealable and it obeys the gradient layout contract (torch's
    ``obeys_layout_contract``), else a copy laid out by it
    (``clone_obey_contract``); ``.grad`` set: added in place. A leaf that no
    longer requires grad is skipped. Returns the indices it left to the
    caller (every other case).

    ``stealable(outs, aliases) -> list[bool]``: for each output tensor,
    ``not aliases[i]`` and no earlier output has the same storage data
    pointer (:func:`cagrad.autograd.accumulate.stealable_outputs`).

    Raises (the returned functions):
        TypeError: not lists of one length, or an output not a tensor.
        RuntimeError: torch's (the in-place add; a tensor without a data
            pointer).
    """
    native = load()
    return (native.accumulate, native.stealable) if native is not None else None


def sole_fn() -> Callable[[list], bool] | None:
    """The C++ ``sole(box) -> bool``, or None if unavailable (then a
    segmented run copies every gradient it accumulates, as before).

    ``box`` is a list of one item; True when that item is a tensor held by
    nothing but the list: its only Python reference is the list's, its
    TensorImpl's only reference is that Python object's, and no other
    tensor shares its memory. Such a gradient may become a leaf's ``.grad``
    without a copy (eager's AccumulateGrad checks the TensorImpl's
    ``use_count``; a shared memory is refused here besides).

    Raises (the returned function):
        TypeError: ``box`` is not a list of one item.
    """
    native = load()
    return native.sole if native is not None else None


def reclaim_fn() -> Callable[[list, list], bool] | None:
    """The C++ ``reclaim(handed, owners) -> bool``, or None if unavailable
    (then :mod:`cagrad.compile.cuda_graphs` hands out no memory of a graph).

    ``handed[i]`` is an alias (``detach()``) of a CUDA graph's output
    ``owners[i]`` handed out after its last replay. Each alias that only the
    list refers to is dead; each live one (a leaf's ``.grad``) gets a copy of
    its data in new memory through ``set_`` on its own TensorImpl, which every
    holder sees (one whose elements share memory, an expanded gradient,
    gets a copy of its storage span read through its own strides).
    Returns False, and moves no more, where a live alias's memory
    is also held by a tensor outside the two lists (a view made of it): the
    graph must not replay then.

    Raises (the returned function):
        TypeError: not two lists of one length (items that are not tensors
            are skipped).
        RuntimeError: torch's, from the copy.
    """
    native = load()
    return native.reclaim if native is not None else None


_frees_checked: Callable[[int], int] | bool | None = None  # None: not compared yet; False: failed


def device_frees_fn() -> Callable[[int], int] | None:
    """``device_frees(device) -> int``: the CUDA caching allocator's count of
    memory given back to the driver on ``device`` (an index), its
    ``DeviceStats.num_device_free`` (``torch.cuda.memory_stats()
    ["num_device_free"]``: ``cudaFree`` calls and pages of expandable
    segments unmapped) in about 0.3 us where ``memory_stats`` builds a dict
    of every statistic. None if unavailable: no extension, CUDA not in use,
    an allocator other than the native one (``cudaMallocAsync`` returns
    memory to the driver on its own terms), or a first call that disagrees
    with ``memory_stats`` (warned once).

    Raises (the returned function):
        RuntimeError: torch's, for a device without an allocator.
    """
    global _frees_checked
    if _frees_checked is None:
        if not torch.cuda.is_initialized():
            return None  # asked again once CUDA is in use
        native = load()
        fn = native.device_frees if native is not None else None
        ok = False
        try:
            if fn is not None and torch.cuda.get_allocator_backend() == "native":
                device = torch.cuda.current_device()
                ok = fn(device) == torch.cuda.memory_stats(device).get("num_device_free")
                if not ok:
                    log.warning("cagrad's C++ device_frees() disagrees with torch.cuda.memory_stats(); no early replays")
        except Exception as e:  # noqa: BLE001  (CUDA graphs replay after their guard then)
            log.warning("cagrad's C++ device_frees() failed (%s); no early replays", str(e))
        if not ok:
            _frees_checked = False
            return None
        _frees_checked = fn
    return _frees_checked or None
