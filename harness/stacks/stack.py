"""The stack contract: a named training-step program and the context it runs in.

A *stack* is a function ``fn(ctx: StackContext) -> None`` that builds a
model from a fixed seed, runs a few training steps (forward, backward and,
for some, an optimizer step) and records what the oracle compares with
:meth:`StackContext.record` (per-step leaf ``.grad`` s, parameters after the
optimizer, callback traces). The runner calls it once under plain eager
autograd and once per subject, each time with a fresh context, and compares
the recorded values name by name.

Where the subject's engine is active is the stack's choice, stated by
:attr:`Stack.placement` and carried out with :meth:`StackContext.engine`:

* ``"backward"`` (the default): the stack wraps each backward (each
  ``Tensor.backward`` / ``autograd.grad``) in ``with ctx.engine():``;
* ``"thread"``: the stack enters ``ctx.engine()`` inside each worker thread
  it starts, around that thread's backward (the engine's context belongs to
  the thread that entered it).

Either way a stack run under a compiled subject that never enters
``ctx.engine()`` is reported as an error (the stack did not exercise it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch

from harness import global_state
from harness.execution import snapshot
from harness.lifetimes import ForwardStorages, Lifetimes
from harness.subjects import EagerSubject, Subject

Placement = Literal["backward", "thread"]


@dataclasses.dataclass(frozen=True)
class Stack:
    """One named training-step program.

    Attributes:
        name: the selection name (``"mlp_sgd"``), unique in the registry.
        description: one line for ``--list`` and the report.
        fn: the program, ``fn(ctx) -> None``; records results on ``ctx``.
        placement: where ``fn`` enters the subject's engine (see the module
            docstring).
        world_size: 1 for a single-process stack; above 1 the runner spawns
            that many ranks (:mod:`harness.stacks.distributed`) and ``fn``
            runs on each inside an initialized process group.
        requires_cuda: the stack is skipped (with :attr:`skip_reason`) on a
            CPU run.
        skip_reason: why it is skipped on CPU.
        compute_dtype: the lowest precision the recorded values went
            through (``torch.float16`` under float16 autocast): floating
            tensors are judged with that dtype's tolerance instead of their
            own (a float32 ``.grad`` computed by float16 matmuls carries
            float16 error, and a fusing backend rounds it elsewhere).
            ``None``: each tensor's own dtype.
        expect_compiled: every backward of the stack must compile; a
            cagrad run that falls back to eager is judged ``fell_back``
            (a failure) even when its values match.
    """

    name: str
    description: str
    fn: Callable[[StackContext], None]
    placement: Placement = "backward"
    world_size: int = 1
    requires_cuda: bool = False
    skip_reason: str = ""
    compute_dtype: torch.dtype | None = None
    expect_compiled: bool = True

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class StackContext:
    """What a stack function gets: its device, rank, the subject's engine,
    and the place its results go.

    Attributes:
        device: the torch device the stack's tensors live on (``cuda:<rank>``
            for a distributed CUDA stack).
        subject: the engine being run (plain eager for the reference).
        rank, world_size: the process's rank and the number of ranks
            (0 and 1 for a single-process stack).
        results: name -> recorded value, in recording order.
        engine_entries: how many times :meth:`engine` was entered.
        storages: the :class:`~harness.lifetimes.ForwardStorages` mode the
            stack runs in (:mod:`harness.stacks.execute`), or ``None``
            where lifetimes are not recorded.
        lifetimes: ``(where, Lifetimes)`` noted after each main-thread
            backward (``backward<k>``); the runner adds ``end``.
    """

    def __init__(
        self,
        device: torch.device,
        subject: Subject | None = None,
        rank: int = 0,
        world_size: int = 1,
        storages: ForwardStorages | None = None,
    ):
        self.device = torch.device(device)
        self.subject = subject or EagerSubject()
        self.rank, self.world_size = rank, world_size
        self.results: dict[str, Any] = {}
        self.engine_entries = 0
        self.storages = storages
        self.lifetimes: list[tuple[str, Lifetimes]] = []
        self._backwards = 0  # main-thread engine exits, numbering the RNG records
        self._lock = threading.Lock()

    def _unnoted(self) -> contextlib.AbstractContextManager[None]:
        """:attr:`storages` paused (the harness's own work and the backward
        are not the stack's allocations)."""
        return self.storages.paused() if self.storages is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def engine(self) -> Iterator[None]:
        """The subject's context (``cagrad.enable(backend)``, torch's
        ``compiled_autograd._enable(...)``, nothing for eager). Enter it
        where :attr:`Stack.placement` says; it may be entered many times,
        from several threads.

        Leaving it on the main thread records the random streams as the
        backward left them (``rng after backward <k>``, ``k`` from 0: the
        CPU generator's and, where CUDA is initialized, each CUDA
        generator's state as a sha256 prefix, :mod:`harness.global_state`),
        so the suite compares them with eager's after every step: the next
        forward's dropout draws from them. Worker threads' backwards are
        not recorded (their order against each other is not fixed).

        With :attr:`storages` (a :class:`~harness.lifetimes.ForwardStorages`
        around the whole stack), the mode is paused inside, and leaving on
        the main thread also notes which of the stack's storages are alive
        (:attr:`lifetimes`, ``backward<k>``)."""
        with self._lock:
            self.engine_entries += 1
        with self._unnoted(), self.subject.active():
            yield
        if threading.current_thread() is threading.main_thread():
            self.record(f"rng after backward {self._backwards}", random_streams())
            if self.storages is not None:
                self.lifetimes.append((f"backward{self._backwards}", Lifetimes(after_backward=self.storages.alive())))
            self._backwards += 1

    def record(self, name: str, value: Any) -> None:
        """Stores a snapshot of ``value`` (tensors detached and cloned,
        containers copied) under ``name``.

        Raises:
            KeyError: ``name`` was recorded before in this run.
        """
        with self._lock, self._unnoted():
            if name in self.results:
                raise KeyError(f"result {name!r} recorded twice")
            self.results[name] = snapshot(value)

    def record_grads(self, prefix: str, module: torch.nn.Module) -> None:
        """Records every parameter's ``.grad`` (``None`` where unset) as
        ``{prefix}.grad.{parameter name}``; DTensor grads as their local
        shard."""
        for pname, p in module.named_parameters():
            self.record(f"{prefix}.grad.{pname}", _local(p.grad))

    def record_params(self, prefix: str, module: torch.nn.Module) -> None:
        """Records every parameter's value as ``{prefix}.param.{name}``
        (DTensors as their local shard)."""
        for pname, p in module.named_parameters():
            self.record(f"{prefix}.param.{pname}", _local(p.detach()))

    def generator(self, seed: int) -> torch.Generator:
        """A CPU generator seeded with ``seed + 1000 * rank``: each rank
        draws different data, every run the same."""
        return torch.Generator().manual_seed(seed + 1000 * self.rank)

    def randn(self, *shape: int, generator: torch.Generator) -> torch.Tensor:
        """Standard-normal float32 data of ``shape`` drawn on the CPU from
        ``generator`` and moved to :attr:`device` (identical on every device)."""
        return torch.randn(*shape, generator=generator).to(self.device)


def random_streams() -> dict[str, Any]:
    """The random streams now: ``{"cpu_rng": str, "cuda_rng": tuple | None}``
    (:data:`harness.global_state.FIELDS`' readers)."""
    return {name: global_state.FIELDS[name]() for name in ("cpu_rng", "cuda_rng")}


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is not None and hasattr(t, "to_local") and callable(t.to_local):
        return t.to_local()
    return t
