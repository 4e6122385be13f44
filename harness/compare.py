"""Value comparison: one subject's results against eager's.

Tensors are compared with ``torch.testing.assert_close`` (dtype, device and
layout must match exactly, strides are not compared, NaN equals NaN) under the
tolerance the caller's policy gives for the expected tensor's dtype. When they
differ, the greatest absolute and relative errors are computed in float64 (or
complex128) on the CPU and reported in a :class:`~harness.outcome.Mismatch`.

With ``CAGRAD_FUZZ_STRIDES=1`` in the environment (read at each comparison,
so a campaign's workers and a reproducer see it too), tensors that agree in
value must also agree in strides, in every dimension of more than one
element, unless eager's is expanded (stride 0): a hook or a caller that
reads strides or calls ``view`` then behaves as under eager.

Hook traces are compared structurally: lists/tuples element by element
(lengths must match), dicts key by key, tensors as above, Python floats with
the float32 policy, anything else with ``==``.

The process state a backward leaves (random streams, grad mode, flags,
configs: :mod:`harness.global_state`) is compared field by field with what
eager's backward left (:func:`compare_state`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from harness.global_state import GlobalState, left_differently
from harness.outcome import Mismatch
from harness.program import Observation
from harness.tolerance import Tolerance

#: ``dtype -> Tolerance`` for the subject and device being compared.
ToleranceFn = Callable[[torch.dtype], Tolerance]


def describe_value(x: Any) -> str:
    if x is None:
        return "None"
    if isinstance(x, torch.Tensor):
        return f"tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def error_magnitudes(expected: torch.Tensor, actual: torch.Tensor) -> tuple[float, float]:
    """Greatest ``|actual - expected|`` and ``|actual - expected| / |expected|``.

    Both tensors must have the same shape. NaN against NaN and equal infinities
    count as no error; NaN or inf on one side only counts as ``inf``. The
    relative error where ``expected`` is 0 is ``inf`` (0 where ``actual`` is 0
    too). Returns ``(0.0, 0.0)`` for empty tensors.
    """
    if expected.numel() == 0:
        return 0.0, 0.0
    wide = torch.complex128 if (expected.is_complex() or actual.is_complex()) else torch.float64
    e = _dense(expected).detach().to("cpu").to(wide)
    a = _dense(actual).detach().to("cpu").to(wide)
    diff = (a - e).abs()
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    diff = torch.where(same, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    denom = e.abs()
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / denom)
    rel = torch.where(torch.isnan(rel), torch.full_like(rel, math.inf), rel)
    return float(diff.max()), float(rel.max())


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.layout != torch.strided else t


#: the environment variable that turns the stride comparison on ("1")
STRIDES_ENV = "CAGRAD_FUZZ_STRIDES"


def strides_differ(expected: torch.Tensor, actual: torch.Tensor) -> str | None:
    """How ``actual``'s strides differ from ``expected``'s (same shape), or
    None: dimensions of one element are not compared (their stride means
    nothing), nor is an ``expected`` with a stride 0 (expanded) or a layout
    that is not strided."""
    if expected.layout is not torch.strided or actual.layout is not torch.strided:
        return None
    shape, es, acts = expected.shape, expected.stride(), actual.stride()
    if any(n > 1 and st == 0 for n, st in zip(shape, es)):
        return None
    if all(n <= 1 or a == b for n, a, b in zip(shape, es, acts)):
        return None
    return f"strides differ: eager {tuple(es)}, subject {tuple(acts)}"


def compare_tensor(
    expected: torch.Tensor | None,
    actual: torch.Tensor | None,
    where: str,
    tolerance: ToleranceFn,
) -> Mismatch | None:
    """Compares one tensor slot; returns ``None`` when they agree.

    Args:
        expected: eager's value (``None`` for an unset ``.grad`` or an unused
            input).
        actual: the subject's value.
        where: the label written into the mismatch (``"leaf 2 .grad"``).
        tolerance: gives the :class:`Tolerance` for ``expected.dtype``.
    """
    if expected is None and actual is None:
        return None
    if expected is None or actual is None:
        return Mismatch(where, f"eager has {describe_value(expected)}, subject has {describe_value(actual)}")
    if hasattr(expected, "__tensor_flatten__") or hasattr(actual, "__tensor_flatten__"):
        return _compare_subclass(expected, actual, where, tolerance)
    for attr in ("dtype", "shape", "device", "layout"):
        ev, av = getattr(expected, attr), getattr(actual, attr)
        if ev != av:
            return Mismatch(where, f"{attr} differs: eager {ev}, subject {av}")
    tol = tolerance(expected.dtype)
    atol = tol.atol_for(_dense(expected))
    try:
        torch.testing.assert_close(
            _dense(actual), _dense(expected), rtol=tol.rtol, atol=atol, equal_nan=True, check_stride=False
        )
    except AssertionError as exc:
        max_abs, max_rel = error_magnitudes(expected, actual)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "values differ"
        return Mismatch(where, first, max_abs=max_abs, max_rel=max_rel, rtol=tol.rtol, atol=atol)
    if os.environ.get(STRIDES_ENV) == "1":
        detail = strides_differ(expected, actual)
        if detail is not None:
            return Mismatch(where, detail)
    return None


def _compare_subclass(
    expected: torch.Tensor, actual: torch.Tensor, where: str, tolerance: ToleranceFn
) -> Mismatch | None:
    """A tensor subclass (``TwoTensor``, any traceable wrapper subclass with
    ``__tensor_flatten__``) must have eager's class, and its inner tensors
    must agree one by one (``where.a``, ``where.b``; a DTensor's
    ``_local_tensor``). An inner value that is not a tensor (a DTensor's
    ``device_mesh`` since torch 2.13) must be equal, and so must a
    DTensor's ``placements``. A jagged nested tensor is compared by
    layout, offsets and values (:func:`_compare_jagged`)."""
    if type(expected) is not type(actual):
        return Mismatch(where, f"class differs: eager {type(expected).__name__}, subject {type(actual).__name__}")
    jagged = getattr(torch, "jagged", None)  # a torch without jagged nested tensors has no such layout
    if jagged is not None and jagged in (expected.layout, actual.layout):
        return _compare_jagged(expected, actual, where, tolerance)
    names, _ = expected.__tensor_flatten__()
    other, _ = actual.__tensor_flatten__()
    if list(names) != list(other):
        return Mismatch(where, f"inner tensors differ: eager {list(names)}, subject {list(other)}")
    placements = getattr(expected, "placements", None), getattr(actual, "placements", None)
    if placements[0] != placements[1]:
        return Mismatch(where, f"placements differ: eager {placements[0]}, subject {placements[1]}")
    for name in names:
        e, a = getattr(expected, name), getattr(actual, name)
        if not (isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor)):
            if e is not a and e != a:
                return Mismatch(f"{where}.{name}", f"differs: eager {e!r}, subject {a!r}")
            continue
        m = compare_tensor(e, a, f"{where}.{name}", tolerance)
        if m is not None:
            return m
    return None


def _compare_jagged(
    expected: torch.Tensor, actual: torch.Tensor, where: str, tolerance: ToleranceFn
) -> Mismatch | None:
    """Two nested tensors of one class, at least one of the jagged layout:
    the layouts, the ragged dim and the offsets (lengths) must be eager's
    exactly (``where.offsets()``), the values then agree as any tensor
    (``where.values()``, dtype and shape included). The cached minimum and
    maximum lengths are not compared: they follow from the offsets."""
    if expected.layout != actual.layout:
        return Mismatch(where, f"layout differs: eager {expected.layout}, subject {actual.layout}")
    ragged = getattr(expected, "_ragged_idx", None), getattr(actual, "_ragged_idx", None)
    if ragged[0] != ragged[1]:
        return Mismatch(where, f"ragged dim differs: eager {ragged[0]}, subject {ragged[1]}")
    e_off, a_off = expected.offsets(), actual.offsets()
    if e_off.shape != a_off.shape or not torch.equal(e_off.cpu(), a_off.cpu()):
        return Mismatch(f"{where}.offsets()", f"offsets differ: eager {e_off.tolist()}, subject {a_off.tolist()}")
    return compare_tensor(expected.values(), actual.values(), f"{where}.values()", tolerance)


def compare_tensor_lists(
    expected: Sequence[torch.Tensor | None],
    actual: Sequence[torch.Tensor | None],
    label: Callable[[int], str],
    tolerance: ToleranceFn,
    count_label: str = "result count",
) -> list[Mismatch]:
    """Compares two slot lists position by position; ``label(i)`` names slot i.

    A length difference is reported under ``count_label``.
    """
    out: list[Mismatch] = []
    if len(expected) != len(actual):
        out.append(Mismatch(count_label, f"eager has {len(expected)}, subject has {len(actual)}"))
    for i, (e, a) in enumerate(zip(expected, actual)):
        m = compare_tensor(e, a, label(i), tolerance)
        if m is not None:
            out.append(m)
    return out


def compare_structure(
    expected: Any,
    actual: Any,
    where: str,
    tolerance: ToleranceFn,
    float_tolerance: Tolerance,
) -> list[Mismatch]:
    """Compares two nested values (a trace event); returns every difference.

    Nested positions are labelled by appending ``[i]`` or ``[key]`` to
    ``where``.
    """
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return [Mismatch(where, f"eager has {describe_value(expected)}, subject has {describe_value(actual)}")]
        m = compare_tensor(expected, actual, where, tolerance)
        return [m] if m is not None else []
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        if type(expected) is not type(actual):
            return [Mismatch(where, f"eager has a {type(expected).__name__}, subject a {type(actual).__name__}")]
        out: list[Mismatch] = []
        if len(expected) != len(actual):
            out.append(Mismatch(where, f"length differs: eager {len(expected)}, subject {len(actual)}"))
        for i, (e, a) in enumerate(zip(expected, actual)):
            out.extend(compare_structure(e, a, f"{where}[{i}]", tolerance, float_tolerance))
        return out
    if isinstance(expected, dict) and isinstance(actual, dict):
        if set(expected) != set(actual):
            return [Mismatch(where, f"keys differ: eager {sorted(map(repr, expected))}, subject {sorted(map(repr, actual))}")]
        out = []
        for k in expected:
            out.extend(compare_structure(expected[k], actual[k], f"{where}[{k!r}]", tolerance, float_tolerance))
        return out
    if _is_real_float(expected) and _is_real_float(actual):
        e, a = float(expected), float(actual)
        if (math.isnan(e) and math.isnan(a)) or e == a:
            return []
        err = abs(a - e)
        if err <= float_tolerance.atol + float_tolerance.rtol * abs(e):
            return []
        rel = err / abs(e) if e != 0 else math.inf
        return [
            Mismatch(
                where,
                f"float differs: eager {e!r}, subject {a!r}",
                max_abs=err if not math.isnan(err) else math.inf,
                max_rel=rel if not math.isnan(rel) else math.inf,
                rtol=float_tolerance.rtol,
                atol=float_tolerance.atol,
            )
        ]
    try:
        equal = bool(expected == actual) and type(expected) is type(actual)
    except Exception as exc:  # an == that raises is a difference we report, not a crash
        return [Mismatch(where, f"cannot compare {describe_value(expected)} with {describe_value(actual)}: {exc}")]
    if equal:
        return []
    return [Mismatch(where, f"eager has {describe_value(expected)}, subject has {describe_value(actual)}")]


def _is_real_float(x: Any) -> bool:
    return isinstance(x, float)


def compare_trace(
    expected: Sequence[Any],
    actual: Sequence[Any],
    tolerance: ToleranceFn,
    float_tolerance: Tolerance,
) -> list[Mismatch]:
    """Compares two hook traces; entries are labelled ``trace[i]``.

    A length difference is reported as ``"trace length"``, and the common
    prefix is still compared entry by entry; an
    :class:`~harness.program.Observation` is labelled by its own label.
    Where eager recorded an event off the thread that ran the program (a
    :class:`~harness.program.ThreadTrace`: eager's engine on CUDA runs a
    device's nodes on a worker thread, fed by the caller's thread, so the
    order of nodes that do not depend on each other varies from run to run,
    measured on an H200: 19 of 20 runs one way), the order between
    different hooks is not compared, only each hook's own sequence of
    events: eager's events are taken in the subject's order where it holds
    the same events by label. cagrad's run order is the same on every
    device, so the CPU comparison checks it.
    """
    out: list[Mismatch] = []
    if len(expected) != len(actual):
        out.append(Mismatch("trace length", f"eager recorded {len(expected)} events, subject {len(actual)}"))
    expected = _in_subject_order(expected, actual)
    for i, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, Observation) and isinstance(a, Observation) and e.label == a.label:
            out.extend(compare_structure(e.value, a.value, e.label, tolerance, float_tolerance))
        else:
            out.extend(compare_structure(e, a, f"trace[{i}]", tolerance, float_tolerance))
    return out


def _label(event: Any) -> Any:
    if isinstance(event, Observation):
        return event.label
    if isinstance(event, tuple) and event and isinstance(event[0], str):
        return event[0]
    return None


def _in_subject_order(expected: Sequence[Any], actual: Sequence[Any]) -> Sequence[Any]:
    """``expected`` in ``actual``'s order where eager recorded an event off
    the thread that ran the program and ``actual`` holds the same events by
    label, each label's events in eager's order (the k-th event of a label
    is matched with eager's k-th); else ``expected``."""
    threads = getattr(expected, "threads", None)
    owner = getattr(expected, "owner", None)
    if not threads or len(expected) != len(actual) or all(t == owner for t in threads):
        return expected
    by_label: dict[Any, list[int]] = {}
    for i in reversed(range(len(expected))):
        label = _label(expected[i])
        if label is None:
            return expected
        by_label.setdefault(label, []).append(i)
    order = []
    for a in actual:
        pending = by_label.get(_label(a))
        if not pending:
            return expected
        order.append(pending.pop())
    return [expected[i] for i in order]


#: Characters of a state value kept in a mismatch's detail.
STATE_VALUE_CHARS = 160


def _state_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= STATE_VALUE_CHARS else text[: STATE_VALUE_CHARS - 3] + "..."


def compare_state(
    reference_before: GlobalState | None,
    reference_after: GlobalState | None,
    before: GlobalState | None,
    after: GlobalState | None,
    at: str = "",
) -> list[Mismatch]:
    """One mismatch per field of the process state that the subject's
    backward left otherwise than eager's backward of the same program
    (:func:`harness.global_state.left_differently`); none where a read is
    missing (a run that raised).

    Each is at ``"{at}state {field}"`` (``"state cpu_rng"``), with
    ``max_abs`` None, and its detail names both values: generator states as
    the first 16 hex digits of their sha256, configs as the keys that
    differ.
    """
    if reference_before is None or reference_after is None or before is None or after is None:
        return []
    return [
        Mismatch(
            f"{at}state {d.field}",
            f"the backward left {d.field} at {_state_value(d.actual)}; eager's left it at {_state_value(d.expected)}",
        )
        for d in left_differently(reference_before, reference_after, before, after)
    ]
