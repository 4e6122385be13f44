"""Plain-torch rendering of the training features (:mod:`fuzz.features_training`).

:mod:`fuzz.render` calls these for the parts of ``run()`` that the
features change: the ops (a checkpointed region becomes a nested function
passed to ``torch.utils.checkpoint.checkpoint``), the leaves drawn anew at
each optimizer step, and the optimizer loop, which appends to ``trace`` the
same ``(label, value)`` pairs :mod:`fuzz.training_run` records (the random
stream as the first 16 hex digits of the sha256 of the generator state, as
:mod:`harness.global_state` writes it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fuzz import ops as catalog
from fuzz.interpret import derived_seed

_POLICY = "checkpoint_policy"


def imports(program: Any) -> list[str]:
    out = []
    if program.train is not None:
        out.append("import hashlib")
    if program.checkpoint is not None and program.checkpoint.policy is not None:
        out += ["import functools", "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts"]
    return out


def definitions(program: Any) -> list[str]:
    """Module-level code: the selective checkpoint policy function."""
    c = program.checkpoint
    if c is None or c.policy is None:
        return []
    if c.policy == "save_all":
        body = ["    return CheckpointPolicy.MUST_SAVE"]
    elif c.policy == "recompute_all":
        body = ["    return CheckpointPolicy.PREFER_RECOMPUTE"]
    else:
        body = [
            "    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}",
            "    return CheckpointPolicy.MUST_SAVE if op in matmuls else CheckpointPolicy.PREFER_RECOMPUTE",
        ]
    return ["", "", f"def {_POLICY}(ctx, op, *args, **kwargs):  # selective checkpoint: {c.policy}", *body]


def fresh_leaf_line(program: Any, leaf: Any, shape: str) -> str:
    """A ``train.fresh`` leaf, drawn at each step from a seed of its own."""
    from fuzz.training_run import step_key

    seeds = ", ".join(f"{s}: {derived_seed(program.seed, step_key(leaf.name, s))}" for s in range(1, program.train.steps + 1))
    return (
        f"{leaf.name} = (torch.rand({shape}, generator=torch.Generator().manual_seed({{{seeds}}}[step]), "
        f"dtype=torch.float64) * 2 - 1).to(torch.{leaf.dtype}).to(device).requires_grad_({leaf.requires_grad})"
    )


def _ref_expr(ref: str) -> str:
    base, _, index = ref.partition(":")
    return f"{base}[{index}]" if index else base


def op_lines(program: Any) -> list[str]:
    """The ops as statements; a checkpoint region as a nested function
    ``region`` and one ``torch.utils.checkpoint.checkpoint`` call."""
    c = program.checkpoint
    if c is None:
        return [line for op in program.ops for line in _statements(op, _ref_expr)]
    from fuzz.features_training import region_io

    inputs, outputs = region_io(program, program.infer())
    params = {ref: "in_" + ref.replace(":", "_") for ref in inputs}
    region = set(c.ops)
    out: list[str] = []
    for op in program.ops:
        if op.name not in region:
            out += _statements(op, _ref_expr)
            continue
        if op.name != c.ops[0]:
            continue
        out.append(f"def region({', '.join(params[r] for r in inputs)}):")
        for inner in (o for o in program.ops if o.name in region):
            out += ["    " + line for line in _statements(inner, lambda r: params.get(r) or _ref_expr(r))]
        out.append(f"    return ({''.join(_ref_expr(r) + ', ' for r in outputs)})")
        kwargs = f"use_reentrant={c.use_reentrant}"
        if c.policy is not None:
            kwargs += f", context_fn=functools.partial(create_selective_checkpoint_contexts, {_POLICY})"
        out.append(f"region_out = torch.utils.checkpoint.checkpoint(region, {', '.join(_ref_expr(r) for r in inputs)}, {kwargs})")
        multi: dict[str, list[str]] = {}
        for k, ref in enumerate(outputs):
            base, _, index = ref.partition(":")
            if index:
                multi.setdefault(base, []).append(f"{index}: region_out[{k}]")
            else:
                out.append(f"{ref} = region_out[{k}]")
        out += [f"{base} = {{{', '.join(items)}}}  # the outputs of {base} the region returns" for base, items in multi.items()]
    return out


def _statements(op: Any, expr: Any) -> list[str]:
    return catalog.get(op.op).statements(op.name, [expr(r) for r in op.inputs], op.attrs)


def step_loop(program: Any, step_body: Sequence[str]) -> list[str]:
    """The optimizer loop around ``step_body`` (one step's forward and
    backward, ending in the ``return`` line, which goes after the loop)."""
    t = program.train
    k = t.steps
    params = [leaf.name for leaf in program.leaves if leaf.requires_grad and leaf.name not in t.fresh]
    names = [leaf.name for leaf in program.leaves]
    cls = "SGD" if t.optimizer == "sgd" else "Adam"
    *work, ret = step_body
    at = f"f'train step {{step}}/{k}: "
    lines = [
        "trace = [] if trace is None else trace",
        f"params = [{', '.join(params)}]",
        f"optimizer = torch.optim.{cls}(params, lr={t.lr!r}, foreach={t.foreach})",
        f"for step in range(1, {k + 1}):",
        f"    optimizer.zero_grad(set_to_none={t.set_to_none})",
        *("    " + line for line in work[: len(work) - 2]),  # the forward (the backward loop is the last 2 lines)
        f"    trace.append(({at}outputs', [o.detach().clone() for o in outputs]))",
        f"    found = [{', '.join(f'{n}.grad' for n in names)}]",
        *("    " + line for line in work[len(work) - 2 :]),
        *(f"    trace.append(({at}{n} .grad', None if {n}.grad is None else {n}.grad.detach().clone()))" for n in names),
        *(
            f"    trace.append(({at}{n} .grad kept', None if found[{i}] is None else {n}.grad is found[{i}]))"
            for i, n in enumerate(names)
        ),
        f"    trace.append(({at}state cpu_rng', hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]))",
        "    if torch.device(device).type == 'cuda':",
        (
            f"        trace.append(({at}state cuda_rng', tuple(hashlib.sha256(s.cpu().numpy().tobytes()).hexdigest()[:16] "
            "for s in torch.cuda.get_rng_state_all())))"
        ),
        "    optimizer.step()",
        *(f"    trace.append(({at}{n}', {n}.detach().clone()))" for n in params),
        ret,
    ]
    return lines
