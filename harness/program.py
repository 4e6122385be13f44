"""The unit of work the differential oracle runs: a *program*.

A program builds an autograd graph from fresh leaf tensors and says which
backward to run on it. The oracle calls :meth:`Program.build` once per subject
(eager autograd, cagrad with each backend, torch's compiled autograd), so every
subject starts from bit-identical leaves and a graph of its own; ``build`` must
therefore be deterministic (seed inside it, or build values from a fixed seed).

Two backward modes mirror the two public autograd entry points:

* ``"backward"``: ``torch.autograd.backward(outputs, grad_outputs,
  inputs=inputs)``; the results compared are the ``.grad`` of every leaf in
  :attr:`ProgramRun.leaves` (``None`` included: a ``.grad`` that eager leaves
  unset must stay unset).
* ``"grad"``: ``torch.autograd.grad(outputs, inputs, grad_outputs,
  allow_unused=True)``; the results compared are the returned tuple.

Hooks and other observers record into :attr:`ProgramRun.trace`, a list the
oracle compares between subjects (empty when the program registers none).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import torch

BackwardMode = Literal["backward", "grad"]


class Observation(NamedTuple):
    """A labelled value a program records into :attr:`ProgramRun.trace`
    (a loss, a parameter after an optimizer step): the oracle compares
    ``value`` with eager's and names a difference by ``label``
    (``"train step 2/3: x0"``; a label ending in ``state <field>`` is a
    difference of kind ``state``)."""

    label: str
    value: Any

    def __repr__(self) -> str:  # as the plain tuple a rendered program records
        return repr(tuple(self))


@torch.compiler.disable
def _this_thread() -> int:
    """``threading.get_ident()``, out of Dynamo's sight: torch's compiled
    autograd traces a program's hooks, and Dynamo warns about a builtin it
    cannot trace (``_thread.get_ident``), a warning of the harness's, not
    of the program's (:mod:`harness.warnings_seen`)."""
    return threading.get_ident()


class ThreadTrace(list):
    """A hook trace that also notes the thread each event was recorded in
    (``threads[i]``: ``threading.get_ident()`` of event ``i``) and the
    thread that made it (``owner``, the one that runs the program).

    On CUDA, eager's engine runs a device's nodes on a worker thread that
    the caller's thread feeds, so the order of the hooks of nodes that do
    not depend on each other varies from run to run; where an event was
    recorded off the owner's thread, :func:`harness.compare.compare_trace`
    asks only for each hook's own order. Example::

        trace = ThreadTrace()
        trace.append(("h0", g))            # trace.threads == [trace.owner]
    """

    def __init__(self, events: Any = ()) -> None:
        super().__init__()
        self.owner = _this_thread()
        self.threads: list[int] = []
        self.extend(events)

    def append(self, event: Any) -> None:
        self.threads.append(_this_thread())
        super().append(event)

    def extend(self, events: Any) -> None:
        for event in events:
            self.append(event)


@dataclasses.dataclass
class ProgramRun:
    """One built instance of a program, ready for its backward.

    Attributes:
        leaves: every leaf tensor whose ``.grad`` is compared (any shape and
            floating dtype; ``requires_grad`` True or False).
        outputs: the roots of the backward.
        grad_outputs: one gradient (or ``None`` for a scalar root) per output,
            or ``None`` for all-implicit gradients.
        inputs: for mode ``"grad"`` the tensors to differentiate with respect
            to; for mode ``"backward"`` the optional ``inputs=`` restriction.
        mode: which entry point runs the backward.
        retain_graph: passed through to the entry point.
        repeat: how many times the backward runs on the same graph (values
            above 1 need ``retain_graph=True``); results are compared after
            the last one.
        grads_kept: mode ``"backward"`` with ``repeat`` above 1: after each
            backward but the first, :func:`run_backward` appends to the
            trace, per leaf ``i``, ``Observation("backward k/n: leaf i
            .grad kept", kept)``: whether the leaf's ``.grad`` is still the
            tensor the first backward left (eager's ``AccumulateGrad`` adds
            into it in place, so a reference to it sees the sum), ``None``
            where the first left none.
        trace: events appended by hooks during the backward, compared as a
            list between subjects (:class:`Observation` s among them).
        driver: when set, :func:`run_backward` calls ``driver(run)``
            instead of running the backward itself: a program that runs
            several forwards, backwards and optimizer steps (the first
            forward is the build's). It may replace ``leaves`` (the
            ``.grad`` s compared at the end) and returns what
            :func:`run_backward` returns.
    """

    leaves: list[torch.Tensor]
    outputs: list[torch.Tensor]
    grad_outputs: list[torch.Tensor | None] | None = None
    inputs: list[torch.Tensor] | None = None
    mode: BackwardMode = "backward"
    retain_graph: bool | None = None
    repeat: int = 1
    trace: list[Any] = dataclasses.field(default_factory=list)
    grads_kept: bool = False
    #: Called with the run by :func:`run_backward` once before its first
    #: backward, inside the subject's context: work that belongs to the
    #: backward's forward but must run where the engine is active (a
    #: ``torch.func`` term, a ``create_graph=True`` grad whose grads make
    #: new roots); it may replace ``outputs`` and ``grad_outputs``.
    before_backward: Callable[[ProgramRun], None] | None = None
    driver: Callable[[ProgramRun], Any] | None = None


@runtime_checkable
class Program(Protocol):
    """Anything with a ``name`` and a deterministic ``build(device)``."""

    name: str

    def build(self, device: torch.device) -> ProgramRun:  # pragma: no cover - protocol
        ...


@dataclasses.dataclass
class CallableProgram:
    """Adapts a plain function ``device -> ProgramRun`` to :class:`Program`."""

    name: str
    fn: Callable[[torch.device], ProgramRun]

    def build(self, device: torch.device) -> ProgramRun:
        return self.fn(device)


def program(name: str) -> Callable[[Callable[[torch.device], ProgramRun]], CallableProgram]:
    """Decorator: ``@program("mlp")`` turns a builder function into a Program."""

    def wrap(fn: Callable[[torch.device], ProgramRun]) -> CallableProgram:
        return CallableProgram(name, fn)

    return wrap


def run_backward(run: ProgramRun) -> tuple[torch.Tensor | None, ...] | None:
    """Runs the backward that ``run`` describes with whatever engine is active.

    Returns the tuple from ``torch.autograd.grad`` in mode ``"grad"`` and
    ``None`` in mode ``"backward"``. Raises whatever the engine raises.
    """
    if run.driver is not None:
        return run.driver(run)
    result = None
    if run.before_backward is not None:
        before, run.before_backward = run.before_backward, None  # once per run
        before(run)
    n = max(1, run.repeat)
    found: list[torch.Tensor | None] = []
    for k in range(n):
        if run.mode == "grad":
            if run.inputs is None:
                raise ValueError("a program in mode 'grad' needs inputs")
            result = torch.autograd.grad(
                run.outputs,
                run.inputs,
                grad_outputs=run.grad_outputs,
                retain_graph=run.retain_graph,
                allow_unused=True,
            )
            continue
        torch.autograd.backward(
            run.outputs,
            grad_tensors=run.grad_outputs,
            retain_graph=run.retain_graph,
            inputs=run.inputs,
        )
        if run.grads_kept and n > 1:
            if k == 0:
                found = [leaf.grad for leaf in run.leaves]
                continue
            for i, (leaf, old) in enumerate(zip(run.leaves, found)):
                kept = None if old is None else leaf.grad is old
                run.trace.append(Observation(f"backward {k + 1}/{n}: leaf {i} .grad kept", kept))
    return result


def leaf_grads(run: ProgramRun) -> list[torch.Tensor | None]:
    """The ``.grad`` of every leaf, in order (``None`` where unset)."""
    return [leaf.grad for leaf in run.leaves]


def as_list(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)
