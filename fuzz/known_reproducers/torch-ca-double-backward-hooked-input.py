"""torch-ca-double-backward-hooked-input (fuzz/known_issues.toml), in plain torch.

A double backward whose first-order autograd.grad(..., create_graph=True)
takes inputs=[t, x] with a tensor hook on the non-leaf t that adds 0.5:
eager returns t's gradient before the hook ([1, 1]); torch's compiled
autograd returns the hook's result ([1.5, 1.5]). The grads the penalty is
built from differ, and so do the leaf grads after the second backward.
Exit 1 (and "reproduces") when the two differ, 0 when they agree.
"""

import functools
import sys

import torch
from torch._dynamo import compiled_autograd


def first_order(compiled: bool) -> tuple[torch.Tensor, ...]:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    t = x * 2
    t.register_hook(lambda g: g + 0.5)
    if not compiled:
        return torch.autograd.grad(t.sum(), [t, x], create_graph=True)
    compiled_autograd.reset()
    torch._dynamo.reset()
    with compiled_autograd._enable(functools.partial(torch.compile, backend="eager")):
        return torch.autograd.grad(t.sum(), [t, x], create_graph=True)


eager, ca = first_order(False), first_order(True)
print("torch", torch.__version__, "eager", [g.tolist() for g in eager], "compiled autograd", [g.tolist() for g in ca])
same = all(torch.equal(a, b) for a, b in zip(eager, ca))
print("agrees" if same else "reproduces")
sys.exit(0 if same else 1)
