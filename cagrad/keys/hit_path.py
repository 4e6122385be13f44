"""The cache-hit path: one generated check-and-collect function per graph.

The full collection (:mod:`cagrad.keys.compiled_node_args`) serializes every
node's CacheKey again on every backward and walks the trie with the bytes.
That is the source of truth, and it costs about 10 us per node. A
:class:`HitGuard` is the shortcut for a graph seen before: at capture, cagrad
writes Python source specialized to that graph (as Dynamo writes guard code
for a frame), which walks a new graph along the captured structure and
compares only what the key bytes depend on:

* the structure: the same node types reached through the same edges, the
  same number of distinct nodes, and the same order of their sequence
  numbers (the eager run order is a function of these alone, see
  :mod:`cagrad.autograd.graph_task`);
* each traced node's non-tensor attributes (compared by type and value,
  floats by their binary64 bytes as the key writes them), each saved
  tensor's metadata (type, layout, dtype, device, requires_grad, rank) and
  each edge target's input metadata (read in C++ by :mod:`cagrad.native`
  where it is built: dtype, device and rank packed in one integer constant,
  the sizes appended to the size values; else through
  ``node._input_metadata``, about 10x slower; the tensors' metadata
  likewise, for plain tensors and parameters; int and int-tuple attributes
  and the order of sequence numbers are also one C++ call each);
* the leaves (still leaves, their metadata) and the absence of hooks: each
  leaf has no hook of its own, and the C++ reader of hook lists finds none
  on any node (hooks live on other graphs do not matter; without the
  reader the census must report no hook anywhere: no live node hook dict,
  tensor hook or hook added from C++), and no node may carry foreign
  saved-tensor hooks.

Where the extension is built, the structure check is one C++ call
(``walk``) and so is each run of per-node checks (``collect``, a program of
instructions); the logged source lists their steps and instructions as
comments (:mod:`cagrad.native.guard_program`).

In the same pass it fills what the full collection would produce for the
graph: the lifted tensors (root gradients, then saved tensors in run
order) and the size slot values, in the same order, which the CacheNode's
variants then match as before. Anything that differs returns None and the
backward takes the full path (collection, trie lookup, maybe a capture), so
a guard can only make a hit faster, never create one: a graph it accepts has
the key sequence it was built from. With ``CAGRAD_VERIFY_GUARDS=1`` (the
test suite sets it) every accepted backward is also collected in full and
the two are compared (``cagrad.run.hits.verify_hit``).

Guarded backwards are ``backward()`` without ``inputs=``, without
``create_graph``, with every node traced or a leaf's AccumulateGrad,
non-leaf roots and no complex dtypes, and either no hooks (one compiled
graph) or only C++ post hooks on leaves, DDP's reducer's (a segmented run:
:mod:`cagrad.keys.leaf_hooks` checks those hooks and builds the runtime
objects). Others take the full path as before. The generated source is logged with
``CAGRAD_LOGS=guards`` (logger ``cagrad.guards``).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import native
from ..native import guard_program
from ..autograd import saved_variables
from ..autograd.walk import Kind
from . import leaf_hooks
from .cache_key import KeyWriter, _pack_d
from .compiled_node_args import _int64

log = logging.getLogger("cagrad.guards")

MAX_GUARDS = 8  # guards tried per backward, most recently hit first


def verify_enabled() -> bool:
    """``CAGRAD_VERIFY_GUARDS=1``: check every guarded hit against the full path."""
    return os.environ.get("CAGRAD_VERIFY_GUARDS", "") not in ("", "0")


@dataclasses.dataclass
class Hit:
    """What a guard collected for one backward.

    Attributes:
        tensors: the lifted tensors, as ``Collector.args.tensors`` holds them.
        values: the size slot values, as ``SizeInputs.values``.
        order: the nodes in run order (None for the virtual GraphRoot).
    """

    tensors: list[torch.Tensor]
    values: list[int]
    order: tuple


@dataclasses.dataclass
class HitGuard:
    """The generated check-and-collect function of one cached graph.

    Attributes:
        node: the CacheNode its key sequence ends at.
        fn: ``fn(roots, grad_tensors, counts) -> (tensors, values, order)``
            or None; ``counts`` is the C++ hook-list reader or None.
        release_slots: ``(run position, attribute, index)`` of each lifted
            saved tensor, released after a backward without retain_graph.
        source: the generated Python source (logged, for review).
        release_positions: the run positions of ``release_slots``, once
            each (whole nodes are released where the C++ extension is
            available: :func:`cagrad.autograd.saved_variables.release_nodes`).
        last_entry: the CompiledEntry its last hit ran (the next hit most
            likely runs it again: a CUDA-graphed one replays early,
            :meth:`cagrad.compile.cuda_graphs.CudaGraphed.speculate`).
        leaves: its leaves' hooks, checked after ``fn`` where C++ hooks on
            leaves are live (:mod:`cagrad.keys.leaf_hooks`).
    """

    node: Any
    fn: Callable[..., Any]
    release_slots: list[tuple[int, str, int]]
    source: str
    leaves: leaf_hooks.LeafHooks
    release_positions: tuple[int, ...] = ()
    last_entry: Any = None

    def __post_init__(self) -> None:
        self.release_positions = tuple(sorted({pos for pos, _, _ in self.release_slots}))

    def __call__(self, roots: Sequence[Any], grads: Sequence[Any], counts: Any) -> Hit | None:
        try:
            got = self.fn(roots, grads, counts)
        except (RuntimeError, ValueError):
            # RuntimeError: unpacking a saved tensor failed (freed, modified
            # in place): the full path raises eager's error for it.
            # ValueError: a node has another number of edges
            return None
        return None if got is None else Hit(*got)


def eligible_call(call: Any) -> bool:
    """Whether a backward call can take a guarded hit at all (cheap)."""
    return bool(call.accumulate_grad) and not call.create_graph and not call.inputs


def census_allows(census: Any) -> bool:
    """Whether a guard may be tried at all (see :class:`~cagrad.hooks.hooks_census.Census`).

    Where the C++ reader of hook lists is built (``census.counts``), yes:
    each guard reads every one of its nodes' hook lists itself
    (``_hookless``, and each leaf's own hook dicts), so a hook on its graph
    is a miss and hooks live on other graphs do not matter. C++ hooks on
    hooked leaves (DDP's reducer) are checked after the guard by
    :meth:`~cagrad.keys.leaf_hooks.LeafHooks.collect`. Without the reader
    no Python node hook, tensor hook or C++ hook may be live anywhere (the
    census is the guard's only check of hooks then).

    Foreign saved-tensor hooks (checkpointing or ``saved_tensors_hooks``
    were used in this process) are checked per graph instead, by each guard
    before it reads a saved tensor (``_foreign_hooks``: a read would unpack
    one saved through checkpoint's hook).
    """
    if census.counts is not None:
        return True
    return not (census.probe_nodes or census.tensor_hooks or census.cpp_hooks)


def build(collected: Any, call: Any, cache_node: Any) -> HitGuard | None:
    """Generates the guard of a graph just captured, or None if it is not
    eligible (see the module docstring; the reason is logged)."""
    why = _ineligible(collected, call)
    leaves = why or leaf_hooks.plan(collected)
    if isinstance(leaves, str):
        log.debug("no guard for this graph: %s", leaves)
        return None
    if leaves.hooked and native.hookless_fn() is None:
        log.debug("no guard for this graph: hooked leaves, and no C++ reader of hook lists")
        return None
    gen = _Generator(collected, frozenset(pos for pos, _ in leaves.hooked))
    source = gen.source()
    namespace = dict(gen.consts)
    exec(compile(source, f"<cagrad guard {id(cache_node):x}>", "exec"), namespace)  # noqa: S102
    guard = HitGuard(cache_node, namespace["guard"], gen.release_slots, source, leaves)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("guard for a graph of %d nodes:\n%s", len(collected.task.order), source)
    return guard


def _ineligible(collected: Any, call: Any) -> str | None:
    collector = collected.collector
    task = collected.task
    if not eligible_call(call):
        return "autograd.grad, inputs= or create_graph"
    if task.output_edges or not task.accumulate_grad:
        return "inputs="
    for t in call.tensors:
        if not isinstance(t, torch.Tensor) or t.grad_fn is None:
            return "a leaf root"
    # node kinds and hooks: leaf_hooks.plan, which build() asks next
    if collector.has_subclass:
        # a guard reads plain tensors' metadata; the full collection keys a
        # subclass (cagrad.keys.subclasses)
        return "a tensor subclass"
    if any(t.is_complex() for t in collector.args.tensors):
        return "a complex tensor"
    for call_, plan in zip(task.order, collector.plans):
        if plan.kind is Kind.ACCUMULATE and call_.node.variable.is_complex():
            return "a complex leaf"
    return None


# tensor types whose shape, strides and metadata the C++ reader may read
# directly (no __torch_function__ of their own in the way)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _describe_tensor(t: torch.Tensor) -> str:
    """What a tensor key packs, for the guard's listing."""
    return f"{t.dtype}, {t.device}, rank {t.dim()}" + (", requires_grad" if t.requires_grad else "")


def _key_bytes(v: Any) -> bytes:
    w = KeyWriter()
    w.value(v)
    return w.getvalue()


def _types(v: Any) -> tuple:
    return tuple(map(type, v))


class _Generator:
    """Writes the guard's source from a collected backward (capture time)."""

    def __init__(self, collected: Any, hooked: frozenset[int] = frozenset()) -> None:
        self.task = collected.task
        self.collector = collected.collector
        self.hooked = hooked  # run positions of leaves whose hooks LeafHooks checks
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {
            "_Tensor": torch.Tensor,
            "_pack_d": _pack_d,
            "_key_bytes": _key_bytes,
            "_types": _types,
            "_int64": _int64,
            "_lt": operator.lt,
            "_eq": operator.eq,
            "_foreign_hooks": saved_variables.foreign_hooks_on,
        }
        # the C++ readers of input and tensor metadata (about 10x cheaper
        # than the Python attributes), or None
        self.readers = native.metadata_fns()
        self.hookless = native.hookless_fn()
        if self.hookless is not None:
            self.consts["_hookless"] = self.hookless
        if self.readers is not None:
            self.consts["_md"] = self.readers.metadata
            self.consts["_tm"] = self.readers.tensor
            self.consts["_ints"] = self.readers.ints
            self.consts["_int"] = self.readers.int_
            self.consts["_order"] = self.readers.order
        # the C++ runner of per-node checks given as instructions
        # (cagrad.native.guard_program): what it can check goes into one
        # program call per run of instructions, not a Python line each
        self.collect = native.collect_fn() if self.readers is not None else None
        if self.collect is not None:
            self.consts["_collect"] = self.collect
        # the C++ structure check along the captured walk, or None
        self.walk = native.walk_fn()
        if self.walk is not None:
            self.consts["_walk"] = self.walk
        self.ops: list[tuple[tuple, str]] = []  # instructions not yet emitted, each with its comment
        self.pos_of = {c.id: pos for pos, c in enumerate(self.task.order)}
        self.var: dict[int, str] = {}  # discovery id -> local name
        self.md_loaded: set[int] = set()
        self.release_slots: list[tuple[int, str, int]] = []
        self._lifted = iter(self.collector.args.tensors)
        args = self.collector.args
        self._saved_of = {
            (id(slot[0]), slot[1], slot[2]): t for slot, t in zip(args.slots, args.tensors) if slot is not None
        }

    def const(self, value: Any) -> str:
        name = f"K{len(self.consts)}"
        self.consts[name] = value
        return name

    def emit(self, line: str) -> None:
        if self.ops:
            self._flush()
        self.lines.append("    " + line)

    def _op(self, op: tuple, note: str = "") -> bool:
        """Queues an instruction (and a comment for the listing) for the next
        ``_collect`` call; False where there is no C++ runner (the caller
        writes Python lines)."""
        if self.collect is None:
            return False
        self.ops.append((op, note))
        return True

    def _flush(self) -> None:
        ops, self.ops = self.ops, []
        names = ["None" if c.node is None else self.var[c.id] for c in self.task.order]
        for op, note in ops:
            self.lines.append("    # " + guard_program.describe(op, names) + (f" ({note})" if note else ""))
        self.emit(f"if not _collect(N, {self.const(tuple(op for op, _ in ops))}, V, L): return None")

    def fail_if(self, cond: str) -> None:
        cond, _, comment = cond.partition("  # ")
        self.emit(f"if {cond}: return None" + (f"  # {comment}" if comment else ""))

    def source(self) -> str:
        self._structure()
        self._run_order()
        if self.hookless is not None:
            # every node's hook lists in one C++ call (counts(n, True) per node otherwise)
            nodes = ", ".join(
                self.var[c.id] for pos, c in enumerate(self.task.order) if c.node is not None and pos not in self.hooked
            )
            self.fail_if(f"counts is not None and not _hookless(({nodes},))")
        saving = ", ".join(
            self.var[c.id] for c in self.task.order if c.node is not None and type(c.node).__name__ != "AccumulateGrad"
        )
        if saving:
            # before any saved tensor is read: reading one saved through
            # checkpoint's pack hook unpacks it, and checkpoint refuses a
            # second unpack in the backward that follows the miss
            self.fail_if(f"_foreign_hooks(({saving},))")
        order = ", ".join("None" if c.node is None else self.var[c.id] for c in self.task.order)
        self.emit(f"N = ({order},)")
        self.emit("V = []")
        self.emit("L = []")
        self._graph_task_key()
        for pos, call in enumerate(self.task.order):
            self._node(pos, call)
        self.emit("return L, V, N")
        return "def guard(roots, grads, counts):\n" + "\n".join(self.lines) + "\n"

    # -- structure: roots, then the dependency walk's discovery order --------
    def _structure(self) -> None:
        task = self.task
        self.fail_if(f"len(roots) != {len(task.root_edges)}")
        self.fail_if(f"len(grads) != {len(task.root_edges)}")
        order: list[Any] = []
        for i, (fn, nr) in enumerate(task.root_edges):
            self.emit(f"t = roots[{i}]")
            self.fail_if(f"not isinstance(t, _Tensor) or t.output_nr != {nr}")
            cid = task.call_of[fn].id
            if cid in self.var:
                self.fail_if(f"t.grad_fn is not {self.var[cid]}")
                continue
            name = self.var[cid] = f"n{cid}"
            self.emit(f"{name} = t.grad_fn")
            self.fail_if(f"type({name}) is not {self.const(type(fn))}  # {type(fn).__name__}")
            order.append(fn)
        # the walk of GraphTask._discover: a stack, popped last first; each
        # step is (source, [(target name or None, input_nr, new target or None)])
        steps: list[tuple[str, list[tuple[str | None, int, Any]]]] = []
        starts = [self.var[task.call_of[fn].id] for fn in order]
        stack = list(order)
        seen = {task.call_of[fn].id for fn in order}
        while stack:
            fn = stack.pop()
            edges = []
            for nxt, input_nr in task.call_of[fn].edges:
                if nxt is None:
                    edges.append((None, input_nr, None))
                    continue
                cid = task.call_of[nxt].id
                new = cid not in self.var
                if new:
                    self.var[cid] = f"n{cid}"
                edges.append((self.var[cid], input_nr, nxt if new else None))
                if cid not in seen:
                    seen.add(cid)
                    stack.append(nxt)
            steps.append((self.var[task.call_of[fn].id], edges))
        if self.walk is not None:
            self._walk_steps(starts, steps)
        else:
            self._unpack_steps(steps)
        real = [c for c in task.calls if c.node is not None]
        if self.readers is not None:
            return  # distinct objects: checked by _order in _run_order
        names = ", ".join(self.var[c.id] for c in real)
        self.emit(f"N = ({names},)")
        # distinct objects: two captured nodes must not be one node now
        self.fail_if(f"len(set(map(id, N))) != {len(real)}")

    def _walk_steps(self, starts: list[str], steps: list) -> None:
        """The structure check as one C++ ``walk`` call (its steps listed as
        comments), then the discovered nodes unpacked into their names."""
        index = {name: i for i, name in enumerate(starts)}
        program = []
        for src, edges in steps:
            specs: list[tuple] = []
            text = []
            for name, input_nr, new in edges:
                if name is None:
                    specs.append(())
                    text.append("none")
                    continue
                if new is not None:
                    index[name] = len(index)
                    specs.append((index[name], input_nr, type(new)))
                    text.append(f"{name} ({type(new).__name__}, input {input_nr})")
                else:
                    specs.append((index[name], input_nr))
                    text.append(f"{name} again (input {input_nr})")
            program.append((index[src], tuple(specs)))
            self.lines.append(f"    # {src} -> " + (", ".join(text) if text else "no edges"))
        names = sorted(index, key=index.__getitem__)
        self.emit(f"D = _walk(({', '.join(starts)},), {self.const(tuple(program))}, {len(names)})")
        self.fail_if("D is None")
        self.emit(", ".join(names) + ", = D")

    def _unpack_steps(self, steps: list) -> None:
        """The structure check in Python: each node's edges unpacked in one
        statement (a ValueError, from another edge count, is a miss:
        HitGuard.__call__), then their input numbers, absent edges, the known
        nodes' identity and the new nodes' types compared in one condition."""
        for src, edges in steps:
            if not edges:
                self.fail_if(f"{src}.next_functions")
                continue
            targets, conds, new_nodes = [], [], []
            for k, (name, input_nr, new) in enumerate(edges):
                if name is None:
                    targets.append(f"(u{k}, _)")
                    conds.append(f"u{k} is not None")
                elif new is None:
                    targets.append(f"(u{k}, i{k})")
                    conds += [f"i{k} != {input_nr}", f"u{k} is not {name}"]
                else:
                    targets.append(f"({name}, i{k})")
                    conds += [f"i{k} != {input_nr}", f"type({name}) is not {self.const(type(new))}"]
                    new_nodes.append(new)
            self.emit(", ".join(targets) + f", = {src}.next_functions")
            self.fail_if(" or ".join(conds) + "  # " + ", ".join(type(x).__name__ for x in new_nodes))

    def _run_order(self) -> None:
        # the ready queue compares sequence numbers only: the same order of
        # them, ties included, gives the same run order. With the nodes
        # permuted into their captured sorted order, each adjacent pair must
        # again be strictly increasing, or equal where it was a tie (a stable
        # sort then yields the same permutation)
        real = [c for c in self.task.calls if c.node is not None]
        seq = [c.node._sequence_nr() for c in real]
        perm = sorted(range(len(seq)), key=seq.__getitem__)
        if len(perm) < 2:
            return
        ordered = [seq[i] for i in perm]
        less = [a < b for a, b in zip(ordered, ordered[1:])]
        equal = [a == b for a, b in zip(ordered, ordered[1:])]
        nodes = ", ".join(self.var[real[i].id] for i in perm)
        if self.readers is not None:  # one C++ call: the same comparisons, and no node twice
            relation = b"".join(b"=" if e else b"<" for e in equal)
            self.fail_if(f"not _order(({nodes},), {relation!r})")
            return
        self.emit(f"s = [x._sequence_nr() for x in ({nodes},)]")
        self.emit("r = s[1:]")
        self.fail_if(f"list(map(_lt, s, r)) != {self.const(less)}")
        if any(equal):
            self.fail_if(f"list(map(_eq, s, r)) != {self.const(equal)}")

    # -- the GraphTask key: root gradients, root edges ----------------------
    def _graph_task_key(self) -> None:
        task = self.task
        for i in range(len(task.root_edges)):
            t = next(self._lifted)
            self.emit(f"g = grads[{i}]")
            self.fail_if("g is None")
            if not t.requires_grad:
                # the full path lifts a root gradient detached (no
                # create_graph here): one that requires grad has the same key
                self.emit("if g.requires_grad: g = g.detach()")
            self._tensor("g", t)
            self.emit("L.append(g.detach())" if t.requires_grad else "L.append(g)")
        for fn, input_nr in task.root_edges:
            self._metadata(task.call_of[fn], input_nr)

    def _tensor_key(self, t: torch.Tensor) -> int | None:
        """The C++ reader's key of ``t``'s metadata, or None where it does
        not read ``t`` (not a plain tensor or parameter, sparse, nested)."""
        if self.readers is None or type(t) not in _PLAIN_TENSORS:
            return None
        return self.readers.tensor_key(t, type(t))

    def _tensor(self, name: str, t: torch.Tensor) -> None:
        key = self._tensor_key(t)
        if key is not None:  # one C++ call: the same comparison, the same values appended
            self.fail_if(f"not _tm({name}, {self.const(type(t))}, {key}, V)  # {_describe_tensor(t)}")
            return
        meta = (type(t), t.layout, t.dtype, t.device, t.requires_grad, t.dim())
        self.emit(f"z = {name}.shape")
        self.fail_if(
            f"(type({name}), {name}.layout, {name}.dtype, {name}.device, "
            f"{name}.requires_grad, len(z)) != {self.const(meta)}"
        )
        self.emit("V += z")
        self.emit(f"V += {name}.stride()")
        self.emit(f"V.append({name}.storage_offset())")

    def _metadata(self, target: Any, input_nr: int) -> None:
        md = target.input_metadata[input_nr]
        name = self.var[target.id]
        key = self.readers.metadata_key(target.node, input_nr) if self.readers is not None else None
        note = f"{md.dtype}, {md.device}, rank {len(md.shape)}"
        pos = self.pos_of.get(target.id)
        if key is not None and pos is not None and self._op((guard_program.METADATA, pos, input_nr, key), note):
            return
        if key is not None:  # dtype, device and rank packed; sizes appended to V
            self.fail_if(f"not _md({name}, {input_nr}, {key}, V)  # {note}")
            return
        if target.id not in self.md_loaded:
            self.md_loaded.add(target.id)
            self.emit(f"m{target.id} = {name}._input_metadata")
        self.emit(f"m = m{target.id}[{input_nr}]")
        self.emit("z = m.shape")
        meta = (False, md.dtype, md.device, len(md.shape))
        self.fail_if(f"(m.is_nested_tensor, m.dtype, m.device, len(z)) != {self.const(meta)}")
        self.emit("V += z")

    # -- one node, as Collector.collect writes it ----------------------------
    def _node(self, pos: int, call: Any) -> None:
        task = self.task
        if call.node is None:  # GraphRoot
            for fn, input_nr in task.root_edges:
                self._metadata(task.call_of[fn], input_nr)
            return
        n = self.var[call.id]
        if self.hookless is None and pos not in self.hooked:
            self.fail_if(f"counts is not None and counts({n}, True) is not None")
        plan = self.collector.plans[pos]
        if plan.kind is Kind.ACCUMULATE:
            v = call.node.variable
            key = self._tensor_key(v)
            if key is not None and self._op((guard_program.LEAF, pos, type(v), key), _describe_tensor(v)):
                return
            self.emit(f"v = {n}.variable")
            self.fail_if("v.grad_fn is not None or v._backward_hooks")
            self.fail_if("getattr(v, '_post_accumulate_grad_hooks', None)")
            self._tensor("v", call.node.variable)
            return
        schema = call.schema
        node = call.node
        for attr in schema.values:
            self._value(pos, "_saved_" + attr, getattr(node, "_saved_" + attr))
        for attr in schema.sym_values:
            self._sym_value(pos, "_saved_" + attr, getattr(node, "_saved_" + attr))
        for attr in schema.tensors:
            self._saved(pos, f"{n}._saved_{attr}", attr, -1)
        for attr in schema.tensor_lists:
            count = len(getattr(node, "_raw_saved_" + attr))
            self.emit(f"ts = {n}._saved_{attr}")
            self.fail_if(f"len(ts) != {count}")
            for i in range(count):
                self._saved(pos, f"ts[{i}]", attr, i)
        for fn, input_nr in call.edges:
            if fn is not None:
                self._metadata(task.call_of[fn], input_nr)

    def _value(self, pos: int, attr: str, v: Any) -> None:
        # one classification for both forms: the instruction, or its Python line
        if v is None or v is True or v is False or isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            code: int | None = guard_program.IS
        elif type(v) in (int, str):
            code = guard_program.EQ
        elif type(v) is float:
            code = guard_program.FLOAT
        elif type(v) in (tuple, list) and all(type(x) is int for x in v):
            code = guard_program.INT_SEQ
        else:
            code = None
        if code is not None and self._op((code, pos, sys.intern(attr), v)):
            return
        self.emit(f"a = {self.var[self.task.order[pos].id]}.{attr}")
        if code == guard_program.IS:
            self.fail_if(f"a is not {v if v is None or type(v) is bool else self.const(v)}")
        elif code == guard_program.EQ:
            self.fail_if(f"type(a) is not {type(v).__name__} or a != {v!r}")
        elif code == guard_program.FLOAT:
            self.fail_if(f"type(a) is not float or _pack_d(a) != {self.const(_pack_d(v))}")
        elif code == guard_program.INT_SEQ:
            self.fail_if(f"type(a) is not {type(v).__name__} or a != {self.const(v)} or _types(a) != {self.const(_types(v))}")
        else:
            self.fail_if(f"_key_bytes(a) != {self.const(_key_bytes(v))}")

    def _sym_value(self, pos: int, attr: str, v: Any) -> None:
        # one classification for both forms: the instruction, or its Python line
        name = sys.intern(attr)
        if v is None:
            op: tuple | None = (guard_program.IS, pos, name, None)
        elif isinstance(v, (tuple, list)) and all(type(x) is int for x in v):
            op = (guard_program.INTS, pos, name, len(v))
        elif type(v) is int:
            op = (guard_program.INT, pos, name)
        else:
            op = None
        if op is not None and self._op(op):
            return
        code = None if op is None else op[0]
        self.emit(f"a = {self.var[self.task.order[pos].id]}.{attr}")
        if code == guard_program.IS:
            self.fail_if("a is not None")
        elif code == guard_program.INTS and self.readers is not None:
            self.fail_if(f"not _ints(a, {len(v)}, V)")  # one C++ call: checked and appended
        elif isinstance(v, (tuple, list)):
            self.fail_if(f"not isinstance(a, (tuple, list)) or len(a) != {len(v)}")
            self.emit("V += map(_int64, a)")
        elif code == guard_program.INT and self.readers is not None:
            self.fail_if("not _int(a, V)")
        else:
            self.fail_if("a is None or isinstance(a, (tuple, list))")
            self.emit("V.append(_int64(a))")

    def _saved(self, pos: int, expr: str, attr: str, index: int) -> None:
        # the same rule as Collector._lift: None, or a lifted tensor
        captured = self._peek_saved(pos, attr, index)
        if index < 0:
            name = sys.intern("_saved_" + attr)
            key = None if captured is None else self._tensor_key(captured)
            if captured is None and self._op((guard_program.NONE, pos, name)):
                return
            if key is not None and self._op((guard_program.TENSOR, pos, name, type(captured), key), _describe_tensor(captured)):
                self.release_slots.append((pos, attr, index))
                return
        self.emit(f"x = {expr}")
        if captured is None:
            self.fail_if("x is not None")
            return
        self.fail_if("x is None")
        self._tensor("x", captured)
        self.emit("L.append(x)")
        self.release_slots.append((pos, attr, index))

    def _peek_saved(self, pos: int, attr: str, index: int) -> Any:
        return self._saved_of.get((id(self.task.order[pos].node), attr, index))
