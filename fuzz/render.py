"""Renders an IR program as plain, runnable torch code for people to read.

The code makes the same leaves as :mod:`fuzz.interpret` (same seeds, same
order of casts), registers the same hooks (:mod:`fuzz.hooks`, written out as
small functions) and runs the same backward, so a reader can paste it into a
bug report without the fuzz package: the custom ``autograd.Function`` s it
uses are copied in from :mod:`fuzz.functions`. ``run(device, trace=None)``
returns what the harness compares: the leaf ``.grad`` s (then the retained
non-leaf ``.grad`` s), or the tuple from ``torch.autograd.grad``; hook events
are appended to ``trace`` when a list is given.

A size sequence (``resizes``) renders leaf shapes through ``resize`` (a
``{old size: new size}`` dict argument of ``run``), the steps as
``RESIZES`` (``{}`` first: the program's own sizes), and
``run_sequence(device)``, which loops over them and returns each run's
results, as the harness runs the variants.
"""

from __future__ import annotations

import inspect

from fuzz import features_graph, functions
from fuzz import ops as catalog
from fuzz import subclass_leaves, training_render
from fuzz.interpret import derived_seed
from fuzz.ir import Hook, Program


def ref_expr(ref: str) -> str:
    base, _, index = ref.partition(":")
    return f"{base}[{index}]" if index else base


def _uniform(seed: int, key: str, shape: str, dtype: str) -> str:
    return (
        f"(torch.rand({shape}, generator=torch.Generator().manual_seed({derived_seed(seed, key)}), "
        f"dtype=torch.float64) * 2 - 1).to({dtype}).to(device)"
    )


def _function_sources(program: Program) -> list[str]:
    names: list[str] = []
    for op in program.ops:
        for name in catalog.get(op.op).functions:
            if name not in names:
                names.append(name)
    return [inspect.getsource(functions.FUNCTIONS[name]) for name in names]


_COPY = "None if {0} is None else {0}.detach().clone()"


def _hook_lines(hook: Hook) -> list[str]:
    """A hook function named after the hook, then its registration."""
    name, label, target = hook.name, repr(hook.label), ref_expr(hook.target)
    if hook.kind == "retain_grad":
        return [f"{target}.retain_grad()", f"retained.append({target})"]
    if hook.kind == "tensor" and hook.action == "inner_grad":
        return [*features_graph.inner_grad_hook_source(hook), f"{target}.register_hook({name})"]
    if hook.kind == "tensor" and hook.action in ("pure_scale", "pure_shift"):
        op = "*" if hook.action == "pure_scale" else "+"
        return [
            f"def {name}(g):",
            f"    return None if g is None else g {op} {hook.arg!r}",
            f"{target}.register_hook({name})",
        ]
    if hook.kind == "tensor":
        body = [f"trace.append(({label}, {_COPY.format('g')}))"]
        if hook.action == "scale":
            body.append(f"return None if g is None else g * {hook.arg!r}")
        elif hook.action == "shift":
            body.append(f"return None if g is None else g + {hook.arg!r}")
        elif hook.action == "zero":
            body.append("return None if g is None else torch.zeros_like(g)")
        elif hook.action == "warn":
            body.append(f"warnings.warn({hook.label + ' saw a gradient'!r}, UserWarning, stacklevel=1)")
        elif hook.action == "callback":
            body = [
                f"seen = {_COPY.format('g')}",
                f"trace.append(({label}, seen))",
                f"torch.autograd.Variable._execution_engine.queue_callback(lambda: trace.append(({hook.label + ' callback'!r}, seen)))",
            ]
        return [f"def {name}(g):", *("    " + b for b in body), f"{target}.register_hook({name})"]
    if hook.kind in ("pre", "post") and hook.action == "pure_scale":
        args, grads = ("grad_outputs", "grad_outputs") if hook.kind == "pre" else ("grad_inputs, grad_outputs", "grad_inputs")
        register = "register_prehook" if hook.kind == "pre" else "register_hook"
        return [
            f"def {name}({args}):",
            "    out = ()",
            f"    for g in {grads}:",
            f"        out = out + ((None if g is None else g * {hook.arg!r}),)",
            "    return out",
            f"{target}.grad_fn.{register}({name})",
        ]
    if hook.kind == "pre":
        body = [f"trace.append(({label}, tuple({_COPY.format('g')} for g in grad_outputs)))"]
        if hook.action == "scale":
            body.append(f"return tuple(None if g is None else g * {hook.arg!r} for g in grad_outputs)")
        return [f"def {name}(grad_outputs):", *("    " + b for b in body), f"{target}.grad_fn.register_prehook({name})"]
    if hook.kind == "post":
        body = [
            f"trace.append(({label}, (tuple({_COPY.format('g')} for g in grad_inputs), "
            f"tuple({_COPY.format('g')} for g in grad_outputs))))"
        ]
        if hook.action == "scale":
            body.append("if grad_inputs:")
            body.append(f"    return tuple(None if g is None else g * {hook.arg!r} for g in grad_inputs)")
        elif hook.action == "drop":
            body.append("if grad_inputs:  # one grad input becomes None")
            body.append(
                f"    return tuple(None if i == {hook.arg!r} % len(grad_inputs) else g for i, g in enumerate(grad_inputs))"
            )
        return [f"def {name}(grad_inputs, grad_outputs):", *("    " + b for b in body), f"{target}.grad_fn.register_hook({name})"]
    if hook.kind == "post_accumulate":
        lines = [f"def {name}(p):", f"    trace.append(({label}, {_COPY.format('p.grad')}))"]
        if hook.action == "callback":
            lines.append(
                "    torch.autograd.Variable._execution_engine.queue_callback("
                f"lambda: trace.append(({hook.label + ' callback'!r}, {_COPY.format('p.grad')})))"
            )
        return [*lines, f"{target}.register_post_accumulate_grad_hook({name})"]
    raise ValueError(f"unknown hook kind {hook.kind!r}")  # pragma: no cover - validate() rejects it


def _grads_kept_lines(repeat: int, leaves: str) -> list[str]:
    """After each backward but the first: whether each leaf's ``.grad`` is
    still the tensor the first left (``harness.program.ProgramRun.grads_kept``)."""
    return [
        "    if kept_from is None:",
        f"        kept_from = [leaf.grad for leaf in {leaves}]",
        "        continue",
        f"    for i, (leaf, old) in enumerate(zip({leaves}, kept_from)):",
        f"        trace.append((f'backward {{k + 1}}/{repeat}: leaf {{i}} .grad kept', None if old is None else leaf.grad is old))",
    ]


def render_source(program: Program) -> str:
    lines = ["import torch", *training_render.imports(program)]
    if any(h.action == "warn" for h in program.hooks):
        lines.insert(0, "import warnings")
    lines.extend(subclass_leaves.imports(program.subclass_kind, bool(program.subclass_leaves)))
    sources = _function_sources(program)
    if any("once_differentiable" in src for src in sources):
        lines.append("from torch.autograd.function import once_differentiable")
    for src in sources:
        lines.extend(["", "", src.rstrip("\n")])
    lines.extend(training_render.definitions(program))
    helpers = subclass_leaves.definitions(program.subclass_kind, bool(program.subclass_leaves))
    if helpers:
        lines.extend(["", "", *helpers])
    sequence = bool(program.resizes)
    lines.extend(["", "", "def run(device='cpu', trace=None, resize=None):" if sequence else "def run(device='cpu', trace=None):"])
    body: list[str] = []
    fresh: list[str] = []
    if sequence:
        body.append("resize = resize or {}  # {old size: new size} for every leaf shape entry")
    for leaf in program.leaves:
        shape = repr(tuple(leaf.shape))
        if sequence:
            shape = f"tuple(resize.get(d, d) for d in {shape})"
        if program.train is not None and leaf.name in program.train.fresh:
            fresh.append(training_render.fresh_leaf_line(program, leaf, shape))  # drawn at each step
            continue
        expr = _uniform(program.seed, leaf.name, shape, f"torch.{leaf.dtype}")
        body.append(f"{leaf.name} = {expr}.requires_grad_({leaf.requires_grad})")
        if leaf.name in program.subclass_leaves:
            second = _uniform(program.seed, f"{leaf.name}/b", shape, f"torch.{leaf.dtype}")
            placement = subclass_leaves.placement_expr(program.seed, leaf.name, len(leaf.shape))
            offsets = subclass_leaves.offsets_expr(program.seed, leaf.name, tuple(leaf.shape))
            body.append(
                subclass_leaves.leaf_line(
                    program.subclass_kind, leaf.name, leaf.requires_grad, second, placement, offsets
                )
            )
    outer, body = body, fresh  # training: the rest runs once per optimizer step
    body.extend(training_render.op_lines(program))
    stage = features_graph.stage_source(program)
    if program.hooks or stage:
        if program.train is None:
            body.append("trace = [] if trace is None else trace")
        if any(h.kind == "retain_grad" for h in program.hooks):
            body.append("retained = []")
        for hook in program.hooks:
            body.extend(_hook_lines(hook))
    roots = [ref_expr(r) for r in program.roots]
    if program.loss == "sum":
        body.append(f"outputs = [{' + '.join(f'{r}.sum()' for r in roots)}]")
        body.append("grad_outputs = None")
    else:
        body.append(f"outputs = [{', '.join(roots)}]")
        gos = []
        for i, r in enumerate(roots):
            gos.append(
                f"None if {r}.dim() == 0 else " + _uniform(program.seed, f"grad_output/{i}", f"{r}.shape", f"{r}.dtype")
            )
        body.append("grad_outputs = [")
        body.extend(f"    {g}," for g in gos)
        body.append("]")
    body.extend(stage)
    inputs = None if program.inputs is None else "[" + ", ".join(ref_expr(r) for r in program.inputs) + "]"
    leaves = "[" + ", ".join(leaf.name for leaf in program.leaves) + "]"
    if any(h.kind == "retain_grad" for h in program.hooks):
        leaves += " + retained"
    retain = program.retain_graph
    body.append(f"for _ in range({program.repeat}):")
    if program.mode == "grad":
        body.append(
            f"    result = torch.autograd.grad(outputs, {inputs}, grad_outputs=grad_outputs, "
            f"retain_graph={retain}, allow_unused=True)"
        )
        body.append("return list(result)")
    else:
        body.append(
            f"    torch.autograd.backward(outputs, grad_tensors=grad_outputs, retain_graph={retain}, inputs={inputs})"
        )
        if program.repeat > 1 and program.train is None:
            body[-2:-1] = [
                *([] if program.hooks or stage else ["trace = [] if trace is None else trace"]),
                "kept_from = None  # each .grad the first backward left",
                f"for k in range({program.repeat}):",
            ]
            body.extend(_grads_kept_lines(program.repeat, leaves))
        body.append(f"return [leaf.grad for leaf in {leaves}]")
    body = outer + training_render.step_loop(program, body) if program.train is not None else outer + body
    lines.extend("    " + line for line in body)
    if sequence:
        steps = ", ".join("{" + ", ".join(f"{old}: {new}" for old, new in step) + "}" for step in program.resizes)
        lines.extend(
            [
                "",
                "",
                "# the size sequence: the program's own sizes, then each step's",
                f"RESIZES = [{{}}, {steps}]",
                "",
                "",
                "def run_sequence(device='cpu'):",
                "    return [run(device, resize=resize) for resize in RESIZES]",
            ]
        )
    return "\n".join(lines) + "\n"
