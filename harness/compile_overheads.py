"""Work a Dynamo compile does only for its own metrics, skipped in a fuzz process.

Every frame Dynamo compiles (torch's compiled autograd compiles one per new
graph of a backward, the ``torch_ca`` subjects) ends, in
``CheckFunctionManager.__init__`` (``torch/_dynamo/guards.py``, torch 2.13
and 2.14), by timing one evaluation of the frame's new guards with
``torch._C._dynamo.guards.profile_guard_manager(root, scope, 1)``: it first
flushes the CPU caches by writing a large buffer, then runs the guards once,
and returns the latency in microseconds. The number only goes to the compile
metrics (``guard_latency_us``) and a debug log; nothing Dynamo decides reads
it, and the guards were already checked on the same scope just before
(``guard_manager.check``, which raises if they fail). On this project's CPU
machine the call took 0.12 to 0.21 s of a 0.3 s compile of a one-line
function (torch 2.13.0 and 2.14.1, measured by wrapping it).

:func:`skip_guard_latency_profile` swaps that function, in the module that
binds it, for one that returns ``0.0`` without running anything: Dynamo then
logs a latency of 0. :data:`SKIPPED` counts the calls it answered, so a test
can say how many compiles it saved.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["SKIPPED", "skip_guard_latency_profile"]

#: calls of Dynamo's guard-latency profile answered by the stand-in
SKIPPED = {"profile_guard_manager": 0}

_GUARDS = "torch._dynamo.guards"


def _no_profile(*args: Any, **kwargs: Any) -> float:
    """Stands in for ``profile_guard_manager``: a latency of 0 microseconds."""
    SKIPPED["profile_guard_manager"] += 1
    return 0.0


def skip_guard_latency_profile() -> bool:
    """Makes Dynamo's compiles skip timing their guards (module docstring).

    Imports ``torch._dynamo.guards`` (a fuzz process imports Dynamo anyway:
    every compiled subject resets it). Idempotent.

    Returns:
        True when the stand-in is in place, False where this torch's
        ``torch._dynamo.guards`` binds no ``profile_guard_manager`` (nothing
        is changed then).
    """
    import importlib

    mod = sys.modules.get(_GUARDS) or importlib.import_module(_GUARDS)
    if not hasattr(mod, "profile_guard_manager"):
        return False
    mod.profile_guard_manager = _no_profile
    return True
