"""The Python warnings a backward emits, recorded and compared with eager's.

A compiled autograd can change what a program's user sees through Python's
:mod:`warnings` without changing one gradient:

* a hook or custom backward that warns on every backward, run once while the
  graph is captured and never again (fewer warnings);
* a kernel's own warning (C++ ``TORCH_WARN``, which torch turns into a Python
  warning) lost because the compiled graph no longer calls that kernel
  (fewer);
* a compiler's own notice that eager never prints: Dynamo's advice on a
  builtin it cannot trace, Inductor's TensorFloat32 advice (more).

Under ``python -W error`` each of these is also an exception that eager does
not raise, or the reverse. This module is the harness's record of them:
:func:`recording` collects what one backward emits, and
:func:`compare_warnings` names the first difference from eager's record.

Records are compared as a multiset of ``(category, message)``: where a
warning is emitted from differs by design (eager's kernel is called from the
engine, a compiled graph's from its generated code), and on CUDA eager's
engine replays its worker threads' warnings at the end of the backward.

A warning emitted once per process (C++ ``TORCH_WARN_ONCE``, Dynamo's
``warn_once``; Python's own ``"once"`` and ``"default"`` actions give way to
the ``"always"`` set here) is seen only by the first backward that reaches
it, usually eager's reference;
:func:`harness.runner.run_differential` therefore judges subjects against a
second eager run whenever the first one warned.

torch's compiled autograd, a *peer*, compiles with Dynamo during the backward,
and Dynamo, Inductor and TorchScript warn there as they do under
``torch.compile`` (TorchScript's deprecation of ``script_method``, 14 times
at Inductor's first CPU compile on torch 2.13; Dynamo's advice on a builtin
it cannot trace): for a peer, warnings emitted from torch's compiler
packages (:data:`COMPILER_PACKAGES`) are not compared. cagrad's subjects are
compared on every warning: cagrad holds those of its own traces and
compiles (``cagrad.logs.torch_warnings_held``).

Example::

    with recording() as seen:
        loss.backward()
    seen  # [WarningRecord(category='UserWarning', message='...', origin='hooks.py:12', compiler=False)]
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from harness.outcome import Mismatch

#: characters of a warning's message kept in a mismatch's detail
MESSAGE_CHARS = 160

#: where torch's compiler stack lives: a warning attributed to a file under
#: one of these is a compiler's (:attr:`WarningRecord.compiler`)
COMPILER_PACKAGES = tuple(
    os.path.join("torch", p, "")
    for p in ("_dynamo", "_inductor", "_functorch", "_export", "_higher_order_ops", "_subclasses", "fx", "jit", "export")
)


class WarningRecord(NamedTuple):
    """One warning, as the harness keeps it.

    Attributes:
        category: the warning class's name (``"UserWarning"``).
        message: its text (``str(warning.message)``).
        origin: ``"<file name>:<line>"`` it was attributed to (for the
            report only: never compared).
        compiler: whether that file is in torch's compiler stack
            (:data:`COMPILER_PACKAGES`).
    """

    category: str
    message: str
    origin: str
    compiler: bool = False


@contextlib.contextmanager
def recording() -> Iterator[list[WarningRecord]]:
    """Collects every warning emitted inside the block, in order, each one
    (the ``"always"`` action: none is hidden by an earlier identical one),
    and shows none of them.

    Python's warning filters are process state; the caller's are restored on
    exit (:class:`warnings.catch_warnings`)."""
    seen: list[WarningRecord] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield seen
        finally:
            for w in caught:
                filename = str(w.filename)
                origin = f"{os.path.basename(filename)}:{w.lineno}"
                compiler = any(p in filename for p in COMPILER_PACKAGES)
                seen.append(WarningRecord(w.category.__name__, str(w.message), origin, compiler))


def _shown(record: WarningRecord) -> str:
    text = record.message.replace("\n", " ")
    if len(text) > MESSAGE_CHARS:
        text = text[: MESSAGE_CHARS - 3] + "..."
    return f"{record.category} {text!r} (at {record.origin})"


def compare_warnings(
    expected: Sequence[WarningRecord], actual: Sequence[WarningRecord], at: str = "", peer: bool = False
) -> list[Mismatch]:
    """One mismatch at ``"{at}warnings"`` naming the first ``(category,
    message)`` the subject's backward emitted a different number of times
    than eager's (in eager's order, then the subject's extras), or none.

    Args:
        expected: eager's records (:func:`recording`).
        actual: the subject's records of the same program.
        at: a prefix for the mismatch's ``where`` (``"step 2/4: "``).
        peer: the subject is a peer (torch's compiled autograd): warnings
            of torch's compiler stack are left out on both sides.
    """
    if peer:
        expected = [r for r in expected if not r.compiler]
        actual = [r for r in actual if not r.compiler]
    want = collections.Counter((r.category, r.message) for r in expected)
    got = collections.Counter((r.category, r.message) for r in actual)
    if want == got:
        return []
    first = {}
    for r in [*expected, *actual]:
        first.setdefault((r.category, r.message), r)
    key = next(k for k in first if want[k] != got[k])
    detail = (
        f"the backward emitted {_shown(first[key])} {got[key]} time(s); eager's emitted it {want[key]} time(s)"
        f" ({sum(got.values())} warning(s) in all, eager's {sum(want.values())})"
    )
    return [Mismatch(f"{at}warnings", detail)]
