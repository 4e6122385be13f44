"""The registry of model rows: ``@row(...)`` adds one, :func:`get`,
:func:`all_rows` and :func:`select` find them. The catalog modules only
*describe* rows: a library is imported when a row is built, never at
registration, so ``--list`` works without any of them installed."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from harness.models.row import ModelRow, Setup

_REGISTRY: dict[str, ModelRow] = {}

#: The modules that define the built-in rows, in listing order.
CATALOG = ("harness.models.hf_rows", "harness.models.vision_rows")


def row(
    name: str,
    library: str,
    description: str,
    *,
    dtype: torch.dtype = torch.float64,
    steps: int = 3,
    needs: tuple[str, ...] = (),
    compute_dtype: torch.dtype | None = None,
    micro_batches: int = 1,
    set_to_none: bool = True,
) -> Callable[[Callable[[torch.device], Setup]], Callable[[torch.device], Setup]]:
    """Decorator: registers ``build`` as the row ``name`` (keywords: the
    :class:`ModelRow` attributes) and returns it unchanged.

    Raises:
        ValueError: ``name`` is already registered by another function, or
            ``micro_batches`` is below 1.
    """

    def wrap(build: Callable[[torch.device], Setup]) -> Callable[[torch.device], Setup]:
        old = _REGISTRY.get(name)
        if old is not None and old.build.__qualname__ != build.__qualname__:
            raise ValueError(f"model row {name!r} is already registered by {old.build.__qualname__}")
        _REGISTRY[name] = ModelRow(
            name, library, description, build, dtype, steps, needs, compute_dtype, micro_batches, set_to_none
        )
        return build

    return wrap


def load_catalog() -> None:
    """Imports every built-in row module (idempotent)."""
    for module in CATALOG:
        importlib.import_module(module)


def all_rows() -> list[ModelRow]:
    """Every registered row, in definition order."""
    load_catalog()
    return list(_REGISTRY.values())


def get(name: str, module: str | None = None) -> ModelRow:
    """The row registered as ``name``; ``module`` (the module that defines
    it) is imported first when given, so that a spawned process finds rows
    defined outside the catalog.

    Raises:
        KeyError: no row has that name (the message lists the known ones).
    """
    if module is not None:
        importlib.import_module(module)
    load_catalog()
    if name not in _REGISTRY:
        raise KeyError(f"unknown model row {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def select(names: list[str] | None) -> list[ModelRow]:
    """The rows ``names`` selects (all when ``None``), in the given order.

    Raises:
        KeyError: an unknown name.
    """
    if names is None:
        return all_rows()
    return [get(n) for n in names]
