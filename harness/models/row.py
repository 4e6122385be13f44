"""The row contract: one model of a training library, trained a few steps.

A *row* builds a small model from a config object (random weights, no
download) and says how one training step computes its loss. The trainer
(:mod:`harness.models.train`) does the rest, the same way for every row and
every subject:

* under ``torch.manual_seed(seed)`` it calls :attr:`ModelRow.build`, which
  returns a :class:`Setup` (the model in train mode, dropout on, its
  optimizer, and a ``loss`` callable);
* for each of :attr:`ModelRow.steps` steps it zeroes the gradients, calls
  ``setup.loss()`` (which draws a fresh random batch from the *global* RNG,
  as a real data loop's augmentation or masking does, then runs the
  forward), runs ``loss.backward()`` inside the subject's engine, and takes
  an optimizer step.

Everything a row builds is drawn from the global RNG after the seed, so
eager and every subject start from bit-identical weights and batches; any
RNG a compiled backward consumes or restores differently shows in the next
step's dropout masks and batches, and in the recorded global state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass
class Setup:
    """What :attr:`ModelRow.build` returns.

    Attributes:
        model: the module whose parameters are compared (train mode).
        optimizer: the optimizer stepped after each backward.
        loss: ``loss() -> Tensor`` (0-d, floating): draws the step's batch
            from the global RNG and runs the forward.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ModelRow:
    """One named row of the models suite.

    Attributes:
        name: the selection name (``"gpt2"``), unique in the registry.
        library: the library the model comes from (a key of
            :data:`harness.models.libraries.LIBRARIES`); the row is
            ``skipped`` where it does not import.
        description: one line for ``--list`` and the docs.
        build: ``build(device) -> Setup``; called under the run's seed, after
            the library imported.
        dtype: the dtype of the model's floating parameters (``float64``
            where the model allows; the tolerance follows each tensor's
            dtype); the trainer checks it after the build.
        steps: optimizer steps per run.
        needs: other libraries the row imports directly, besides
            :attr:`library` (each must be available, or the row is skipped).
        compute_dtype: a lower precision than :attr:`dtype` that the
            model's own code computes part of its forward in (None: none);
            every floating value is then judged with that dtype's tolerance
            (as :attr:`harness.stacks.stack.Stack.compute_dtype`), since a
            fusing backend rounds those steps otherwise than eager.
        micro_batches: forward and backward passes per optimizer step,
            their gradients summed into ``.grad`` (gradient accumulation, as
            ``gradient_accumulation_steps`` of transformers' ``Trainer``).
        set_to_none: how the trainer clears gradients before each step
            (``optimizer.zero_grad(set_to_none=...)``): True frees ``.grad``,
            so the first backward of a step creates it; False zeroes it in
            place, so every backward accumulates into the same tensor.
    """

    name: str
    library: str
    description: str
    build: Callable[[torch.device], Setup]
    dtype: torch.dtype = torch.float64
    steps: int = 3
    needs: tuple[str, ...] = ()
    compute_dtype: torch.dtype | None = None
    micro_batches: int = 1
    set_to_none: bool = True

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ValueError(f"model row {self.name!r}: micro_batches must be at least 1, got {self.micro_batches}")

    @property
    def libraries(self) -> tuple[str, ...]:
        return (self.library, *self.needs)
