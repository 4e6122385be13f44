"""Program features that train: optimizer steps and checkpointed regions.

Two optional fields of :class:`fuzz.ir.Program` (schema 2, written only when
set, so programs without them keep their JSON):

* ``train`` (:class:`Training`): the program runs ``steps`` (1 to
  :data:`MAX_STEPS`) optimizer steps, not one backward. Each step:
  ``optimizer.zero_grad(set_to_none=...)``, the forward (step 1's is the
  build's; the leaves named in ``fresh`` are drawn anew from a seed of
  their own at every step: the data, not optimized), the hooks, the
  backward (``repeat`` times), then ``optimizer.step()``. The parameters
  are the leaves that require grad and are not ``fresh``; the optimizer is
  ``torch.optim.SGD`` or ``torch.optim.Adam`` with ``foreach`` on or off.
  After every step the run records (:class:`harness.program.Observation`,
  compared with eager's by the oracle): the outputs (the loss), every
  leaf's ``.grad``, the CPU (and CUDA) random stream after the backward,
  and every parameter after ``step()``.
* ``checkpoint`` (:class:`Checkpoint`): the ops named in ``ops`` (a
  contiguous run of the program's ops) run inside
  ``torch.utils.checkpoint.checkpoint(region, *inputs,
  use_reentrant=...)``, with a selective checkpoint policy
  (``create_selective_checkpoint_contexts``) when ``policy`` is set; the
  region's inputs are the values it reads from outside, its outputs the
  values it makes that anything outside reads (a later op, a root, an
  ``inputs=`` entry, a hook). Random ops inside the region are replayed in
  the backward from the saved random state, so the backward itself touches
  the random stream.

The random ops (``dropout``, ``rand_mul``, ``bernoulli_mask``) and the ops
whose values decide sizes (``nonzero_scatter``, ``masked_select_scatter``,
``moe``) are ops of the catalog (:mod:`fuzz.ops_dynamic`), not fields.

:func:`program_features` names what a program exercises of all this, for
coverage tables. This module imports nothing of the fuzzer at import time
(:mod:`fuzz.ir` imports it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from fuzz.ir_check import is_int as _is_int

MAX_STEPS = 3
OPTIMIZERS = ("sgd", "adam")
#: selective checkpoint policies: what ``policy_fn`` returns per op
POLICIES = ("save_all", "recompute_all", "save_matmul")
RANDOM_OPS = ("dropout", "rand_mul", "bernoulli_mask")
DYNAMIC_OPS = ("nonzero_scatter", "masked_select_scatter", "moe")


@dataclasses.dataclass(frozen=True)
class Training:
    """``steps`` optimizer steps (see the module doc).

    Attributes:
        steps: 1..:data:`MAX_STEPS`.
        optimizer: ``"sgd"`` or ``"adam"``.
        lr: the learning rate, a finite number > 0.
        foreach: the optimizer's ``foreach=`` (the multi-tensor path).
        set_to_none: ``zero_grad(set_to_none=...)`` at the start of each step.
        fresh: leaf names drawn anew at every step (the data; not optimized).
    """

    steps: int = 1
    optimizer: str = "sgd"
    lr: float = 0.1
    foreach: bool = False
    set_to_none: bool = True
    fresh: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "foreach": self.foreach,
            "set_to_none": self.set_to_none,
            "fresh": list(self.fresh),
        }


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A region of ops run under ``torch.utils.checkpoint.checkpoint``.

    Attributes:
        ops: the region's op names, in program order, contiguous.
        use_reentrant: ``checkpoint(..., use_reentrant=...)``.
        policy: None, or one of :data:`POLICIES`: a selective checkpoint
            (``use_reentrant=False`` only).
    """

    ops: tuple[str, ...]
    use_reentrant: bool = False
    policy: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"ops": list(self.ops), "use_reentrant": self.use_reentrant, "policy": self.policy}


_TRAIN_FIELDS = {"steps", "optimizer", "lr", "foreach", "set_to_none", "fresh"}
_CHECKPOINT_FIELDS = {"ops", "use_reentrant", "policy"}
FIELDS = ("train", "checkpoint")


# ----------------------------------------------------------------- parsing
def parse(data: Mapping[str, Any], expect: Callable[[bool, str, str], None]) -> dict[str, Any]:
    """The ``train`` and ``checkpoint`` fields of a program's JSON object
    (absent: None), as keyword arguments of :class:`fuzz.ir.Program`;
    ``expect(cond, where, message)`` raises the IR's error."""
    out: dict[str, Any] = {}
    raw = data.get("train")
    if raw is not None:
        expect(isinstance(raw, dict), "train", f"expected an object or null, got {raw!r}")
        unknown = sorted(set(raw) - _TRAIN_FIELDS)
        expect(not unknown, "train", f"unknown field(s) {unknown}; allowed: {sorted(_TRAIN_FIELDS)}")
        fresh = raw.get("fresh", [])
        expect(isinstance(fresh, list), "train.fresh", f"expected a list of leaf names, got {fresh!r}")
        defaults = Training()
        out["train"] = Training(
            steps=raw.get("steps", defaults.steps),
            optimizer=raw.get("optimizer", defaults.optimizer),
            lr=raw.get("lr", defaults.lr),
            foreach=raw.get("foreach", defaults.foreach),
            set_to_none=raw.get("set_to_none", defaults.set_to_none),
            fresh=tuple(fresh),
        )
    raw = data.get("checkpoint")
    if raw is not None:
        expect(isinstance(raw, dict), "checkpoint", f"expected an object or null, got {raw!r}")
        unknown = sorted(set(raw) - _CHECKPOINT_FIELDS)
        expect(not unknown, "checkpoint", f"unknown field(s) {unknown}; allowed: {sorted(_CHECKPOINT_FIELDS)}")
        expect("ops" in raw, "checkpoint", "missing field(s) ['ops']")
        ops = raw["ops"]
        expect(isinstance(ops, list), "checkpoint.ops", f"expected a list of op names, got {ops!r}")
        out["checkpoint"] = Checkpoint(tuple(ops), raw.get("use_reentrant", False), raw.get("policy"))
    return out


def to_dict(program: Any) -> dict[str, Any]:
    """The JSON entries of the fields that are set (none when neither is)."""
    out: dict[str, Any] = {}
    if program.train is not None:
        out["train"] = program.train.to_dict()
    if program.checkpoint is not None:
        out["checkpoint"] = program.checkpoint.to_dict()
    return out


# -------------------------------------------------------------- validation
def validate(program: Any, values: Mapping[str, Any], expect: Callable[[bool, str, str], None]) -> None:
    """Checks ``train`` and ``checkpoint`` of ``program`` whose inferred
    values (:class:`fuzz.ir.ValueInfo` by ref) are ``values``; raises the
    IR's error through ``expect`` naming the field (``train.steps``,
    ``checkpoint.ops[1]``)."""
    if program.train is not None:
        _validate_train(program, expect)
    if program.checkpoint is not None:
        _validate_checkpoint(program, values, expect)


def _validate_train(program: Any, expect: Callable[[bool, str, str], None]) -> None:
    t = program.train
    expect(isinstance(t, Training), "train", f"expected a Training, got {t!r}")
    expect(
        _is_int(t.steps) and 1 <= t.steps <= MAX_STEPS,
        "train.steps",
        f"expected an int in 1..{MAX_STEPS}, got {t.steps!r}",
    )
    expect(t.optimizer in OPTIMIZERS, "train.optimizer", f"unknown optimizer {t.optimizer!r}; expected one of {list(OPTIMIZERS)}")
    ok = (_is_int(t.lr) or isinstance(t.lr, float)) and math.isfinite(t.lr) and t.lr > 0
    expect(ok, "train.lr", f"expected a finite number > 0, got {t.lr!r}")
    expect(isinstance(t.foreach, bool), "train.foreach", f"expected a bool, got {t.foreach!r}")
    expect(isinstance(t.set_to_none, bool), "train.set_to_none", f"expected a bool, got {t.set_to_none!r}")
    expect(isinstance(t.fresh, tuple), "train.fresh", f"expected a list of leaf names, got {t.fresh!r}")
    leaves = {leaf.name: leaf for leaf in program.leaves}
    for j, name in enumerate(t.fresh):
        expect(name in leaves, f"train.fresh[{j}]", f"{name!r} is not a leaf of the program")
        expect(name not in t.fresh[:j], f"train.fresh[{j}]", f"{name!r} is listed twice")
    params = [leaf for leaf in program.leaves if leaf.requires_grad and leaf.name not in t.fresh]
    expect(bool(params), "train", "no parameter to optimize: every leaf that requires grad is in train.fresh")
    expect(
        program.mode == "backward",
        "train",
        "training needs mode 'backward' (the optimizer reads .grad; autograd.grad leaves it unset)",
    )


def region_io(program: Any, values: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``(inputs, outputs)`` of the checkpoint region: the refs its ops read
    from outside it (in first-use order), and the refs it makes that are
    read outside it (a later op, a root, ``inputs=``, a hook), in order of
    definition."""
    region = set(program.checkpoint.ops)
    inputs: list[str] = []
    for op in program.ops:
        if op.name in region:
            for ref in op.inputs:
                if ref.split(":", 1)[0] not in region and ref not in inputs:
                    inputs.append(ref)
    used: set[str] = set(program.roots) | set(program.inputs or ()) | {h.target for h in program.hooks}
    for op in program.ops:
        if op.name not in region:
            used.update(op.inputs)
    outputs = [ref for ref in values if ref.split(":", 1)[0] in region and ref in used]
    return inputs, outputs


def _validate_checkpoint(program: Any, values: Mapping[str, Any], expect: Callable[[bool, str, str], None]) -> None:
    c = program.checkpoint
    expect(isinstance(c, Checkpoint), "checkpoint", f"expected a Checkpoint, got {c!r}")
    expect(isinstance(c.ops, tuple) and bool(c.ops), "checkpoint.ops", "expected a non-empty list of op names")
    index = {op.name: i for i, op in enumerate(program.ops)}
    for j, name in enumerate(c.ops):
        expect(isinstance(name, str) and name in index, f"checkpoint.ops[{j}]", f"{name!r} is not an op of the program")
        if j:
            expect(
                index[name] == index[c.ops[j - 1]] + 1,
                f"checkpoint.ops[{j}]",
                f"the region must be a contiguous run of ops in program order; {name!r} does not follow {c.ops[j - 1]!r}",
            )
    expect(isinstance(c.use_reentrant, bool), "checkpoint.use_reentrant", f"expected a bool, got {c.use_reentrant!r}")
    expect(
        c.policy is None or c.policy in POLICIES,
        "checkpoint.policy",
        f"unknown policy {c.policy!r}; expected null or one of {list(POLICIES)}",
    )
    if c.policy is not None:
        expect(not c.use_reentrant, "checkpoint.policy", "a selective checkpoint policy needs use_reentrant=false")
        expect(has_selective(), "checkpoint.policy", "this torch has no torch.utils.checkpoint.create_selective_checkpoint_contexts")
        # torch: "You are only allowed to backward once on any region
        # computed under selective activation checkpoint" once a second
        # backward over the same graph reads an output the policy saved
        # (save_all: any op; save_matmul: a matmul); recompute_all saves none
        expect(
            program.repeat <= 1 or c.policy == "recompute_all",
            "checkpoint.policy",
            f"a selective checkpoint region whose policy saves outputs ({c.policy!r}) allows one backward"
            " per forward: repeat must be 1",
        )
    inputs, outputs = region_io(program, values)
    expect(bool(outputs), "checkpoint.ops", "nothing outside the region reads a value it makes")
    region = set(c.ops)
    from fuzz import ops as catalog

    if c.policy in ("save_all", "save_matmul"):
        # torch raises "Tensor cached during selective activation checkpoint
        # has been mutated" in the forward when an op writes into a tensor
        # the policy saved: random ops fill their result in place
        # (bernoulli_, uniform_), the in-place ops write into op outputs
        banned = ("random", "inplace_view", "inplace") if c.policy == "save_all" else ("inplace",)
        for j, name in enumerate(c.ops):
            op = next(o for o in program.ops if o.name == name)
            category = catalog.OPS[op.op].category
            expect(
                category not in banned,
                f"checkpoint.ops[{j}]",
                f"policy {c.policy!r} saves what {op.op} ({category}) writes into in place; torch rejects that",
            )
    if c.use_reentrant:
        expect(
            any(values[r].requires_grad for r in inputs),
            "checkpoint.use_reentrant",
            "a reentrant checkpoint needs an input that requires grad (its outputs would not)",
        )
        expect(
            program.inputs is None,
            "checkpoint.use_reentrant",
            "a reentrant checkpoint is not compatible with autograd.grad or backward(inputs=...)",
        )
        for ref in outputs:
            owner = values[ref].memory.split(":", 1)[0]
            expect(
                owner in region,
                "checkpoint.ops",
                f"region output {ref!r} shares memory with {values[ref].memory!r}, made outside the region; "
                "a reentrant checkpoint returns it from an autograd.Function",
            )
    # in-place writes: inside the region only into memory made there; after
    # it never into memory of the region's inputs or outputs (its saved state)
    touched = {values[r].memory for r in inputs} | {values[r].memory for r in values if r.split(":", 1)[0] in region}
    seen_region = False
    for i, op in enumerate(program.ops):
        spec = catalog.OPS.get(op.op)
        inside = op.name in region
        seen_region = seen_region or inside
        if spec is None or not spec.inplace_first or not op.inputs:
            continue
        memory = values[op.inputs[0]].memory
        if inside:
            expect(
                memory.split(":", 1)[0] in region,
                f"ops[{i}].inputs[0]",
                f"{op.op} inside the checkpoint region writes into {op.inputs[0]!r}, made outside it",
            )
        elif seen_region:
            expect(
                memory not in touched,
                f"ops[{i}].inputs[0]",
                f"{op.op} after the checkpoint region writes into {op.inputs[0]!r}, whose memory the region reads or makes",
            )


def has_selective() -> bool:
    import torch.utils.checkpoint as cp

    return hasattr(cp, "create_selective_checkpoint_contexts")


# ----------------------------------------------------------------- editing
def tidy(program: Any) -> Any:
    """``program`` with the fields' references to ops and leaves it no
    longer has dropped (after a reduction or pruning removed them): the
    region keeps its ops that remain (``None`` when none does), ``fresh``
    its leaves that remain (``train`` is ``None`` when no parameter, a leaf
    that requires grad and is not ``fresh``, remains). Not validated."""
    changes: dict[str, Any] = {}
    if program.checkpoint is not None:
        names = {op.name for op in program.ops}
        kept = tuple(n for n in program.checkpoint.ops if n in names)
        if kept != program.checkpoint.ops:
            changes["checkpoint"] = dataclasses.replace(program.checkpoint, ops=kept) if kept else None
    if program.train is not None:
        names = {leaf.name for leaf in program.leaves}
        kept_fresh = tuple(n for n in program.train.fresh if n in names)
        if not any(leaf.requires_grad and leaf.name not in kept_fresh for leaf in program.leaves):
            changes["train"] = None  # no parameter left for the optimizer: no training
        elif kept_fresh != program.train.fresh:
            changes["train"] = dataclasses.replace(program.train, fresh=kept_fresh)
    return dataclasses.replace(program, **changes) if changes else program


def program_features(program: Any) -> set[str]:
    """What ``program`` exercises of these features, as coverage names:
    ``train:steps=<k>``, ``train:<optimizer>``, ``train:foreach``,
    ``train:set_to_none=<bool>``, ``train:fresh_inputs``;
    ``checkpoint:reentrant`` / ``checkpoint:non_reentrant``,
    ``checkpoint:policy=<policy>``, ``checkpoint:random`` (a random op in the
    region: the backward replays it); ``random:<op>`` and ``dynamic:<op>``
    for the random and data-dependent-size ops."""
    out: set[str] = set()
    t = program.train
    if t is not None:
        out |= {f"train:steps={t.steps}", f"train:{t.optimizer}", f"train:set_to_none={str(t.set_to_none).lower()}"}
        if t.foreach:
            out.add("train:foreach")
        if t.fresh:
            out.add("train:fresh_inputs")
    c = program.checkpoint
    if c is not None:
        out.add("checkpoint:reentrant" if c.use_reentrant else "checkpoint:non_reentrant")
        if c.policy is not None:
            out.add(f"checkpoint:policy={c.policy}")
        region = set(c.ops)
        if any(op.op in RANDOM_OPS for op in program.ops if op.name in region):
            out.add("checkpoint:random")
    for op in program.ops:
        if op.op in RANDOM_OPS:
            out.add(f"random:{op.op}")
        elif op.op in DYNAMIC_OPS:
            out.add(f"dynamic:{op.op}")
    return out


__all__ = [
    "DYNAMIC_OPS",
    "FIELDS",
    "MAX_STEPS",
    "OPTIMIZERS",
    "POLICIES",
    "RANDOM_OPS",
    "Checkpoint",
    "Training",
    "has_selective",
    "parse",
    "program_features",
    "region_io",
    "tidy",
    "to_dict",
    "validate",
]
