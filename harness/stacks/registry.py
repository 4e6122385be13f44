"""The registry of named stacks: ``@register(...)`` adds one, :func:`get` and
:func:`all_stacks` find them (the built-in catalog is loaded on first use)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from harness.stacks.stack import Placement, Stack, StackContext

_REGISTRY: dict[str, Stack] = {}

#: The modules that define the built-in stacks, in listing order.
CATALOG = (
    "harness.stacks.optim",
    "harness.stacks.checkpointing",
    "harness.stacks.higher_order",
    "harness.stacks.sparse",
    "harness.stacks.callbacks",
    "harness.stacks.threads",
    "harness.stacks.ddp",
    "harness.stacks.fsdp",
    "harness.stacks.tensor_parallel",
)


def register(
    name: str,
    description: str,
    *,
    placement: Placement = "backward",
    world_size: int = 1,
    requires_cuda: bool = False,
    skip_reason: str = "",
    compute_dtype: torch.dtype | None = None,
    expect_compiled: bool = True,
) -> Callable[[Callable[[StackContext], None]], Callable[[StackContext], None]]:
    """Decorator: registers ``fn`` as the stack ``name`` and returns ``fn``
    unchanged (so that spawned ranks can import it by name). The keywords
    are :class:`~harness.stacks.stack.Stack`'s attributes.

    Raises:
        ValueError: a different function is already registered as ``name``.
    """

    def wrap(fn: Callable[[StackContext], None]) -> Callable[[StackContext], None]:
        new = Stack(
            name, description, fn, placement, world_size, requires_cuda, skip_reason, compute_dtype, expect_compiled
        )
        old = _REGISTRY.get(name)
        if old is not None and (old.fn.__module__, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"stack {name!r} is already registered by {old.fn.__module__}.{old.fn.__qualname__}")
        _REGISTRY[name] = new
        return fn

    return wrap


def load_catalog() -> None:
    """Imports every built-in stack module (idempotent)."""
    for module in CATALOG:
        importlib.import_module(module)


def all_stacks() -> list[Stack]:
    """Every registered stack, built-in ones first, in definition order."""
    load_catalog()
    return list(_REGISTRY.values())


def get(name: str, module: str | None = None) -> Stack:
    """The stack registered as ``name``; ``module`` (the defining module) is
    imported first when given, so a spawned process finds stacks defined
    outside the catalog.

    Raises:
        KeyError: no stack has that name (the message lists the known ones).
    """
    if module is not None:
        importlib.import_module(module)
    load_catalog()
    if name not in _REGISTRY:
        raise KeyError(f"unknown stack {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def select(names: list[str] | None) -> list[Stack]:
    """The stacks ``names`` selects (all when ``None``), in the given order.

    Raises:
        KeyError: an unknown name.
    """
    if names is None:
        return all_stacks()
    return [get(n) for n in names]
