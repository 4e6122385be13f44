"""torch-ca-post-hook-drop-function-detach (fuzz/known_issues.toml), in plain torch.

A Node post hook that returns None for a grad_input upstream of a custom
autograd.Function whose backward calls grad.detach(): eager hands the
backward a zero gradient (materialize_grads), torch's compiled autograd
hands it None, and the backward raises AttributeError. Exit 1 (and
"reproduces") when compiled autograd raises or differs, 0 when it agrees.
"""

import functools
import sys

import torch
from torch._dynamo import compiled_autograd


class Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sin(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            a = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(a * torch.sin(a), a, grad.detach())
        return gx


def leaf_grad(compiled: bool):
    x = torch.tensor([[0.5], [-0.25]], requires_grad=True)
    v = torch.max(Recompute.apply(x).expand(2, 4), 0).values
    v.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (None,) * len(grad_inputs))
    if not compiled:
        v.sum().backward()
        return x.grad
    compiled_autograd.reset()
    torch._dynamo.reset()
    with compiled_autograd._enable(functools.partial(torch.compile, backend="eager")):
        v.sum().backward()
    return x.grad


eager = leaf_grad(False)
try:
    ca = leaf_grad(True)
    same = (eager is None and ca is None) or (eager is not None and ca is not None and torch.equal(eager, ca))
    print("torch", torch.__version__, "eager", eager, "compiled autograd", ca)
except AttributeError as exc:
    print("torch", torch.__version__, "eager", eager, "compiled autograd raised", repr(exc))
    same = False
print("agrees" if same else "reproduces")
sys.exit(0 if same else 1)
