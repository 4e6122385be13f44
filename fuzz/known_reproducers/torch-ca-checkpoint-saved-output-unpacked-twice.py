"""torch-ca-checkpoint-saved-output-unpacked-twice (fuzz/known_issues.toml), in plain torch.

A custom Function that saves its own output, inside a non-reentrant
checkpoint; the backward runs twice with retain_graph=True. Eager recomputes
the region for each backward and gives x's gradient twice over; torch's
compiled autograd raises torch.utils.checkpoint's CheckpointError ("Unpack is
being triggered for a tensor that was already unpacked once"). Exit 1 (and
"reproduces") when compiled autograd raises or gives another gradient, 0 when
it agrees with eager.
"""

import functools
import sys

import torch
import torch.utils.checkpoint
from torch._dynamo import compiled_autograd


class ExpSavedOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = torch.exp(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


def grad(compiled: bool) -> torch.Tensor:
    x = torch.tensor(0.5, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(ExpSavedOutput.apply, x, use_reentrant=False)
    loss = y.sum()
    for _ in range(2):
        if not compiled:
            loss.backward(retain_graph=True)
        else:
            with compiled_autograd._enable(functools.partial(torch.compile, backend="eager", fullgraph=False)):
                loss.backward(retain_graph=True)
    return x.grad


eager = grad(False)
try:
    ca = grad(True)
except Exception as e:  # noqa: BLE001 - the divergence is the exception
    print("torch", torch.__version__, "eager", eager, "compiled autograd raised", f"{type(e).__name__}: {e}".splitlines()[0][:200])
    print("reproduces")
    sys.exit(1)
same = torch.equal(eager, ca)
print("torch", torch.__version__, "eager", eager, "compiled autograd", ca)
print("agrees" if same else "reproduces")
sys.exit(0 if same else 1)
