"""The program IR's error and the checks its parts share.

:class:`IRError` is what every check of a :class:`fuzz.ir.Program` raises,
naming the field that is wrong (``ops[3].inputs[1]``); :func:`expect`
raises it. Value names are identifiers (:data:`NAME_RE`,
:func:`check_identifier`, used for leaves, ops, hooks and ``torch.func``
terms alike); a value reference is a name, or ``"name:i"`` for output ``i``
of a multi-output op (:data:`REF_RE`, :func:`base_name`).

This module imports nothing of the fuzzer, so that :mod:`fuzz.ir`,
:mod:`fuzz.ir_validate` and :mod:`fuzz.ir_graph` can all use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""A value, hook or term name: a Python identifier (ASCII)."""
REF_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?::([0-9]+))?$")
"""A value reference: group 1 the name, group 2 the output index (or None)."""

Expect = Callable[[bool, str, str], None]
"""``expect(cond, where, message)``: raises the IR's error unless ``cond``."""


class IRError(ValueError):
    """A malformed program; ``where`` names the field (``ops[3].inputs[1]``)."""

    def __init__(self, where: str, message: str):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}" if where else message)


# Defined in fuzz.ir until the IR was split into modules: error kinds in
# failure signatures (harness.outcome.exception_type_name) keep naming it
# "fuzz.ir.IRError", which fuzz.ir re-exports.
IRError.__module__ = "fuzz.ir"


def expect(cond: bool, where: str, message: str) -> None:
    """Raises ``IRError(where, message)`` unless ``cond``."""
    if not cond:
        raise IRError(where, message)


def is_int(x: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_identifier(name: Any, where: str, expect: Expect = expect) -> None:
    """Raises (through ``expect``, :class:`IRError` by default) naming
    ``where`` unless ``name`` is a string matching :data:`NAME_RE`."""
    expect(
        isinstance(name, str) and bool(NAME_RE.match(name)),
        where,
        f"invalid name {name!r} (expected an identifier)",
    )


def base_name(ref: str) -> str:
    """The name part of a value reference (``"v3:1"`` -> ``"v3"``)."""
    return ref.split(":", 1)[0]


__all__ = ["NAME_RE", "REF_RE", "Expect", "IRError", "base_name", "check_identifier", "expect", "is_int"]
