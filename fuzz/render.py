"""Renders an IR program as plain, runnable torch code for people to read.

The code makes the same leaves as :mod:`fuzz.interpret` (same seeds, same
order of casts) and runs the same backward, so a reader can paste it into a
bug report without the fuzz package. ``run(device)`` returns what the harness
compares: the leaf ``.grad``s, or the tuple from ``torch.autograd.grad``.
"""

from __future__ import annotations

from fuzz import ops as catalog
from fuzz.interpret import derived_seed
from fuzz.ir import Program


def ref_expr(ref: str) -> str:
    base, _, index = ref.partition(":")
    return f"{base}[{index}]" if index else base


def _uniform(seed: int, key: str, shape: str, dtype: str) -> str:
    return (
        f"(torch.rand({shape}, generator=torch.Generator().manual_seed({derived_seed(seed, key)}), "
        f"dtype=torch.float64) * 2 - 1).to({dtype}).to(device)"
    )


def render_source(program: Program) -> str:
    lines = ["import torch", "", "", "def run(device='cpu'):"]
    body = []
    for leaf in program.leaves:
        expr = _uniform(program.seed, leaf.name, repr(tuple(leaf.shape)), f"torch.{leaf.dtype}")
        body.append(f"{leaf.name} = {expr}.requires_grad_({leaf.requires_grad})")
    for op in program.ops:
        spec = catalog.get(op.op)
        body.append(f"{op.name} = {spec.code([ref_expr(r) for r in op.inputs], op.attrs)}")
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
    inputs = None if program.inputs is None else "[" + ", ".join(ref_expr(r) for r in program.inputs) + "]"
    leaves = "[" + ", ".join(leaf.name for leaf in program.leaves) + "]"
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
        body.append(f"return [leaf.grad for leaf in {leaves}]")
    lines.extend("    " + line for line in body)
    return "\n".join(lines) + "\n"
