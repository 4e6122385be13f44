"""torch-ca-grad-values (fuzz/known_issues.toml), in plain torch.

autograd.grad(loss, inputs=[x, t]) with a tensor hook on t that returns
zeros: eager returns the hook's result for t; torch's compiled autograd
returns t's gradient before the hook. Exit 1 (and "reproduces") when the
two differ, 0 when they agree.
"""

import functools
import sys

import torch
from torch._dynamo import compiled_autograd


def grads(compiled: bool) -> tuple[torch.Tensor, ...]:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    t = x * 2
    t.register_hook(lambda g: torch.zeros_like(g))
    loss = (t * 3).sum()
    if not compiled:
        return torch.autograd.grad(loss, [x, t])
    with compiled_autograd._enable(functools.partial(torch.compile, backend="eager")):
        return torch.autograd.grad(loss, [x, t])


eager, ca = grads(False), grads(True)
print("torch", torch.__version__, "eager", [g.tolist() for g in eager], "compiled autograd", [g.tolist() for g in ca])
same = all(torch.equal(a, b) for a, b in zip(eager, ca))
print("agrees" if same else "reproduces")
sys.exit(0 if same else 1)
