"""The model libraries a row needs, imported offline, and why one is missing.

:func:`prepare_offline` sets ``HF_HUB_OFFLINE=1`` (the rows build every model
from a config object with random weights; nothing may reach a hub).

:func:`unavailable` imports a library by name and returns why it cannot be
used (``None`` when it can); a row whose library is unavailable is reported
``skipped`` with that reason, never as an error.

torchvision on a CPU torch wheel
--------------------------------
The torchvision wheels the package index serves for Linux are CUDA builds:
their C++ extension (``torchvision/_C.so``) links against CUDA libraries
that a CPU build of torch does not carry, so it does not load. torchvision
then skips every registration that needs its operators except two,
``torch.library.register_fake("torchvision::nms")`` and ``("torchvision::qnms")``
in ``torchvision/_meta_registrations.py``, which raise ``operator
torchvision::nms does not exist``; the failed ``import torchvision`` then
breaks ``timm`` and transformers' model imports too (transformers imports
torchvision whenever it is installed).

:func:`prepare_torchvision` works around it without touching the install:
where torchvision is installed and its extension does not load, it defines
the schemas of those two operators (as torchvision's C++ declares them:
``(Tensor dets, Tensor scores, float iou_threshold) -> Tensor``) before
torchvision is imported. Its Python models (ResNet, MobileNetV3, ViT, ...)
then import and run; the detection operators themselves raise when called
("no kernel"), and no row uses them. Where the extension loads (a matching
CUDA torch, or a CPU torchvision) nothing is defined.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import torch

#: Library name -> the module a row imports (``torch``: rows on plain
#: torch, always available).
LIBRARIES = {"transformers": "transformers", "torchvision": "torchvision", "timm": "timm", "torch": "torch"}

#: The torchvision operators whose fake kernels torchvision registers even
#: without its extension, with their schemas (torchvision/csrc/ops/nms.cpp).
_UNGUARDED_OPS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

_state: dict[str, object] = {}


def prepare_offline() -> None:
    """Sets ``HF_HUB_OFFLINE=1`` (and transformers' ``TRANSFORMERS_OFFLINE``)
    in this process, so that a row that would download raises instead, and
    ``TRANSFORMERS_VERBOSITY=error`` unless set (the tiny configs' token ids
    and loss type draw warnings that say nothing about the backward)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def prepare_torchvision() -> str | None:
    """Makes an installed torchvision importable on a torch its C++ extension
    does not load into (see the module docstring). Idempotent; call it before
    the first ``import torchvision``, ``timm`` or ``transformers``.

    Returns:
        A note saying what was done (the extension's load error and the
        schemas defined), or ``None`` when nothing was needed (torchvision
        absent, already imported, or its extension loads).
    """
    if "torchvision_note" in _state:
        return _state["torchvision_note"]  # type: ignore[return-value]
    note = None
    spec = importlib.util.find_spec("torchvision")
    if spec is not None and spec.origin is not None and "torchvision" not in _imported():
        ext = next(iter(sorted(Path(spec.origin).parent.glob("_C*.so"))), None)
        error = "no _C extension file"
        loaded = False
        if ext is not None:
            try:
                torch.ops.load_library(str(ext))
                loaded = True
            except (OSError, RuntimeError) as exc:
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not loaded:
            lib = torch.library.Library("torchvision", "FRAGMENT")
            defined = []
            for name, schema in _UNGUARDED_OPS.items():
                if not _has_schema(name):
                    lib.define(name + schema)
                    defined.append(name)
            _state["torchvision_lib"] = lib  # the definitions live as long as the Library object
            note = (
                f"torchvision's C++ extension did not load ({error}); defined the schemas of "
                f"torchvision::{', torchvision::'.join(defined) or '(none needed)'} so that its Python "
                "models import (its detection operators raise if called)"
            )
    _state["torchvision_note"] = note
    return note


def _has_schema(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _imported() -> set[str]:
    import sys

    return {m for m in LIBRARIES.values() if m in sys.modules}


def unavailable(library: str) -> str | None:
    """Why ``library`` cannot be used here, or ``None`` when it imports.

    Sets the process up first (:func:`prepare_offline`,
    :func:`prepare_torchvision`). The reason names the library and the
    exception its import raised (``"transformers is not installed (pip
    install -e '.[models]')"``, ``"timm failed to import: ImportError: ..."``).

    Raises:
        KeyError: ``library`` is not one of :data:`LIBRARIES`.
    """
    module = LIBRARIES[library]
    prepare_offline()
    prepare_torchvision()
    if importlib.util.find_spec(module) is None:
        return f"{library} is not installed (pip install -e '.[models]'; docs/models.md)"
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is a skip reason
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{library} failed to import: {type(exc).__name__}: {first}"[:300]
    return None


def versions() -> dict[str, str | None]:
    """The installed version of each library (``None``: not installed),
    torch's included, read from package metadata (nothing imported)."""
    from importlib import metadata

    out: dict[str, str | None] = {"torch": torch.__version__}
    for name in LIBRARIES:
        if name == "torch":
            continue
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
