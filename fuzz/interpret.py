"""Runs an IR program with torch, as a harness :class:`~harness.program.Program`.

Values are deterministic: every leaf is drawn from its own CPU generator
seeded from ``(program.seed, leaf name)`` (uniform in [-1, 1], made in float64
then cast, then moved to the device), so removing a leaf while shrinking does
not change the others, and CPU and CUDA subjects start from the same numbers.
``grad_output``s of loss ``"separate"`` are drawn the same way.

After the forward, the program's hooks are registered in order
(:mod:`fuzz.hooks`); they record into ``ProgramRun.trace``, and the tensors
``retain_grad()`` was called on are appended to ``ProgramRun.leaves`` so that
the harness compares their ``.grad`` too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from fuzz import features_graph
from fuzz import ops as catalog
from fuzz import training_run
from fuzz.hooks import register_hooks
from fuzz.ir import Leaf, Program
from harness.capture_rule import SizeVariant
from harness.program import ProgramRun, ThreadTrace


def derived_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def seeded_uniform(seed: int, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    gen = torch.Generator().manual_seed(derived_seed(seed, key))
    t = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1
    return t.to(dtype).to(device)


def make_leaf(leaf: Leaf, seed: int, device: Any, step: int = 1) -> torch.Tensor:
    key = training_run.step_key(leaf.name, step)
    t = seeded_uniform(seed, key, leaf.shape, catalog.TORCH_DTYPES[leaf.dtype], device)
    return t.requires_grad_(leaf.requires_grad)


def second_values(program: Program, name: str, device: Any) -> torch.Tensor:
    """The second inner tensor of subclass leaf ``name`` (seeded from
    ``"<name>/b"``; :mod:`fuzz.features_graph`)."""
    leaf = next(leaf for leaf in program.leaves if leaf.name == name)
    return seeded_uniform(program.seed, f"{name}/b", leaf.shape, catalog.TORCH_DTYPES[leaf.dtype], device)


def run_forward(
    program: Program, device: Any = "cpu", given: Mapping[str, torch.Tensor] | None = None, step: int = 1
) -> dict[str, torch.Tensor]:
    """Every value of the program by reference (``"v3"``, ``"v4:1"``); the
    leaves named in ``given`` are those tensors, the others are made for
    optimizer step ``step`` (:func:`fuzz.training_run.step_key`) and the
    subclass leaves wrapped (:mod:`fuzz.features_graph`; a program with
    subclass leaves has no ``train``, so ``given`` is then None)."""
    values: dict[str, torch.Tensor] = {}
    for leaf in program.leaves:
        if given is not None and leaf.name in given:
            values[leaf.name] = given[leaf.name]
        else:
            values[leaf.name] = make_leaf(leaf, program.seed, device, step)
    features_graph.wrap_subclass_leaves(program, values, lambda name: second_values(program, name, device))
    training_run.run_ops(program, values)
    return values


def build_run(program: Program, device: Any = "cpu") -> ProgramRun:
    values = run_forward(program, device)
    run = run_from_values(program, values, device, ThreadTrace())
    if program.train is not None:
        run.driver = training_run.make_driver(program, device, values, run_forward, run_from_values)
    return run


def run_from_values(program: Program, values: dict[str, torch.Tensor], device: Any, trace: list[Any]) -> ProgramRun:
    """The run of the forward that made ``values``: hooks registered
    (recording into ``trace``), roots and grad_outputs made."""
    retained = register_hooks(program.hooks, values, trace)
    roots = [values[ref] for ref in program.roots]
    if program.loss == "sum":
        total = roots[0].sum()
        for r in roots[1:]:
            total = total + r.sum()
        outputs: list[torch.Tensor] = [total]
        grad_outputs: list[torch.Tensor | None] | None = None
    else:
        outputs = roots
        grad_outputs = [
            None if r.dim() == 0 else seeded_uniform(program.seed, f"grad_output/{i}", tuple(r.shape), r.dtype, device)
            for i, r in enumerate(roots)
        ]
    return ProgramRun(
        # retained non-leaf .grads are compared like the leaves' (after them)
        leaves=[values[leaf.name] for leaf in program.leaves] + retained,
        outputs=outputs,
        grad_outputs=grad_outputs,
        inputs=None if program.inputs is None else [values[ref] for ref in program.inputs],
        mode=program.mode,  # type: ignore[arg-type]
        retain_graph=program.retain_graph,
        repeat=program.repeat,
        trace=trace,
        # a training program records .grad kept per optimizer step instead
        grads_kept=program.train is None,
        # torch.func terms and a double backward run in the subject's context
        before_backward=features_graph.stage(program, values, trace),
    )


def program_digest(program: Program) -> str:
    text = program.with_name("").to_json(indent=None)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def sizes_label(variant: Program, resized: set[str]) -> str:
    """``"x0[6, 3] x1[3]"``: the shapes of ``variant``'s leaves named in
    ``resized`` (the leaves some step resizes)."""
    shown = [f"{leaf.name}{list(leaf.shape)}" for leaf in variant.leaves if leaf.name in resized]
    return " ".join(shown) if shown else "sizes"


class IRProgram:
    """Adapts an IR :class:`~fuzz.ir.Program` to the harness ``Program``
    protocol; one with ``resizes`` is a size sequence
    (:meth:`size_variants`, see :mod:`harness.capture_rule`)."""

    def __init__(self, program: Program):
        self.program = program
        self.name = program.name or f"fuzz-{program_digest(program)}"

    def build(self, device: torch.device) -> ProgramRun:
        return build_run(self.program.without_resizes(), device)

    def size_variants(self) -> list[SizeVariant]:
        """The program at its own sizes, then at each resize step's."""
        variants = self.program.size_variants()
        resized = {
            b.name for v in variants[1:] for b, leaf in zip(variants[0].leaves, v.leaves) if b.shape != leaf.shape
        }
        return [
            SizeVariant(
                sizes_label(v, resized),
                v.leaf_sizes(),
                IRProgram(v.with_name(self.name)),
                tuple(info.shape for info in v.infer().values()),
            )
            for v in variants
        ]

    def __repr__(self) -> str:
        return f"IRProgram({self.name!r}, {len(self.program.ops)} ops)"


def eager_grads(
    program: Program, device: Any = "cpu", trace: list[Any] | None = None
) -> list[torch.Tensor | None]:
    """The eager results the harness compares: leaf grads (retained grads
    after them) or autograd.grad's tuple; ``trace`` receives the hook events."""
    from harness.program import leaf_grads, run_backward

    run = build_run(program, device)
    result = run_backward(run)
    if trace is not None:
        trace.extend(run.trace)
    return list(result) if program.mode == "grad" else leaf_grads(run)
