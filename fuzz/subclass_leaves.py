"""Subclass leaves of fuzz programs: which kinds torch ships, the code that
builds each leaf, and the runtime that executes that code.

A program's ``subclass_leaves`` (:mod:`fuzz.ir_graph`) are all of one
``subclass_kind``:

* ``"two_tensor"``: ``TwoTensor(values, second seeded values)``
  (``torch.testing._internal.two_tensor``, a test subclass of torch whose
  ops run on both inner tensors);
* ``"dtensor"``: ``distribute_tensor(values, mesh, [placement])``
  (``torch.distributed.tensor``) on a one-rank device mesh over a gloo
  process group of world size 1 whose store is an in-memory ``HashStore``
  (no network port), initialised once per process and only where no
  process group runs yet (the way ``tests/cagrad/test_leaf_hooks.py`` makes
  its group of one). The placement is ``Replicate()`` or ``Shard(d)``,
  chosen from the program's seed and the leaf's name (as the leaf's values
  are), so the IR needs no field for it. A DTensor's gradient is a DTensor
  (placements follow sharding propagation); the oracle compares it as any
  traceable wrapper subclass, class then inner tensor (``_local_tensor``,
  the full values on one rank) by inner tensor (``harness/compare.py``);
* ``"jagged"``: a nested tensor of the jagged layout,
  ``torch.nested.nested_tensor_from_jagged(values.flatten(0, 1), offsets)``:
  a leaf of shape ``(B, L, *rest)`` (``B, L >= 2``) becomes ``B`` components
  of shapes ``(l_i, *rest)``, ``sum(l_i) == B * L``, not all of one length
  (:func:`jagged_lengths`, chosen from the program's seed and the leaf's
  name, so the IR needs no field for them). Its outer shape is
  ``(B, j, *rest)`` (``j`` a nested int). Its gradient is a jagged nested
  tensor of the same offsets; the oracle compares class, offsets (exactly)
  and values (``harness/compare.py``).

Each kind is drawn only where :func:`kind_available` says torch has it;
building a leaf of a kind torch lacks raises ``RuntimeError`` naming why.
:func:`definitions` and :func:`leaf_line` are the code the reproducer
prints (:mod:`fuzz.render`); :func:`wrap_subclass_leaves` executes that same
code for DTensor and jagged leaves, so the two cannot drift.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import torch

from fuzz.ir_graph import DEFAULT_SUBCLASS_KIND, SUBCLASSES

MESH_HELPER = "one_rank_mesh"
"""The name of the helper function that gives the one-rank mesh."""

_MESH_SOURCE = f'''def {MESH_HELPER}(device_type):
    """A one-rank DeviceMesh of ``device_type``: a gloo process group of world
    size 1 over an in-memory HashStore (no network port), initialised once
    per process where none runs; one mesh per group and device type."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(f"DTensor leaves need a process group of one rank, got {{dist.get_world_size()}}")
    meshes = {MESH_HELPER}.__dict__.setdefault("meshes", {{}})
    key = (device_type, dist.group.WORLD)
    if key not in meshes:
        meshes[key] = init_device_mesh(device_type, (1,))
    return meshes[key]'''

_IMPORTS = {
    "two_tensor": ["from torch.testing._internal.two_tensor import TwoTensor"],
    "dtensor": [
        "import torch.distributed as dist",
        "from torch.distributed.device_mesh import init_device_mesh",
        "from torch.distributed.tensor import Replicate, Shard, distribute_tensor",
    ],
    "jagged": [],  # torch.nested comes with torch
}


# ------------------------------------------------------------ availability
def two_tensor_class() -> tuple[type | None, str]:
    """``(TwoTensor, "")``, or ``(None, why)`` where torch does not ship it."""
    try:
        from torch.testing._internal.two_tensor import TwoTensor
    except Exception as exc:  # noqa: BLE001 - any import failure means: no subclass leaves
        return None, f"torch.testing._internal.two_tensor is not importable ({type(exc).__name__}: {exc})"
    return TwoTensor, ""


def dtensor_support() -> tuple[bool, str]:
    """``(True, "")`` where torch has ``torch.distributed`` with gloo and
    ``torch.distributed.tensor`` (``distribute_tensor``, ``Shard``,
    ``Replicate``) and ``torch.distributed.device_mesh``; else ``(False, why)``."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False, "torch.distributed is not available in this build"
        if not dist.is_gloo_available():
            return False, "torch.distributed has no gloo backend in this build"
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: no DTensor leaves
        return False, f"torch.distributed.tensor is not importable ({type(exc).__name__}: {exc})"
    return True, ""


@functools.cache
def jagged_support() -> tuple[bool, str]:
    """``(True, "")`` where torch has jagged nested tensors
    (``torch.nested.nested_tensor_from_jagged``, ``torch.jagged``); else
    ``(False, why)``."""
    if not hasattr(torch, "jagged") or not hasattr(torch.nested, "nested_tensor_from_jagged"):
        return False, "torch.nested has no nested_tensor_from_jagged (jagged layout) in this build"
    try:
        t = torch.nested.nested_tensor_from_jagged(torch.zeros(3, 2), offsets=torch.tensor([0, 1, 3]))
    except Exception as exc:  # noqa: BLE001 - any failure means: no jagged leaves
        return False, f"nested_tensor_from_jagged fails ({type(exc).__name__}: {exc})"
    if t.layout != torch.jagged:
        return False, f"nested_tensor_from_jagged gives layout {t.layout}, not torch.jagged"
    return True, ""


def kind_available(kind: str) -> tuple[bool, str]:
    """Whether torch has subclass kind ``kind`` (one of
    :data:`fuzz.ir_graph.SUBCLASSES`), and why not.

    Raises:
        ValueError: ``kind`` is not a subclass kind.
    """
    if kind == "two_tensor":
        cls, why = two_tensor_class()
        return cls is not None, why
    if kind == "dtensor":
        return dtensor_support()
    if kind == "jagged":
        return jagged_support()
    raise ValueError(f"unknown subclass kind {kind!r}; expected one of {list(SUBCLASSES)}")


def available_kinds() -> tuple[str, ...]:
    """The kinds of :data:`fuzz.ir_graph.SUBCLASSES` torch has, in that order."""
    return tuple(kind for kind in SUBCLASSES if kind_available(kind)[0])


# ------------------------------------------------------------------ source
def placement_expr(seed: int, name: str, rank: int) -> str:
    """The placement of DTensor leaf ``name`` (of ``rank`` dims) as code:
    ``"Replicate()"`` or ``"Shard(d)"``, ``0 <= d < rank``, each as likely,
    drawn from ``sha256("<seed>/<name>/placement")`` (a 0-d leaf is
    replicated: it has no dim to shard)."""
    digest = hashlib.sha256(f"{seed}/{name}/placement".encode()).digest()
    choice = int.from_bytes(digest[:8], "little") % (rank + 1)
    return "Replicate()" if choice == rank else f"Shard({choice})"


def jagged_lengths(seed: int, name: str, shape: tuple[int, ...]) -> list[int]:
    """The component lengths of jagged leaf ``name`` of ``shape`` ``(B, L,
    *rest)``: ``B`` lengths ``>= 1`` summing to ``B * L``, all ``L`` but
    component ``i``'s ``L - k`` and component ``j``'s ``L + k`` (``i != j``,
    ``1 <= k < L``), each drawn from ``sha256("<seed>/<name>/lengths")``.

    Raises:
        ValueError: ``shape`` has fewer than 3 dims, or ``B`` or ``L`` is
            below 2 (no two lengths could differ).
    """
    if len(shape) < 3 or shape[0] < 2 or shape[1] < 2:
        raise ValueError(f"a jagged leaf needs a shape (B, L, *rest) with B, L >= 2 and rest non-empty, got {shape}")
    b, length = shape[0], shape[1]
    digest = hashlib.sha256(f"{seed}/{name}/lengths".encode()).digest()
    i = digest[0] % b
    j = (i + 1 + digest[1] % (b - 1)) % b
    k = 1 + digest[2] % (length - 1)
    lengths = [length] * b
    lengths[i] -= k
    lengths[j] += k
    return lengths


def offsets_expr(seed: int, name: str, shape: tuple[int, ...]) -> str:
    """The offsets of jagged leaf ``name`` as a list literal, ``[0, l_0,
    l_0 + l_1, ...]`` (:func:`jagged_lengths`); ``""`` where ``shape``
    cannot be jagged (no such leaf validates)."""
    try:
        lengths = jagged_lengths(seed, name, shape)
    except ValueError:
        return ""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return repr(offsets)


def imports(kind: str, used: bool) -> list[str]:
    """The reproducer's import lines for subclass leaves of ``kind`` (none
    when ``used`` is false)."""
    return list(_IMPORTS[kind]) if used else []


def definitions(kind: str, used: bool) -> list[str]:
    """Module-level code the leaf lines of ``kind`` call: the mesh helper
    :data:`MESH_HELPER` for DTensor, nothing for ``TwoTensor``."""
    return _MESH_SOURCE.splitlines() if used and kind == "dtensor" else []


def leaf_line(
    kind: str, name: str, requires_grad: bool, second_expr: str = "", placement: str = "", offsets: str = ""
) -> str:
    """The statement that rebinds leaf ``name`` (a plain tensor) to its
    subclass: ``second_expr`` is the code of a ``TwoTensor``'s second inner
    tensor, ``placement`` a DTensor's (:func:`placement_expr`), ``offsets``
    a jagged nested tensor's (:func:`offsets_expr`).

    Raises:
        ValueError: ``kind`` is not a subclass kind.
    """
    if kind == "two_tensor":
        return f"{name} = TwoTensor({name}.detach(), {second_expr}).requires_grad_({requires_grad})"
    if kind == "dtensor":
        mesh = f"{MESH_HELPER}({name}.device.type)"
        return f"{name} = distribute_tensor({name}.detach(), {mesh}, [{placement}]).requires_grad_({requires_grad})"
    if kind == "jagged":
        return (
            f"{name} = torch.nested.nested_tensor_from_jagged({name}.detach().flatten(0, 1), "
            f"offsets=torch.tensor({offsets}, device={name}.device)).requires_grad_({requires_grad})"
        )
    raise ValueError(f"unknown subclass kind {kind!r}; expected one of {list(SUBCLASSES)}")


# ----------------------------------------------------------------- runtime
@functools.cache
def _dtensor_namespace() -> dict[str, Any]:
    """The reproducer's DTensor imports and mesh helper, executed once per
    process (the helper keeps its meshes, so every run of a process shares
    one mesh per device type, as a user's code would)."""
    ns: dict[str, Any] = {"torch": torch}
    source = "\n".join([*_IMPORTS["dtensor"], "", *_MESH_SOURCE.splitlines()])
    exec(compile(source, "<fuzz.subclass_leaves mesh helper>", "exec"), ns)  # noqa: S102 - printed in reproducers too
    return ns


def wrap_subclass_leaves(program: Any, values: dict[str, torch.Tensor], second: Callable[[str], torch.Tensor]) -> None:
    """Replaces each subclass leaf of ``program`` in ``values`` (plain
    tensors of the leaves' shapes and dtypes) by its subclass of
    ``program.subclass_kind``, with the leaf's ``requires_grad``:
    ``TwoTensor(leaf, second(name))``, or the DTensor or jagged nested
    tensor of :func:`leaf_line` (the reproducer's very statement, executed).

    Raises:
        RuntimeError: the program has subclass leaves of a kind torch lacks
            (the strategy draws none then), or a process group of more than
            one rank already runs (DTensor).
    """
    if not program.subclass_leaves:
        return
    kind = getattr(program, "subclass_kind", DEFAULT_SUBCLASS_KIND)
    if kind == "two_tensor":
        cls, why = two_tensor_class()
        if cls is None:
            raise RuntimeError(f"subclass leaves {list(program.subclass_leaves)}: {why}")
        for name in program.subclass_leaves:
            t = values[name]
            values[name] = cls(t.detach(), second(name)).requires_grad_(t.requires_grad)
        return
    ok, why = kind_available(kind)
    if not ok:
        raise RuntimeError(f"{kind} subclass leaves {list(program.subclass_leaves)}: {why}")
    ns = dict(_dtensor_namespace()) if kind == "dtensor" else {"torch": torch}
    for name in program.subclass_leaves:
        t = values[name]
        line = leaf_line(
            kind,
            name,
            t.requires_grad,
            placement=placement_expr(program.seed, name, t.dim()),
            offsets=offsets_expr(program.seed, name, tuple(t.shape)),
        )
        ns[name] = t
        exec(compile(line, f"<{kind} leaf {name}>", "exec"), ns)  # noqa: S102 - the reproducer's line
        values[name] = ns[name]


__all__ = [
    "MESH_HELPER",
    "available_kinds",
    "definitions",
    "dtensor_support",
    "imports",
    "jagged_lengths",
    "jagged_support",
    "kind_available",
    "leaf_line",
    "offsets_expr",
    "placement_expr",
    "two_tensor_class",
    "wrap_subclass_leaves",
]
