"""Validation and shape inference of a program IR (:class:`fuzz.ir.Program`).

* :func:`validate`: checks every field of a program, runs shape inference op
  by op (each op's attribute schema and shape rule come from the catalog
  :mod:`fuzz.ops`) and returns the :class:`~fuzz.ir_types.ValueInfo` of every
  value; the graph and training fields are checked by
  :func:`fuzz.ir_graph.check` and :func:`fuzz.features_training.validate`;
* :func:`check_resizes`: every step of a size sequence gives a valid program;
* :func:`check_hook`: one hook on a program's values;
* :func:`infer_outputs`: the infos of one op's outputs;
* :func:`inplace_conflicts`: the views eager rejects once their base is
  modified in place.

Every check raises :class:`~fuzz.ir_check.IRError` naming the field
(``ops[3].inputs[1]``, ``hooks[2].target``, ``resizes[1]``). ``program``
arguments are :class:`fuzz.ir.Program` s (this module does not import
:mod:`fuzz.ir`, which imports it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fuzz import features_training, ir_graph
from fuzz.ir_check import REF_RE as _REF_RE
from fuzz.ir_check import IRError, check_identifier
from fuzz.ir_check import expect as _expect
from fuzz.ir_check import is_int as _is_int
from fuzz.ir_types import ARG_ACTIONS, DTYPES, HOOK_KINDS, LOSSES, MODES, Hook, ValueInfo


def validate(program: Any) -> dict[str, ValueInfo]:
    """Checks every field and runs shape inference.

    Returns the inferred :class:`ValueInfo` of every value reference; raises
    :class:`IRError` naming the first problem found.
    """
    from fuzz import ops as catalog

    _expect(isinstance(program.name, str), "name", f"expected a string, got {program.name!r}")
    _expect(_is_int(program.seed) and program.seed >= 0, "seed", f"expected an int >= 0, got {program.seed!r}")
    _expect(program.loss in LOSSES, "loss", f"unknown loss {program.loss!r}; expected one of {list(LOSSES)}")
    _expect(program.mode in MODES, "mode", f"unknown mode {program.mode!r}; expected one of {list(MODES)}")
    _expect(
        program.retain_graph is None or isinstance(program.retain_graph, bool),
        "retain_graph",
        f"expected a bool or null, got {program.retain_graph!r}",
    )
    _expect(_is_int(program.repeat) and program.repeat >= 1, "repeat", f"expected an int >= 1, got {program.repeat!r}")
    _expect(
        program.repeat == 1 or program.retain_graph is True,
        "repeat",
        f"repeat={program.repeat} needs retain_graph=true",
    )

    values: dict[str, ValueInfo] = {}
    names: set[str] = set()
    multi: dict[str, int] = {}
    # views made before an in-place write into their memory: their grad_fn
    # is stale until read (see the tensor-hook rule below)
    stale_views: set[str] = set()

    def declare(name: Any, where: str) -> None:
        check_identifier(name, where)
        _expect(name not in names, where, f"duplicate name {name!r}")
        names.add(name)

    for i, leaf in enumerate(program.leaves):
        where = f"leaves[{i}]"
        declare(leaf.name, f"{where}.name")
        _expect(
            leaf.dtype in DTYPES, f"{where}.dtype", f"unknown dtype {leaf.dtype!r}; expected one of {list(DTYPES)}"
        )
        _expect(
            isinstance(leaf.shape, tuple) and all(_is_int(d) and d >= 0 for d in leaf.shape),
            f"{where}.shape",
            f"expected non-negative ints, got {list(leaf.shape)!r}",
        )
        _expect(isinstance(leaf.requires_grad, bool), f"{where}.requires_grad", "expected a bool")
        values[leaf.name] = ValueInfo(leaf.name, leaf.shape, leaf.dtype, leaf.requires_grad, is_leaf=True)

    def resolve(ref: Any, where: str) -> ValueInfo:
        _expect(isinstance(ref, str), where, f"expected a value reference (string), got {ref!r}")
        m = _REF_RE.match(ref)
        _expect(m is not None, where, f"malformed value reference {ref!r}")
        base, index = m.group(1), m.group(2)
        if base in multi:
            n = multi[base]
            _expect(
                index is not None,
                where,
                f"{base!r} has {n} outputs; refer to one as '{base}:0' .. '{base}:{n - 1}'",
            )
            _expect(int(index) < n, where, f"{ref!r}: {base!r} has only {n} outputs")
        else:
            _expect(index is None or base not in values, where, f"{base!r} has a single output; write {base!r}")
        _expect(ref in values, where, f"unknown value {ref!r} (not a leaf or an earlier op's output)")
        return values[ref]

    for i, op in enumerate(program.ops):
        where = f"ops[{i}]"
        declare(op.name, f"{where}.name")
        _expect(isinstance(op.op, str) and op.op in catalog.OPS, f"{where}.op", f"unknown op {op.op!r}")
        spec = catalog.OPS[op.op]
        n_in = len(op.inputs)
        _expect(
            spec.min_arity <= n_in <= spec.max_arity,
            f"{where}.inputs",
            f"{op.op} takes {spec.arity_text()} input(s), got {n_in}",
        )
        infos = [resolve(ref, f"{where}.inputs[{j}]") for j, ref in enumerate(op.inputs)]
        try:
            catalog.check_attrs(spec, op.attrs)
            outs = infer_outputs(spec, op.name, op.attrs, infos)
        except catalog.AttrError as e:
            raise IRError(f"{where}.attrs" + (f".{e.attr}" if e.attr else ""), f"{op.op}: {e}") from None
        except catalog.DTypeError as e:
            dtypes = ", ".join(info.dtype for info in infos)
            raise IRError(where, f"{op.op}: dtype mismatch: {e} (input dtypes {dtypes})") from None
        except catalog.ShapeError as e:
            shapes = ", ".join(str(list(info.shape)) for info in infos)
            raise IRError(where, f"{op.op}: shape mismatch: {e} (input shapes {shapes})") from None
        if spec.inplace_first:
            _expect(
                infos[0].fresh and infos[0].requires_grad and not infos[0].is_leaf,
                f"{where}.inputs[0]",
                f"{op.op} writes into its first input in place: {infos[0].ref!r} must be a fresh (non-view) "
                "op output that requires grad, not a leaf or a view",
            )
            for j, info in enumerate(infos[1:], 1):
                _expect(
                    info.fresh or info.is_leaf,
                    f"{where}.inputs[{j}]",
                    f"{op.op}: {info.ref!r} may be a view overlapping the written tensor; use a fresh value or a leaf",
                )
            stale_views.update(views_made_before(infos[0], values))
            stale = inplace_conflicts(infos[0], values)
            _expect(
                not stale,
                f"{where}.inputs[0]",
                f"{op.op} writes into {infos[0].ref!r} in place, but {stale[0] if stale else ''!r} is a view of it "
                "made by a multi-output view op (split, unbind): eager rejects such a view once its base is "
                "modified in place",
            )
        if spec.multi_output:
            multi[op.name] = len(outs)
        for info in outs:
            values[info.ref] = info

    _expect(len(program.roots) >= 1, "roots", "at least one root is needed")
    for j, ref in enumerate(program.roots):
        info = resolve(ref, f"roots[{j}]")
        _expect(
            info.requires_grad,
            f"roots[{j}]",
            f"root {ref!r} does not require grad (no leaf with requires_grad reaches it)",
        )
    if program.mode == "grad":
        _expect(bool(program.inputs), "inputs", "mode 'grad' needs a non-empty list of inputs")
    if program.inputs is not None:
        _expect(len(program.inputs) >= 1, "inputs", "an empty inputs= list is not allowed (use null)")
        for j, ref in enumerate(program.inputs):
            info = resolve(ref, f"inputs[{j}]")
            _expect(info.requires_grad, f"inputs[{j}]", f"input {ref!r} does not require grad")
            if program.mode == "backward":
                _expect(
                    any(leaf.name == ref for leaf in program.leaves),
                    f"inputs[{j}]",
                    f"mode 'backward' restricts inputs= to leaves; {ref!r} is not a leaf",
                )
        _expect(len(set(program.inputs)) == len(program.inputs), "inputs", "duplicate entries")
    _expect(isinstance(program.hooks, tuple), "hooks", "expected a list of hooks")
    hook_names: set[str] = set()
    for i, hook in enumerate(program.hooks):
        where = f"hooks[{i}]"
        _expect(isinstance(hook, Hook), where, f"expected a hook, got {hook!r}")
        check_identifier(hook.name, f"{where}.name")
        _expect(hook.name not in hook_names, f"{where}.name", f"duplicate hook name {hook.name!r}")
        _expect(hook.name not in names, f"{where}.name", f"hook name {hook.name!r} is also a value's name")
        hook_names.add(hook.name)
        check_hook(hook, where, values, resolve)
        # torch 2.13.0 and 2.14.1 (eager, no cagrad) crash with SIGSEGV in
        # Tensor.register_hook on a view whose base was modified in place
        # after the view was made, unless the view's grad_fn was read first
        # (found by campaign seed 51; docs/fuzzing.md)
        _expect(
            not (hook.kind == "tensor" and hook.target in stale_views),
            f"{where}.target",
            f"{hook.target!r} is a view whose base an in-place op modified after the view was made: "
            "Tensor.register_hook on it crashes eager (SIGSEGV, torch 2.13 and 2.14)",
        )
    ir_graph.check(program, values, resolve, _expect)
    features_training.validate(program, values, _expect)
    check_resizes(program)
    return values


def check_resizes(program: Any) -> None:
    """Raises :class:`IRError` naming ``resizes[i]`` unless every step is a
    non-empty tuple of ``(old, new)`` int pairs (``old`` a size some leaf
    has, at most once per step, ``new`` >= 0 and not ``old``) whose program
    validates without emptying a value that is not empty at the program's
    own sizes (reductions such as ``amax`` reject empty dims)."""
    _expect(isinstance(program.resizes, tuple), "resizes", "expected a tuple of steps")
    sizes = set(program.leaf_sizes())
    own: dict[str, ValueInfo] | None = None
    for i, step in enumerate(program.resizes):
        where = f"resizes[{i}]"
        _expect(
            isinstance(step, tuple)
            and bool(step)
            and all(isinstance(p, tuple) and len(p) == 2 and all(_is_int(v) for v in p) for p in step),
            where,
            f"expected a non-empty list of (old size, new size) int pairs, got {step!r}",
        )
        olds = [old for old, _ in step]
        _expect(len(set(olds)) == len(olds), where, f"size(s) resized twice in one step: {olds}")
        for old, new in step:
            _expect(old in sizes, where, f"no leaf has size {old} (leaf sizes: {sorted(sizes)})")
            _expect(new >= 0, where, f"new size {new} for {old} is negative")
            _expect(new != old, where, f"size {old} is mapped to itself")
        text = ", ".join(f"{old} -> {new}" for old, new in step)
        try:
            resized = validate(program.at_sizes(step))
        except IRError as e:
            raise IRError(where, f"at sizes {text}: {e}") from None
        if own is None:
            own = validate(dataclasses.replace(program, resizes=()))
        for ref, info in resized.items():
            before = own.get(ref)
            _expect(
                before is None or 0 not in info.shape or 0 in before.shape,
                where,
                f"at sizes {text}: {ref} becomes empty {tuple(info.shape)}",
            )


def check_hook(hook: Hook, where: str, values: Mapping[str, ValueInfo], resolve: Any = None) -> None:
    """Raises :class:`IRError` (naming ``where.<field>``) unless ``hook`` is
    valid on the program whose values are ``values``."""
    _expect(
        hook.kind in HOOK_KINDS,
        f"{where}.kind",
        f"unknown hook kind {hook.kind!r}; expected one of {list(HOOK_KINDS)}",
    )
    actions = HOOK_KINDS[hook.kind]
    _expect(
        hook.action in actions,
        f"{where}.action",
        f"a {hook.kind} hook does not take action {hook.action!r}; expected one of {list(actions)}",
    )
    need = ARG_ACTIONS.get(hook.action)
    arg = hook.arg
    if need is None:
        _expect(arg is None, f"{where}.arg", f"action {hook.action!r} takes no arg, got {arg!r}")
    elif need == "number":
        ok = (_is_int(arg) or isinstance(arg, float)) and math.isfinite(arg)
        _expect(ok, f"{where}.arg", f"action {hook.action!r} needs a finite number, got {arg!r}")
    else:
        _expect(_is_int(arg) and arg >= 0, f"{where}.arg", f"action {hook.action!r} needs an int >= 0, got {arg!r}")
    if resolve is not None:
        info = resolve(hook.target, f"{where}.target")
    else:
        _expect(
            isinstance(hook.target, str) and hook.target in values,
            f"{where}.target",
            f"unknown value {hook.target!r}",
        )
        info = values[hook.target]
    _expect(
        info.requires_grad,
        f"{where}.target",
        f"{hook.target!r} does not require grad; a {hook.kind} hook cannot be registered on it",
    )
    if hook.kind in ("retain_grad", "pre", "post"):
        _expect(
            not info.is_leaf,
            f"{where}.target",
            f"a {hook.kind} hook needs a non-leaf value (one with a grad_fn); {hook.target!r} is a leaf",
        )
    if hook.kind == "post_accumulate":
        _expect(
            info.is_leaf,
            f"{where}.target",
            f"a post_accumulate hook needs a leaf; {hook.target!r} is not one",
        )


def infer_outputs(spec: Any, name: str, attrs: Mapping[str, Any], infos: Sequence[ValueInfo]) -> list[ValueInfo]:
    """The :class:`ValueInfo` of every output of op ``name`` (a ``spec`` from
    :mod:`fuzz.ops`) on inputs ``infos``; raises the catalog's ``SpecError`` s."""
    shapes = [info.shape for info in infos]
    dtypes = [info.dtype for info in infos]
    out_shapes = spec.infer(shapes, attrs)
    out_dtype = spec.out_dtype(dtypes, attrs, shapes)
    rg = spec.differentiable and any(info.requires_grad for j, info in enumerate(infos) if j not in spec.nondiff_inputs)
    first = infos[0] if infos else None
    if first is not None and spec.is_identity(shapes, dtypes, attrs):
        return [
            ValueInfo(
                name,
                tuple(out_shapes[0]),
                out_dtype,
                rg,
                is_leaf=first.is_leaf,
                fresh=first.fresh,
                base=first.memory,
                multi_view=first.multi_view,
            )
        ]
    fresh = spec.is_fresh(attrs)
    # a view (or split output) shares its first input's memory; a
    # multi-output view op taints its outputs and every view of them
    shares = first is not None and spec.category in ("view", "split")
    base = first.memory if shares and first is not None else ""
    multi = shares and first is not None and (spec.category == "split" or first.multi_view)
    if spec.multi_output:
        return [
            ValueInfo(f"{name}:{k}", tuple(shape), out_dtype, rg, is_leaf=not rg, fresh=fresh, base=base, multi_view=multi)
            for k, shape in enumerate(out_shapes)
        ]
    return [ValueInfo(name, tuple(out_shapes[0]), out_dtype, rg, is_leaf=not rg, fresh=fresh, base=base, multi_view=multi)]


def inplace_conflicts(written: ValueInfo, values: Mapping[str, ValueInfo]) -> list[str]:
    """The refs among ``values`` (the values made before an in-place op)
    that eager would reject once ``written`` is modified in place: views of
    its memory made by a multi-output view op (``split``, ``unbind``, or a
    view of their outputs). Using one afterwards (as an op input, a root, a
    hook target, ``inputs=``, or even reading ``is_leaf``) raises "... is a
    view and its base or another view of its base has been modified
    inplace", and so does eager's backward when an op saved one before; so
    the model never writes into such a base. Views made by single-output
    ops (``slice``, ``view``, ...) stay usable: autograd regenerates their
    ``grad_fn``."""
    memory = written.memory
    return [ref for ref, v in values.items() if v.multi_view and v.memory == memory]


def views_made_before(written: ValueInfo, values: Mapping[str, ValueInfo]) -> list[str]:
    """The refs among ``values`` (the values made before an in-place op)
    that are views of ``written``'s memory: once it is modified in place,
    ``Tensor.register_hook`` on one of them crashes eager (SIGSEGV, torch
    2.13 and 2.14), so neither :func:`validate` nor the generator allows a
    tensor hook there."""
    memory = written.memory
    return [ref for ref, v in values.items() if v.base and v.memory == memory]


__all__ = ["check_hook", "check_resizes", "infer_outputs", "inplace_conflicts", "validate", "views_made_before"]
