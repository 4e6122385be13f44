"""Which hooks are traced into the graph, and the fingerprint that keys them.

A tensor pre-hook (``Tensor.register_hook``), node pre-hook
(``grad_fn.register_prehook``: ``hook(grad_outputs)``) or node post-hook
(``grad_fn.register_hook``: ``hook(grad_inputs, grad_outputs)``) runs, by
default, as an opaque call: the graph is cut there and the hook runs in
Python with the backward's own objects. A hook that is a *pure tensor
function of its gradients* can instead be traced into the graph like a
backward formula, where eager's engine calls it
(:class:`cagrad.autograd.walk.BackwardWalk`), so the backward compiles as one
graph (as torch's compiled autograd does when Dynamo inlines a hook). A
node's hook dict is traced when every hook in it is accepted; a post-hook
dict only on a node whose formula is traced (a node run as it is hands the
gradients of unused edges to its post-hooks unseen). "Pure" cannot be proven for Python in general; this module
accepts a narrow class it can check from the hook's code, and everything
else stays opaque, which is always correct:

* a plain Python function (not a bound method, ``functools.partial`` or a
  callable object), not a generator, with no nested function, class or
  comprehension, and no ``try``;
* its bytecode only loads and stores locals, reads globals and its closure,
  calls, does arithmetic, comparisons, subscripts, jumps and loops: no
  ``STORE_GLOBAL``, ``STORE_ATTR``, ``STORE_SUBSCR``, ``STORE_DEREF``,
  ``DELETE_*``, ``IMPORT_*``, and no in-place operator (``g += 1``);
* no call passes ``requires_grad=`` (a factory that makes a tensor record
  history: the flag is set after the op, outside what a trace records; a
  custom backward returning ``torch.ones_like(g, requires_grad=True) * 3``
  under ``create_graph=True`` gave a ``.grad`` without history);
* no attribute it reads names an in-place method (``mul_``), something
  private (``_foo``), random sampling, or a side-effecting namespace or
  method (``distributed``, ``cuda``, ``register_hook``, ``data``, ``grad``,
  ``item``, ``save``, ... see :data:`_DENIED_ATTRS`), or a functorch
  transform (``torch.func``, ``torch.vmap``: its backward runs in eager);
* every global it reads is one of the modules in :data:`_MODULES`, a
  builtin in :data:`_BUILTINS`, a function or class of those modules, a
  dtype, or a constant (None, bool, int, float, complex, str, dtype,
  device, or tuples of those); every closure cell and default value is a
  constant or one of those objects.

Tensor values never steer a trace: under fake tensors a hook that branches
on a value (``if g.norm() > 1``) fails to trace, and the hook then runs
opaque (:meth:`cagrad.capture.opaque_calls.OpaqueCalls.opaque`).

The **fingerprint** of such a hook goes into the node's CacheKey: a
sha256 over its code (bytecode, constants, names, argument counts and
flags) and the values of the globals, closure cells and defaults it reads
(modules and functions by qualified name, constants by type and value), so
a hook recreated every step (``t.register_hook(lambda g: g * s)``) keeps
hitting while a changed ``s`` recaptures. It depends on the Python version
(bytecode) but on no address or hash seed, so keys stay deterministic.

The checker (:func:`analyze`, :func:`outside_texts`, :func:`digest`) is
shared with :mod:`cagrad.hooks.backward_tracing`, which applies it to custom
``autograd.Function`` backwards.

A hook dict is traced only when it runs before any other code of the
user's in the backward's run order (untraceable tensor or node hooks,
post-accumulate-grad hooks, custom Functions run opaque or nodes run as
they are): such code could change a hook dict after the key was read, but
only the dicts that run after it matter, and those run opaque
(:meth:`cagrad.keys.compiled_node_args.Collector.finish`).
"""

from __future__ import annotations

import builtins
import dis
import hashlib
import inspect
import math
import operator
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional

FINGERPRINT_BYTES = 8  #: digest bytes written into the key

#: modules a traced hook may read as globals (by identity)
_MODULES = frozenset(
    {torch, torch.nn.functional, torch.special, torch.linalg, torch.fft, math, operator}
)
#: modules whose functions a traced hook may read (the ones above and the
#: C modules torch's functions are defined in)
_FUNCTION_MODULES = frozenset(m.__name__ for m in _MODULES) | {
    "torch._C._VariableFunctions", "torch.functional", "torch._C._nn", "torch._C._special",
    "torch._C._linalg", "torch._C._fft",
}

#: builtins a traced hook may call (pure on tensors and Python numbers)
_BUILTINS = frozenset(
    getattr(builtins, n)
    for n in (
        "abs", "min", "max", "float", "int", "bool", "len", "isinstance", "range",
        "tuple", "list", "round", "sum", "pow", "slice", "enumerate", "zip", "divmod",
    )
)

_DENIED_ATTRS = frozenset(
    {
        "distributed", "cuda", "mps", "xpu", "backends", "autograd", "utils", "ops", "library",
        "compiler", "profiler", "distributions", "jit", "fx", "hub", "testing", "overrides",
        "func", "vmap",  # functorch transforms (torch.func.*, torch.vmap): eager runs them
        "save", "load", "data", "grad", "register_hook", "register_post_accumulate_grad_hook",
        "retain_grad", "backward", "item", "tolist", "numpy", "storage", "untyped_storage",
        "data_ptr", "record_stream", "manual_seed", "seed", "initial_seed", "get_rng_state",
        "share_memory_", "pin_memory", "apply_", "map_", "print", "detach_", "requires_grad_",
        "resize_", "set_", "copy_", "zero_", "fill_",
    }
)
_DENIED_PREFIXES = ("set_", "use_", "enable", "disable", "register", "manual_", "load", "save",
                    "compile", "synchronize", "empty_cache")
# random sampling: names that start with "rand", contain "dropout", or are these
_RANDOM = frozenset({"bernoulli", "normal", "multinomial", "poisson", "rrelu", "gumbel_softmax",
                     "channel_shuffle", "native_channel_shuffle", "binomial"})

#: opcodes of the accepted class (Python 3.10 to 3.13 spellings)
_OPCODES = frozenset(
    {
        "RESUME", "NOP", "CACHE", "EXTENDED_ARG", "COPY_FREE_VARS", "PUSH_NULL", "POP_TOP",
        "COPY", "SWAP", "ROT_TWO", "ROT_THREE", "DUP_TOP", "DUP_TOP_TWO",
        "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW",
        "LOAD_FAST_BORROW_LOAD_FAST_BORROW", "STORE_FAST", "STORE_FAST_LOAD_FAST",
        "STORE_FAST_STORE_FAST", "LOAD_CONST", "LOAD_SMALL_INT", "RETURN_VALUE", "RETURN_CONST",
        "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_ATTR", "LOAD_METHOD", "PRECALL", "CALL", "CALL_KW",
        "KW_NAMES", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_METHOD", "CALL_FUNCTION_EX",
        "BINARY_OP", "BINARY_SUBSCR", "BINARY_SLICE", "BUILD_SLICE", "BUILD_TUPLE", "BUILD_LIST",
        "LIST_EXTEND", "LIST_APPEND", "LIST_TO_TUPLE", "BUILD_MAP", "BUILD_CONST_KEY_MAP",
        "DICT_MERGE", "FORMAT_VALUE", "FORMAT_SIMPLE", "BUILD_STRING", "UNARY_NEGATIVE",
        "UNARY_NOT", "UNARY_INVERT", "UNARY_POSITIVE", "TO_BOOL", "COMPARE_OP", "IS_OP",
        "CONTAINS_OP", "POP_JUMP_IF_FALSE", "POP_JUMP_IF_TRUE", "POP_JUMP_IF_NONE",
        "POP_JUMP_IF_NOT_NONE", "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_FORWARD_IF_TRUE",
        "POP_JUMP_BACKWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_FORWARD_IF_NONE",
        "POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_BACKWARD_IF_NONE",
        "POP_JUMP_BACKWARD_IF_NOT_NONE", "JUMP_IF_FALSE_OR_POP", "JUMP_IF_TRUE_OR_POP",
        "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE",
        "JUMP", "JUMP_NO_INTERRUPT", "GET_ITER", "FOR_ITER", "END_FOR", "POP_ITER",
        "NOT_TAKEN", "UNPACK_SEQUENCE", "UNPACK_EX", "LOAD_ASSERTION_ERROR", "RAISE_VARARGS",
    }
)
_REJECTED_FLAGS = (
    inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
    | inspect.CO_ITERABLE_COROUTINE
)



class Static(NamedTuple):
    """What a function's code alone says (see :func:`analyze`).

    Attributes:
        digest: sha256 of the bytecode, constants, names, counts and flags.
        global_names: the names it reads as globals, in first-read order.
        attr_names: the attribute names it loads (``x.name``), in order.
    """

    digest: bytes
    global_names: tuple[str, ...]
    attr_names: tuple[str, ...]


# (code object, allowed names) -> what _analyze found, or None
_CODE: dict[tuple[types.CodeType, frozenset[str]], Static | None] = {}


def _denied(attr: str) -> bool:
    if attr.startswith("__") and attr.endswith("__"):
        return False
    if attr.startswith("_") or attr.endswith("_") or attr in _DENIED_ATTRS:
        return True
    low = attr.lower()
    return (
        low.startswith(_DENIED_PREFIXES)
        or low.startswith("rand")
        or "dropout" in low
        or low in _RANDOM
    )


def _const_text(v: Any) -> str | None:
    """A deterministic text for a code constant, or None if not accepted."""
    if v is None or v is Ellipsis or isinstance(v, (bool, int, float, complex, str, bytes)):
        return f"{type(v).__name__}:{v.hex() if isinstance(v, float) else repr(v)}"
    if isinstance(v, tuple):
        parts = [_const_text(x) for x in v]
        return None if None in parts else "(" + ",".join(parts) + ")"  # type: ignore[arg-type]
    if isinstance(v, frozenset):
        parts = [_const_text(x) for x in v]
        return None if None in parts else "{" + ",".join(sorted(parts)) + "}"  # type: ignore[arg-type]
    return None  # a nested code object (function, class, comprehension)


def _analyze(code: types.CodeType, allowed: frozenset[str]) -> Static | None:
    if code.co_flags & _REJECTED_FLAGS or code.co_cellvars:
        return None
    consts = [_const_text(c) for c in code.co_consts]
    if None in consts:
        return None
    if any(isinstance(c, tuple) and "requires_grad" in c for c in code.co_consts):
        # a call with requires_grad= (torch.ones_like(g, requires_grad=True)):
        # torch sets the flag after the op, so a trace holds the op without
        # it, and under create_graph eager's gradient would record history
        # where the graph's does not
        return None
    global_names: list[str] = []
    attr_names: list[str] = []
    for ins in dis.get_instructions(code):
        name = ins.opname
        if name not in _OPCODES:
            return None
        if name == "BINARY_OP" and ins.argrepr.endswith("=") and ins.argrepr not in ("==", "!="):
            return None  # an in-place operator: g += 1
        if name == "LOAD_GLOBAL":
            if ins.argval not in global_names:
                global_names.append(ins.argval)
        elif name in ("LOAD_ATTR", "LOAD_METHOD"):
            if _denied(ins.argval) and ins.argval not in allowed:
                return None
            if ins.argval not in attr_names:
                attr_names.append(ins.argval)
    h = hashlib.sha256()
    for part in (
        code.co_code,
        "\0".join(consts).encode(),
        "\0".join(code.co_names).encode(),
        f"{code.co_argcount},{code.co_posonlyargcount},{code.co_kwonlyargcount},"
        f"{code.co_nlocals},{code.co_flags},{len(code.co_freevars)}".encode(),
    ):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return Static(h.digest(), tuple(global_names), tuple(attr_names))


def analyze(code: types.CodeType, allowed: frozenset[str] = frozenset()) -> Static | None:
    """What the accepted class needs to know of ``code`` (cached per code
    object), or None where the code is outside that class.

    Args:
        allowed: attribute names accepted although :data:`_DENIED_ATTRS`
            or its prefixes deny them (a custom Function backward's
            ``ctx.saved_tensors``).
    """
    try:
        return _CODE[code, allowed]
    except KeyError:
        static = _CODE[code, allowed] = _analyze(code, allowed)
        return static


def object_text(v: Any) -> str | None:
    """A deterministic text for a global, closure or default value, or None."""
    if isinstance(v, types.ModuleType):
        return f"module:{v.__name__}" if v in _MODULES else None
    if isinstance(v, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return f"{type(v).__name__}:{v}"
    if callable(v):
        try:
            if v in _BUILTINS:  # builtin functions and classes: abs, float, range, ...
                return f"builtin:{v.__name__}"
        except TypeError:  # unhashable
            return None
        module = getattr(v, "__module__", None)
        qualname = getattr(v, "__qualname__", None) or getattr(v, "__name__", None)
        if (
            isinstance(module, str)
            and isinstance(qualname, str)
            and module in _FUNCTION_MODULES
            and not _denied(qualname.rsplit(".", 1)[-1])
        ):
            return f"function:{module}.{qualname}"
        return None
    return _const_text(v)


def outside_texts(fn: types.FunctionType, static: Static) -> list[str] | None:
    """Deterministic texts of everything ``fn`` reads from outside its code:
    the globals it names (by name), its closure cells and positional
    defaults (in order) and its keyword defaults (by name); None where one
    of them is not an accepted value, or a global is missing (eager raises
    ``NameError`` there)."""
    read: list[tuple[str, Any]] = []
    g = fn.__globals__
    for name in static.global_names:
        if name in g:
            read.append((f"{name}=", g[name]))
        elif hasattr(builtins, name):
            read.append((f"{name}=", getattr(builtins, name)))
        else:
            return None  # a NameError at run time: eager raises it
    for cell in fn.__closure__ or ():
        try:
            read.append(("", cell.cell_contents))
        except ValueError:
            return None  # an empty cell
    read += [("", v) for v in fn.__defaults__ or ()]
    read += [(f"{k}=", v) for k, v in sorted((fn.__kwdefaults__ or {}).items())]
    parts: list[str] = []
    for label, v in read:
        text = object_text(v)
        if text is None:
            return None
        parts.append(label + text)
    return parts


def digest(static: Static, parts: list[str]) -> bytes:
    """The :data:`FINGERPRINT_BYTES` fingerprint of a code's ``static`` and
    the texts ``parts`` of what it reads."""
    h = hashlib.sha256(static.digest)
    h.update("\0".join(parts).encode())
    return h.digest()[:FINGERPRINT_BYTES]


def fingerprint(hook: Any) -> bytes | None:
    """The fingerprint of a hook this module accepts for tracing, else None.

    Args:
        hook: a tensor or node hook as its ``register_*`` call stored it.

    Returns:
        :data:`FINGERPRINT_BYTES` bytes: equal for hooks with the same code
        and the same values of everything they read from outside.
    """
    if type(hook) is not types.FunctionType:
        return None
    static = analyze(hook.__code__)
    if static is None:
        return None
    parts = outside_texts(hook, static)
    if parts is None:
        return None
    return digest(static, parts)


def dict_fingerprints(hooks: Mapping[Any, Any]) -> list[bytes | None]:
    """The fingerprint of each hook of one hook dict (a tensor's or a
    node's), in order."""
    return [fingerprint(h) for h in list(hooks.values())]
