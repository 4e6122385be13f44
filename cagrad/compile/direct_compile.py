"""Calling a ``torch.compile`` backend on a captured graph without Dynamo.

A captured backward is already an FX graph whose values are fake tensors
(see :mod:`cagrad.capture.compiler`), and cagrad already guards it (the cache key,
the hit path's guard, the :class:`~cagrad.keys.sizes.SizeCheck`). Handing it to
``torch.compile(gm)`` makes Dynamo trace its bytecode again on the first call
and check a second layer of guards on every call. Instead, a named backend
gets the graph directly, the way Dynamo's ``OutputGraph.call_user_compiler``
calls it: ``backend(graph_module, example_inputs)`` with one placeholder per
tensor or size the graph reads and the trace's fake values as the example
inputs, inside a ``TracingContext`` of the trace's fake mode.

What Dynamo's guards checked is checked here instead:

* sizes: the backend may add guards to the trace's ``ShapeEnv`` while it
  compiles (inductor's CPU code generation guards ``s0 <= 4096``, say); they
  are added to the graph's :class:`~cagrad.keys.sizes.SizeCheck` afterwards
  (:func:`cagrad.keys.sizes.tighten`);
* aliasing between inputs: every position gets a fake of its own, so the
  backend never compiles for two inputs being the same tensor (AOTAutograd
  would otherwise drop the duplicate and read the first at run time), and
  the graph, which does not mutate its inputs, is right for any aliasing;
* global state (grad mode, deterministic algorithms, autocast, ...): the
  state at compile time is recorded with Dynamo's own ``GlobalStateGuard``
  (:func:`global_state`); a backward in another state does not run the
  graph, it gets a variant of its own (``CacheNode.match``).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx

from ..counters import counters
from ..errors import Unsupported
from . import specialize
from .boxed import compile_boxed
from .specialize import Specializer

log = logging.getLogger("cagrad")


def flat_graph(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[tuple[str, int]]]:
    """The graph with one placeholder per list item it reads.

    Args:
        gm: a captured graph with the signature ``(inputs, sizes, scalars,
            hooks, packed_inputs)`` reading only ``inputs[i]`` and
            ``sizes[j]`` (no opaque calls), returning a list.

    Returns:
        ``(flat, reads)``: ``flat`` takes one argument per ``(list name,
        index)`` in ``reads``, in that order, and returns a tuple.

    Raises:
        ValueError: the graph uses a list placeholder other than by
            indexing it with a constant.
    """
    graph = gm.graph
    lists = {n: n.target for n in graph.nodes if n.op == "placeholder"}
    flat = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    reads: list[tuple[str, int]] = []
    for ph, name in lists.items():
        for user in sorted(ph.users, key=_index_of(ph)):
            val = _canonical(user.meta.get("val"))
            if isinstance(val, int):
                env[user] = val  # the trace proved the size constant: no input
                continue
            arg = flat.placeholder(f"{name}_{user.args[1]}")
            arg.meta.update(user.meta)
            if val is not None:
                arg.meta["val"] = val
            env[user] = arg
            reads.append((name, user.args[1]))
    for node in graph.nodes:
        if node.op == "placeholder" or node in env:
            continue
        if node.op == "output":
            (result,) = node.args
            flat.output(tuple(env[r] if isinstance(r, torch.fx.Node) else r for r in result))
            continue
        env[node] = flat.node_copy(node, lambda n: env[n])
    flat.lint()
    return torch.fx.GraphModule(gm, flat, "CompiledAutograd"), reads


def _canonical(val: Any) -> Any:
    """A SymInt read from ``sizes`` as the ShapeEnv's representative of its
    symbol (an int if the trace proved it constant).

    The trace may have learnt that the symbol a size input was created with
    equals another one (a replacement); the backend binds the symbol of a
    SymInt input as it is, while the graph's values are written with the
    representatives, which would then be bound by nothing (inductor: a
    ``NameError`` for the representative in its generated code).
    """
    if not isinstance(val, torch.SymInt):
        return val
    node = val.node
    expr = node.shape_env.replace(node.expr)  # SymNode.expr is replaced already
    if expr.is_number:
        return int(expr)
    if expr == getattr(node, "_expr", expr):  # the symbol it was created with
        return val
    return node.shape_env.create_symintnode(expr, hint=node.hint)


def _index_of(ph: torch.fx.Node) -> Callable[[torch.fx.Node], int]:
    def index(user: torch.fx.Node) -> int:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not ph:
            raise ValueError(f"graph input {ph.target!r} is used by {user.format_node()}, not indexed")
        if not isinstance(user.args[1], int):
            raise ValueError(f"graph input {ph.target!r} is indexed by {user.args[1]!r}")
        return user.args[1]

    return index


def example_inputs(flat: torch.fx.GraphModule) -> list[Any] | None:
    """The fake value of each placeholder (``meta["val"]``), requiring grad
    where the lifted tensor does (``meta["cagrad_requires_grad"]``).

    Returns:
        None if a tensor's ``requires_grad`` matters (grad mode is on: a
        ``create_graph=True`` backward) and is not known: a segment's input
        that an opaque call computed, which the cache key does not cover.

    Raises:
        ValueError: a placeholder without a fake value.
    """
    out = []
    grad_mode = torch.is_grad_enabled()
    for node in flat.graph.nodes:
        if node.op != "placeholder":
            continue
        if "val" not in node.meta:
            raise ValueError(f"graph input {node.name} has no fake value")
        val = node.meta["val"]
        if isinstance(val, torch.Tensor) and grad_mode:
            requires_grad = node.meta.get("cagrad_requires_grad")
            if requires_grad is None:
                return None
            if requires_grad:
                val = val.detach().requires_grad_(True)
        out.append(val)
    return out


def lift_free_symbols(flat: torch.fx.GraphModule, examples: list[Any]) -> list[Any]:
    """Adds a SymInt input for every symbol of the tensor inputs' sizes,
    strides and offsets that no SymInt input carries, as Dynamo does (its
    graphs take each free symbol as an input; AOTAutograd's passes and
    inductor assume that: a size used only as ``s10 * s11`` would otherwise
    be bound by nothing). Appends to ``examples``.

    Returns:
        the symbols added (sympy), sorted by name, as their inputs are.
    """
    carried = set()
    wanted = set()
    shape_env = None
    for val in examples:
        if isinstance(val, torch.SymInt):
            if val.node.expr.is_Symbol:
                carried.add(val.node.expr)
            sizes: tuple[Any, ...] = (val,)
        elif isinstance(val, torch.Tensor):
            sizes = (*val.shape, *val.stride(), val.storage_offset())
        else:
            continue
        for x in sizes:
            if isinstance(x, torch.SymInt):
                shape_env = x.node.shape_env
                wanted |= x.node.expr.free_symbols
    missing = sorted(wanted - carried, key=str)
    if not missing:
        return []
    values = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
    last = [n for n in flat.graph.nodes if n.op == "placeholder"][-1]
    for sym in missing:
        with flat.graph.inserting_after(last):
            last = flat.graph.placeholder(f"symbol_{sym}")
        hint = values.get(sym)
        val = shape_env.create_symintnode(sym, hint=int(hint) if hint is not None else None)
        last.meta["val"] = val
        examples.append(val)
    flat.recompile()
    return missing


class DirectCompiled:
    """A backend's callable with the captured graph's list signature:
    ``fn(inputs, sizes, scalars, hooks, packed_inputs)`` reads the items the
    graph uses and calls the backend's callable with them.

    Attributes:
        symbols: the symbols it takes as extra inputs
            (:func:`lift_free_symbols`); each is read from ``sizes`` at the
            index :meth:`link` gives it (the caller appends their values to
            the graph's size inputs).
    """

    __slots__ = ("boxed", "compile_symbolic", "fn", "getters", "specializer", "symbolic_failed", "symbols")

    def __init__(
        self,
        fn: Callable[..., Any],
        reads: Sequence[tuple[str, int]],
        symbols: Sequence[Any],
        boxed: bool = False,
    ) -> None:
        self.fn = fn
        self.boxed = boxed
        slot = {"inputs": 0, "sizes": 1, "scalars": 2, "hooks": 3, "packed_inputs": 4}
        self.getters = [(slot[name], i) for name, i in reads]
        self.symbols = list(symbols)
        self.getters += [(1, -1)] * len(self.symbols)  # linked later
        self.specializer: Specializer | None = None
        # static first (compile_graph(static_first=True)): ``fn`` is None
        # until prepare_symbolic() compiles it with this
        self.compile_symbolic: Callable[[], tuple[Callable[..., Any], bool]] | None = None
        self.symbolic_failed: str | None = None

    def needs_symbolic(self, sizes: Sequence[Any]) -> bool:
        """Whether a call with these ``sizes`` would run the symbolic code,
        not compiled yet (call :meth:`prepare_symbolic` first)."""
        if self.fn is not None:
            return False
        return self.specializer is None or self.specializer.find((None, sizes)) is None

    def prepare_symbolic(self) -> None:
        """Compiles the symbolic code now (static first left it for the
        first call at other sizes).

        Raises:
            Unsupported: ``compile_failed``, now or at an earlier attempt.
        """
        if self.fn is not None:
            return
        if self.symbolic_failed is None and self.compile_symbolic is not None:
            try:
                self.fn, self.boxed = self.compile_symbolic()
                self.compile_symbolic = None
                return
            except Exception as e:  # noqa: BLE001 - reported as the fallback's reason
                self.symbolic_failed = f"{type(e).__name__}: {e}"
        raise Unsupported("compile_failed", f"symbolic code: {self.symbolic_failed or 'not compiled'}")

    def link(self, index_of: Callable[[Any], int]) -> None:
        """Sets where each extra symbol's value is in ``sizes``."""
        first = len(self.getters) - len(self.symbols)
        for k, sym in enumerate(self.symbols):
            self.getters[first + k] = (1, index_of(sym))

    def __call__(self, *lists: Any) -> Any:
        if self.specializer is not None:
            static = self.specializer.lookup(lists)
            if static is not None:
                return static(*lists)
        if self.fn is None:
            raise RuntimeError("cagrad: a static-first graph called at new sizes without prepare_symbolic()")
        args = [lists[k][i] for k, i in self.getters]
        if not self.boxed:
            return self.fn(*args)
        # the caller hands its inputs list over (see cagrad.compile.boxed): emptied
        # here, the boxed fn holds the only references and frees each input
        # after its last use
        lists[0].clear()
        return self.fn(args)


def compile_graph(
    backend: Callable[..., Any], gm: torch.fx.GraphModule, name: str | None = None, static_first: bool = False
) -> DirectCompiled | None:
    """Compiles ``gm`` with a Dynamo backend callable, without Dynamo.

    Call it under the grad mode the graph will run in (AOTAutograd decides
    from it whether the graph must be differentiable), then :meth:`link
    <DirectCompiled.link>` the result's extra symbols.

    Args:
        backend: ``torch._dynamo.backends.registry.lookup_backend(name)``.
        gm: a captured graph with no opaque calls (see :func:`flat_graph`).
        name: the backend's registered name; ``"eager"``, ``"aot_eager"``
            and ``"inductor"`` compile boxed (:mod:`cagrad.compile.boxed`).
        static_first: for a symbolic graph of a backend that specializes
            (:mod:`cagrad.compile.specialize`), compile it now for the capture's
            sizes only, and the symbolic code on the first need
            (:meth:`DirectCompiled.prepare_symbolic`, which the caller
            calls before a call at other sizes). A whole-graph backward
            only: a segment's call cannot stop to prepare. A whole graph's
            tensor inputs are all in the cache key, so inductor compiles it
            without size asserts (``inputs_keyed`` of
            :func:`cagrad.compile.boxed.compile_boxed`).

    Returns:
        the compiled graph, called like ``gm`` (a boxed one empties the
        ``inputs`` list it is given); None when it must go through
        Dynamo instead, which guards what cagrad does not know here (see
        :func:`example_inputs`).
    """
    from torch._guards import TracingContext, detect_fake_mode, tracing

    flat, reads = flat_graph(gm)
    examples = example_inputs(flat)
    if examples is None:
        return None
    symbols = lift_free_symbols(flat, examples)
    fake_mode = detect_fake_mode(examples)
    if fake_mode is None or fake_mode.shape_env is None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        if any(_symbolic(e) for e in examples):
            # a segment whose only symbolic inputs are sizes: no fake tensor to take a mode from
            fake_mode = FakeTensorMode()
        else:
            # a static trace's fakes have no ShapeEnv, and inductor's and
            # AOTAutograd's caches bypass a compile whose fake mode has none
            fake_mode = FakeTensorMode(shape_env=ShapeEnv())
            examples = specialize.static_examples(examples, {}, fake_mode)

    def compile_symbolic() -> tuple[Callable[..., Any], bool]:
        with tracing(TracingContext(fake_mode)):
            return compile_boxed(backend, name, flat, examples, inputs_keyed=static_first)

    compiled = DirectCompiled(None, reads, symbols)
    if specialize.wanted(name) and any(_symbolic(e) for e in examples):
        sp = compiled.specializer = _specializer(compiled, reads, backend, name, gm, examples, static_first)
        binding = sp.capture_binding if static_first else None
        if binding is not None:
            try:
                sp.pending = (binding, sp.compile_static(binding))
            except Exception as e:  # noqa: BLE001 - the symbolic code is compiled instead
                log.info("cagrad: no static compile at capture (%s: %s); compiling the symbolic code", type(e).__name__, e)
            else:
                counters.bump("specializations")
                compiled.compile_symbolic = compile_symbolic
                return compiled
    compiled.fn, compiled.boxed = compile_symbolic()
    return compiled


def find(fn: Any) -> DirectCompiled | None:
    """The :class:`DirectCompiled` inside ``fn``'s wrappers (CUDA graphs,
    the alias-check switch: each keeps what it wraps in ``.fn``), or None."""
    for _ in range(4):
        if isinstance(fn, DirectCompiled):
            return fn
        fn = getattr(fn, "fn", None)
    return None


def _symbolic(example: Any) -> bool:
    if isinstance(example, torch.SymInt):
        return True
    return isinstance(example, torch.Tensor) and any(
        isinstance(v, torch.SymInt) for v in (*example.shape, *example.stride(), example.storage_offset())
    )


def _specializer(
    compiled: DirectCompiled,
    symbolic_reads: list[tuple[str, int]],
    backend: Callable[..., Any],
    name: str | None,
    gm: torch.fx.GraphModule,
    examples: list,
    inputs_keyed: bool,
) -> Specializer:
    """Static compiles of ``gm`` for the sizes ``compiled`` is called at
    (:mod:`cagrad.compile.specialize`): the same flat graph and placeholders, the
    symbols of ``examples`` bound to the call's values (``inputs_keyed``: see
    :func:`cagrad.compile.boxed.compile_boxed`)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # the graph's symbols: the SymInt inputs that are one symbol each
    bound = [(j, e.node) for j, e in enumerate(examples) if isinstance(e, torch.SymInt) and e.node.expr.is_symbol]
    hints = [node.hint for _, node in bound]
    capture_binding = (
        None if None in hints else {node.expr: sympy.Integer(int(h)) for (_, node), h in zip(bound, hints)}
    )

    def symbols_of(lists: Sequence[Any]) -> dict:
        getters = compiled.getters
        binding = {}
        for j, node in bound:
            k, i = getters[j]
            binding[node.expr] = sympy.Integer(int(lists[k][i]))
        return binding

    def compile_static(binding: dict) -> DirectCompiled:
        flat, reads = flat_graph(gm)
        examples = example_inputs(flat)
        if examples is None:
            raise ValueError("the graph's inputs are not all known")
        symbols = lift_free_symbols(flat, examples)
        if reads != symbolic_reads or symbols != compiled.symbols:
            raise ValueError("the graph's placeholders differ from its symbolic compile's")
        # a ShapeEnv without symbols: inductor's and AOTAutograd's caches
        # bypass a compile whose fake mode has none
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        static = specialize.static_examples(examples, binding, fake_mode)
        with tracing(TracingContext(fake_mode)):
            fn, boxed = compile_boxed(backend, name, flat, static, inputs_keyed=inputs_keyed)
        out = DirectCompiled(fn, reads, (), boxed)
        out.getters = compiled.getters  # shared: link() may still fill it in
        return out

    return Specializer(compile_static, symbols_of, capture_binding)


def link_all(compiled: Sequence[Any], traced: Any) -> None:
    """Links the extra symbols of every directly compiled graph of a capture
    to size inputs of ``traced`` (appended to ``traced.size_inputs``, as
    functions of the check's symbol values).

    Raises:
        ValueError: a symbol the check does not bind (the caller falls back).
    """
    index: dict[Any, int] = {}

    def index_of(sym: Any) -> int:
        if sym not in index:
            index[sym] = len(traced.size_inputs)
            traced.size_inputs.append(traced.check.function(sym))
        return index[sym]

    for fn in compiled:
        direct = fn if isinstance(fn, DirectCompiled) else getattr(fn, "fn", None)
        if isinstance(direct, DirectCompiled) and direct.symbols:
            direct.link(index_of)


def global_state() -> Any:
    """Dynamo's ``GlobalStateGuard`` of the current state, taken under the
    grad mode compiled graphs run in (call it where the backend compiles)."""
    return torch._C._dynamo.guards.GlobalStateGuard()
