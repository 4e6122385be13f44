"""Running the training features of a program (:mod:`fuzz.features_training`).

:func:`run_ops` runs a program's ops into a value table, the checkpoint
region (if any) as one ``torch.utils.checkpoint.checkpoint`` call at the
position of its first op. :func:`make_driver` turns a program with
``train`` into a :attr:`harness.program.ProgramRun.driver`: the optimizer
loop that the harness runs inside each subject's context (eager's and every
compiled one alike), recording after each step, as
:class:`harness.program.Observation` s in the run's trace:

* ``train step s/k: outputs``: the roots' values (the loss);
* ``train step s/k: <leaf> .grad``: every leaf's ``.grad`` after the backward;
* ``train step s/k: <leaf> .grad kept``: whether the backward left that
  ``.grad`` the tensor object it found (``None`` where it found none):
  eager's ``AccumulateGrad`` adds into an existing ``.grad`` in place, so a
  reference to it (a DDP bucket view) sees the sum;
* ``train step s/k: state cpu_rng`` (and ``cuda_rng`` on CUDA): the random
  stream right after the backward (a difference is of kind ``state``);
* ``train step s/k: <leaf>``: every parameter after ``optimizer.step()``.

:mod:`fuzz.render` writes the same loop out as plain torch code
(:func:`render_lines` here).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from fuzz import ops as catalog


# ------------------------------------------------------------------- forward
def apply_op(op: Any, values: MutableMapping[str, torch.Tensor]) -> None:
    """Runs one IR op on ``values`` and stores its output(s)."""
    spec = catalog.get(op.op)
    out = spec.run([values[ref] for ref in op.inputs], op.attrs)
    if spec.multi_output:
        for i, t in enumerate(out):
            values[f"{op.name}:{i}"] = t
    else:
        values[op.name] = out


def selective_policy(name: str) -> Any:
    """The ``policy_fn`` of a selective checkpoint policy (see
    :data:`fuzz.features_training.POLICIES`)."""
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if name == "save_all" or (name == "save_matmul" and op in matmuls):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_kwargs(checkpoint: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"use_reentrant": checkpoint.use_reentrant}
    if checkpoint.policy is not None:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy(checkpoint.policy))
    return kwargs


def run_ops(program: Any, values: MutableMapping[str, torch.Tensor]) -> None:
    """Runs ``program.ops`` into ``values`` (which holds the leaves)."""
    c = program.checkpoint
    if c is None:
        for op in program.ops:
            apply_op(op, values)
        return
    from fuzz.features_training import region_io

    inputs, outputs = region_io(program, program.infer())
    region = set(c.ops)
    region_ops = [op for op in program.ops if op.name in region]

    def fn(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        local = dict(zip(inputs, tensors))
        for op in region_ops:
            apply_op(op, local)
        return tuple(local[ref] for ref in outputs)

    for op in program.ops:
        if op.name not in region:
            apply_op(op, values)
        elif op.name == c.ops[0]:
            outs = torch.utils.checkpoint.checkpoint(fn, *[values[r] for r in inputs], **checkpoint_kwargs(c))
            outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
            values.update(zip(outputs, outs))


def step_key(name: str, step: int) -> str:
    """The seed key of a ``fresh`` leaf at optimizer step ``step`` (step 1
    uses the leaf's own key, its name)."""
    return name if step == 1 else f"{name}/step{step}"


# ------------------------------------------------------------------ training
def make_optimizer(train: Any, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    cls = torch.optim.SGD if train.optimizer == "sgd" else torch.optim.Adam
    return cls(params, lr=train.lr, foreach=train.foreach)


def rng_observations(at: str, device: Any) -> list[Any]:
    from harness.global_state import FIELDS
    from harness.program import Observation

    out = [Observation(at + "state cpu_rng", FIELDS["cpu_rng"]())]
    if torch.device(device).type == "cuda":
        out.append(Observation(at + "state cuda_rng", FIELDS["cuda_rng"]()))
    return out


def make_driver(program: Any, device: Any, values: Mapping[str, torch.Tensor], run_forward: Any, run_from_values: Any) -> Any:
    """The :attr:`harness.program.ProgramRun.driver` of a program with
    ``train``; ``values`` are step 1's (the build's). The parameters are
    the leaves that require grad and are not ``train.fresh``.
    ``run_forward`` and ``run_from_values`` are :mod:`fuzz.interpret`'s
    (a later step's forward, its hooks and roots)."""
    from harness.program import Observation, run_backward

    train = program.train
    params = {
        leaf.name: values[leaf.name]
        for leaf in program.leaves
        if leaf.requires_grad and leaf.name not in train.fresh
    }
    constants = {leaf.name: values[leaf.name] for leaf in program.leaves if leaf.name not in train.fresh}
    optimizer = make_optimizer(train, list(params.values()))
    names = [leaf.name for leaf in program.leaves]

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().clone()

    def driver(run: Any) -> Any:
        result = None
        for step in range(1, train.steps + 1):
            at = f"train step {step}/{train.steps}: "
            optimizer.zero_grad(set_to_none=train.set_to_none)
            if step > 1:
                stepped = run_forward(program, device, given=constants, step=step)
                new = run_from_values(program, stepped, device, run.trace)
                run.leaves, run.outputs, run.grad_outputs, run.inputs = new.leaves, new.outputs, new.grad_outputs, new.inputs
            run.trace.append(Observation(at + "outputs", [copy(o) for o in run.outputs]))
            found = [leaf.grad for leaf in run.leaves]
            result = run_backward(dataclasses.replace(run, driver=None))
            for name, leaf in zip(names, run.leaves):
                run.trace.append(Observation(f"{at}{name} .grad", copy(leaf.grad)))
            for name, leaf, old in zip(names, run.leaves, found):
                run.trace.append(Observation(f"{at}{name} .grad kept", None if old is None else leaf.grad is old))
            run.trace.extend(rng_observations(at, device))
            optimizer.step()
            for name, p in params.items():
                run.trace.append(Observation(at + name, copy(p)))
        return result

    return driver
