"""torch-ca-hook-on-unused-function-output (fuzz/known_issues.toml), in plain torch.

A tensor hook on the output of a two-output custom autograd.Function that
the loss does not use: eager runs the backward; torch's compiled autograd
raises AttributeError ('NoneType' object has no attribute 'op') at the end
of its capture. Exit 1 (and "reproduces") when compiled autograd raises or
its gradient differs, 0 when it agrees with eager.
"""

import functools
import sys

import torch
from torch._dynamo import compiled_autograd


class SinCos(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin(), x.cos()

    @staticmethod
    def backward(ctx, gs, gc):
        (x,) = ctx.saved_tensors
        return gs * x.cos() - gc * x.sin()


def grad(compiled: bool) -> torch.Tensor:
    x = torch.tensor([0.5, 1.0], requires_grad=True)
    s, c = SinCos.apply(x)
    c.register_hook(lambda g: None if g is None else g * 2)  # c is not used by the loss
    loss = (s * 3).sum()
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
