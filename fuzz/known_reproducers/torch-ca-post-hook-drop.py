"""torch-ca-post-hook-drop (fuzz/known_issues.toml), in plain torch.

A Node post hook that returns its grad_inputs with one set to None, where
that gradient is summed with another one: eager treats the None as a zero
gradient; torch's compiled autograd calls aten.add on the None and raises
TypeError. Exit 1 (and "reproduces") when compiled autograd raises or its
gradient differs, 0 when it agrees with eager.
"""

import functools
import sys

import torch
from torch._dynamo import compiled_autograd


def grad(compiled: bool) -> torch.Tensor:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    a = x * 2
    b = x.sin()
    # MulBackward0 drops x's gradient
    a.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (None,) * len(grad_inputs))
    loss = (a + b).sum()  # x's gradient: a sum of MulBackward0's and SinBackward0's
    if not compiled:
        loss.backward()
    else:
        with compiled_autograd._enable(functools.partial(torch.compile, backend="eager")):
            loss.backward()
    return x.grad


eager = grad(False)
try:
    ca = grad(True)
except Exception as e:  # noqa: BLE001 - the divergence is the exception
    print("torch", torch.__version__, "eager", eager.tolist(), "compiled autograd raised", f"{type(e).__name__}: {e}".splitlines()[0][:200])
    print("reproduces")
    sys.exit(1)
print("torch", torch.__version__, "eager", eager.tolist(), "compiled autograd", ca.tolist())
same = torch.allclose(eager, ca)
print("agrees" if same else "reproduces")
sys.exit(0 if same else 1)
