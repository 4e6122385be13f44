"""The per-dtype tolerance policy: how close a subject's value must be to eager's.

A value passes when ``torch.testing.assert_close(actual, expected, rtol=rtol,
atol=atol_for(expected))`` passes, i.e. elementwise
``|actual - expected| <= atol + rtol * |expected|`` (NaN equal to NaN).

Two families of subject backends get different numbers:

* **same-kernel** backends (plain eager, ``eager``, ``aot_eager``): the
  compiled graph calls the very ATen kernels eager autograd calls, in the same
  order, so results are expected bit-equal; the tolerance is only a margin for
  harmless differences (an accumulation of two incoming grads done as
  ``a + b`` instead of ``b + a`` is exact, a different summation *tree* is
  not). The numbers are torch's own ``assert_close`` defaults
  (``torch/testing/_comparison.py``, ``_DTYPE_PRECISIONS``):

  ========  =======  ======
  dtype     rtol     atol
  ========  =======  ======
  float64   1e-7     1e-7
  float32   1.3e-6   1e-5
  float16   1e-3     1e-5
  bfloat16  1.6e-2   1e-5
  ========  =======  ======

* **fusing** backends (``inductor`` and any backend the policy does not know):
  generated kernels reorder and re-tree reductions, fuse pointwise chains and,
  for float16/bfloat16, compute in float32 and round once at the end where
  eager rounds after every op. Numbers:

  - float64: rtol 1e-7 as above; a reordered sum of ``n`` terms errs by about
    ``n * 2**-53`` of the summands' magnitude, far inside 1e-7 for the sizes
    the fuzzer builds.
  - float32: rtol 1e-4, the default ``tol`` of ``torch._dynamo.utils.same``,
    which PyTorch's own inductor and compiled-autograd tests compare with.
  - float16: rtol 1e-2 (about 10 ulps at ``2**-10``), atol 1e-3.
  - bfloat16: rtol 5e-2 (about 6 ulps at ``2**-7``), atol 1e-2.

  For this family ``atol`` is scaled by ``max(1, max|expected|)`` because the
  error of a re-ordered reduction is relative to the size of the summands,
  not of the (possibly cancelled, near-zero) result.

On CUDA the same-kernel family also scales ``atol``: atomics-based backward
kernels (``index_add``, ``scatter_add``, embedding backward) sum in a
nondeterministic order even under plain eager.

Complex dtypes use the policy of their real component dtype. Integer and bool
values must be exactly equal. Python floats found in a hook trace are judged
with the float32 policy (their origin dtype is unknown; float32 is the
common case and the looser of the two float policies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

#: Backends whose compiled graph runs eager's own kernels.
SAME_KERNEL_BACKENDS = frozenset({None, "eager", "aot_eager"})


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``rtol``/``atol`` for one comparison (units: those of the tensor).

    Attributes:
        rtol: relative tolerance (dimensionless).
        atol: absolute tolerance.
        scale_atol: when true, :meth:`atol_for` multiplies ``atol`` by
            ``max(1, max|expected|)``.
        source: where the numbers come from, for reports.
    """

    rtol: float
    atol: float
    scale_atol: bool = False
    source: str = ""

    def atol_for(self, expected: torch.Tensor) -> float:
        """The absolute tolerance to apply against ``expected``."""
        if not self.scale_atol or expected.numel() == 0:
            return self.atol
        mag = expected.detach().abs().to(torch.float64)
        mag = mag[torch.isfinite(mag)]
        scale = float(mag.max()) if mag.numel() else 1.0
        return self.atol * max(1.0, scale)


# (rtol, atol) per real dtype; see the module docstring for the sources.
_SAME_KERNEL = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}
_FUSING = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}

_COMPLEX_TO_REAL = {
    torch.complex128: torch.float64,
    torch.complex64: torch.float32,
    torch.complex32: torch.float16,
}

ExactTolerance = Tolerance(0.0, 0.0, source="exact (integer/bool)")

#: A callable ``(dtype, backend, device_type) -> Tolerance``; the runner takes
#: one as ``policy=`` so that a caller can substitute its own numbers.
TolerancePolicy = Callable[[torch.dtype, "str | None", str], Tolerance]


def is_same_kernel_backend(backend: str | None) -> bool:
    """True for backends that run eager's kernels (see module docstring)."""
    return backend in SAME_KERNEL_BACKENDS


def tolerance_for(dtype: torch.dtype, backend: str | None = None, device_type: str = "cpu") -> Tolerance:
    """The tolerance for a value of ``dtype`` produced by ``backend`` on ``device_type``.

    Args:
        dtype: the dtype of eager's (expected) value.
        backend: the subject's compiler backend (``None`` for plain eager;
            ``"eager"``, ``"aot_eager"``, ``"inductor"``, or any other name,
            which is treated as fusing).
        device_type: ``"cpu"`` or ``"cuda"`` (others treated like ``"cuda"``).

    Returns:
        A :class:`Tolerance`; exact for integer and bool dtypes; float8 and
        other floating dtypes not listed use the bfloat16 numbers.
    """
    dtype = _COMPLEX_TO_REAL.get(dtype, dtype)
    if not dtype.is_floating_point:
        return ExactTolerance
    same = is_same_kernel_backend(backend)
    table = _SAME_KERNEL if same else _FUSING
    rtol, atol = table.get(dtype, table[torch.bfloat16])
    scale = (not same) or device_type != "cpu"
    family = "same-kernel" if same else "fusing"
    src = (
        "torch.testing default (_DTYPE_PRECISIONS)"
        if same
        else "fusing backend (torch._dynamo.utils.same tol for float32; ulps for half types)"
    )
    return Tolerance(rtol, atol, scale_atol=scale, source=f"{family}/{dtype}: {src}")


def python_float_tolerance(backend: str | None, device_type: str = "cpu") -> Tolerance:
    """The tolerance for Python floats found in hook traces (float32 policy)."""
    return tolerance_for(torch.float32, backend, device_type)
