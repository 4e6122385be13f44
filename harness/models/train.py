"""One run of one row under one subject, in this process: the training loop.

:func:`train` builds the row under ``torch.manual_seed(seed)`` and runs its
steps (see :mod:`harness.models.row`), the backward inside the subject's
engine, and records after each step, under these names:

* ``step<i>.loss``: the loss (0-d tensor, the model's dtype);
* ``step<i>.grad.<parameter>``: every parameter's ``.grad`` after the
  backward (``None`` where unset);
* ``step<i>.grad_strides.<parameter>``: its strides, with ``None`` for
  dimensions of one element (a ``.grad`` layout eager would not give shows
  here even where the values agree);
* ``step<i>.grad_kept.<parameter>``: whether the backward left ``.grad``
  the same tensor object it found (``None`` where there was none): eager's
  ``AccumulateGrad`` adds into an existing ``.grad`` in place, and code
  that holds a reference to it (a DDP bucket view under
  ``gradient_as_bucket_view``) sees the sum;
* ``step<i>.param.<parameter>``: every parameter after the optimizer step;

With :attr:`ModelRow.micro_batches` above 1, each step runs that many
forwards and backwards before the optimizer step, and the names above get
the micro-batch after the step: ``step<i>.<m>.grad.<parameter>`` (the
loss, ``.grad``, its strides and ``grad_kept`` after each backward).

and :func:`harness.global_state.capture` after each step (RNG streams, grad
mode, dtype, flags, Dynamo/inductor config).

It also records which tensors of the model's forwards the run leaves
alive (:mod:`harness.lifetimes`: a ``ForwardStorages`` mode around each
forward, Python's cyclic collector paused over the training loop): after
each backward (the saved activations a backward frees in eager, before
the optimizer step runs), and once the run dropped the model, its
optimizer and everything it built (a cache that keeps a forward's tensors
past the model that made them), in :attr:`RowRun.lifetimes`.

For a cagrad subject it also reads what cagrad did: its counters' deltas
(``captures``, ``cache_hits``, ``fallbacks``, ``deopts``, ...), the
fallback reasons, the reasons of nodes forced to run opaque
(``counters["opaque_reasons"]``), and, from every captured graph
(:data:`cagrad.events.on_capture`), the autograd nodes it calls as they are.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator
from typing import Any

import torch

from harness.devices import seeded, synchronize
from harness.global_state import GlobalState, capture
from harness.lifetimes import (
    ForwardStorages,
    Lifetimes,
    after_release,
    collector_paused,
)
from harness.models.row import ModelRow, Setup
from harness.outcome import ErrorInfo
from harness.subjects import CagradSubject, Subject, counter_deltas

#: What each opaque runtime call of a captured graph means, for reports.
_OPAQUE_CALLS = {
    "call_node": "C++ node run as it is",
    "call_custom_function": "custom autograd.Function backward run as it is",
}


#: the position suffix cagrad gives a node's name in graph metadata
_NODE_CALL = re.compile(r"\s*\(NodeCall \d+\)$")


@dataclasses.dataclass
class RowRun:
    """What one run of a row produced.

    Attributes:
        results: recorded name -> snapshot (see the module docstring), in
            recording order; partial when the run raised.
        states: the global state after each finished step.
        error: the run's exception reduced to text, or ``None``.
        counts: the subject's counter deltas over the run
            (:func:`harness.subjects.counter_deltas`).
        fallback_reasons: reason -> backwards that fell back to eager.
        forced_opaque: reason -> nodes that failed to trace and ran as they
            are (cagrad's ``opaque_reasons``).
        opaque_nodes: ``"<node type> (<why>)"`` -> how many calls of nodes
            of that type the captured graphs make as they are, at run time,
            instead of tracing them (summed over the run's captures).
        seconds: wall time of the run (information only).
        lifetimes: ``(where, Lifetimes)``: the forwards' storages alive
            after each backward (``where`` as the results' prefix,
            ``step0`` or ``step0.1``), then ``("end", ...)`` once the run
            dropped everything it built (empty when the run raised).
    """

    results: dict[str, Any] = dataclasses.field(default_factory=dict)
    states: list[GlobalState] = dataclasses.field(default_factory=list)
    error: ErrorInfo | None = None
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    fallback_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    forced_opaque: dict[str, int] = dataclasses.field(default_factory=dict)
    opaque_nodes: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    lifetimes: list[tuple[str, Lifetimes]] = dataclasses.field(default_factory=list)


def _strides(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return tuple(None if n == 1 else s for n, s in zip(t.shape, t.stride()))


def _record(out: dict[str, Any], name: str, value: Any) -> None:
    if name in out:
        raise KeyError(f"result {name!r} recorded twice")
    out[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def _opaque_census(subject: Subject, into: collections.Counter) -> Iterator[None]:
    """Counts the opaque calls of every graph cagrad captures meanwhile."""
    if not isinstance(subject, CagradSubject):
        yield
        return
    from cagrad import events
    from cagrad.capture import runtime_ops

    targets = {getattr(runtime_ops, name): why for name, why in _OPAQUE_CALLS.items()}

    def listen(event: Any) -> None:
        for node in event.graph_module.graph.nodes:
            why = targets.get(node.target) if node.op == "call_function" else None
            if why is not None:
                origin = _NODE_CALL.sub("", str(node.meta.get("autograd_node", "?")))
                into[f"{origin} ({why})"] += 1

    events.on_capture.append(listen)
    try:
        yield
    finally:
        events.on_capture.remove(listen)


def _forced_opaque(subject: Subject) -> dict[str, int]:
    if not isinstance(subject, CagradSubject):
        return {}
    import cagrad

    return dict(cagrad.counters["opaque_reasons"])


def _check_dtype(row: ModelRow, params: list[tuple[str, torch.nn.Parameter]]) -> None:
    for name, p in params:
        if p.is_floating_point() and p.dtype != row.dtype:
            raise TypeError(f"row {row.name!r} declares {row.dtype} parameters, but {name} is {p.dtype}")


def _backward(
    setup: Setup,
    subject: Subject,
    params: list[tuple[str, torch.nn.Parameter]],
    out: RowRun,
    where: str,
    storages: ForwardStorages,
) -> None:
    """One forward (inside ``storages``), and its backward inside
    ``subject``; records the loss and every parameter's ``.grad``, strides
    and ``grad_kept`` under ``where``, and the forwards' storages alive
    right after the backward."""
    results = out.results
    with storages:
        loss = setup.loss()
    found = [p.grad for _, p in params]
    with subject.active():
        loss.backward()
    out.lifetimes.append((where, Lifetimes(after_backward=storages.alive())))
    _record(results, f"{where}.loss", loss)
    for name, p in params:
        _record(results, f"{where}.grad.{name}", p.grad)
    for name, p in params:
        _record(results, f"{where}.grad_strides.{name}", _strides(p.grad))
    for (name, p), old in zip(params, found):
        _record(results, f"{where}.grad_kept.{name}", None if old is None else p.grad is old)


def _steps(row: ModelRow, subject: Subject, device: torch.device, out: RowRun, storages: ForwardStorages) -> None:
    """Builds the row and runs its steps; everything it built is dropped
    when it returns (the model, the optimizer, the batches)."""
    setup = row.build(device)
    params = list(setup.model.named_parameters())
    _check_dtype(row, params)
    for step in range(row.steps):
        setup.optimizer.zero_grad(set_to_none=row.set_to_none)
        for micro in range(row.micro_batches):
            where = f"step{step}" if row.micro_batches == 1 else f"step{step}.{micro}"
            _backward(setup, subject, params, out, where, storages)
        setup.optimizer.step()
        for name, p in params:
            _record(out.results, f"step{step}.param.{name}", p)
        synchronize(device)
        out.states.append(capture())


def train(row: ModelRow, subject: Subject, device: torch.device, seed: int = 0) -> RowRun:
    """Runs ``row`` under ``subject`` on ``device`` from ``seed`` and returns
    what it recorded. Never raises an ``Exception`` of the row or the engine
    (it is returned in :attr:`RowRun.error`); the caller's RNG state is
    restored afterwards and the subject is reset before and after."""
    out = RowRun()
    start = time.perf_counter()
    before: dict = {}
    forced_before: dict[str, int] = {}
    census: collections.Counter = collections.Counter()
    try:
        subject.reset()
        before, forced_before = subject.counters(), _forced_opaque(subject)
        storages = ForwardStorages()
        with seeded(device, seed), _opaque_census(subject, census), collector_paused():
            _steps(row, subject, device, out, storages)
            held, leaked = after_release(storages)
            out.lifetimes.append(("end", Lifetimes(after_release=held, leaked=leaked)))
    except Exception as exc:  # noqa: BLE001 - reported, judged against eager's
        out.error = ErrorInfo.from_exception(exc)
    finally:
        try:
            out.counts, out.fallback_reasons = counter_deltas(before, subject.counters())
            after = _forced_opaque(subject)
            out.forced_opaque = {
                r: n - forced_before.get(r, 0) for r, n in after.items() if n > forced_before.get(r, 0)
            }
        except Exception:  # noqa: BLE001 - a broken engine already shows as the error
            pass
        out.opaque_nodes = dict(census)
        out.seconds = time.perf_counter() - start
        try:
            subject.reset()
        except Exception:  # noqa: BLE001
            pass
    return out
