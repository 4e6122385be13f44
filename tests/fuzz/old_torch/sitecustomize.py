"""Makes this torch look like an older one, for tests of the fuzzer's
version-dependent catalog entries; a process loads it at start-up when this
folder is on its ``PYTHONPATH`` (Python's ``site`` module), and so does
every process it starts with that environment.

``FUZZ_SIMULATE_OLD_TORCH`` lists, comma-separated, what to take away:

* ``aminmax_derivative``: ``torch.aminmax``'s outputs require grad but
  their backward raises, as on torch 2.11, which has no derivative for
  aminmax (``fuzz.ops_graph.AMINMAX`` probes this);
* ``selective_checkpoint``: no
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts``;
* ``two_tensor``: ``torch.testing._internal.two_tensor`` does not import.

Unset or empty, nothing changes (not even torch is imported).
"""

from __future__ import annotations

import os
import sys

_WHAT = {w for w in os.environ.get("FUZZ_SIMULATE_OLD_TORCH", "").split(",") if w}
_KNOWN = {"aminmax_derivative", "selective_checkpoint", "two_tensor"}
if _WHAT - _KNOWN:
    raise SystemExit(f"FUZZ_SIMULATE_OLD_TORCH: unknown {sorted(_WHAT - _KNOWN)}; known: {sorted(_KNOWN)}")

if "aminmax_derivative" in _WHAT:
    import torch

    _real_aminmax = torch.aminmax

    class _AminmaxWithoutDerivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, keepdim):  # type: ignore[no-untyped-def]
            return tuple(_real_aminmax(x, dim=dim, keepdim=keepdim))

        @staticmethod
        def backward(ctx, *grads):  # type: ignore[no-untyped-def]
            raise RuntimeError("the derivative for 'aminmax' is not implemented (simulated torch 2.11)")

    def _aminmax(input, *, dim=None, keepdim=False):  # type: ignore[no-untyped-def]
        if torch.is_grad_enabled() and input.requires_grad:
            return _AminmaxWithoutDerivative.apply(input, dim, keepdim)
        return _real_aminmax(input, dim=dim, keepdim=keepdim)

    torch.aminmax = _aminmax
    torch.Tensor.aminmax = lambda self, *, dim=None, keepdim=False: _aminmax(self, dim=dim, keepdim=keepdim)

if "selective_checkpoint" in _WHAT:
    import torch.utils.checkpoint as _cp

    del _cp.create_selective_checkpoint_contexts

if "two_tensor" in _WHAT:
    sys.modules["torch.testing._internal.two_tensor"] = None  # type: ignore[assignment]
