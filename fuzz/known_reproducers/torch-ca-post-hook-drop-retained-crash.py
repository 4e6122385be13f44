"""torch-ca-post-hook-drop-retained-crash (fuzz/known_issues.toml), in plain torch.

``v1 = v0.clone()`` where ``v0 = x0 + x1`` retains its gradient, and a post
hook on ``v1.grad_fn`` (CloneBackward0) returns its grad_inputs with the one
gradient set to None: eager runs the backward (``v0.grad`` and the leaves'
gradients stay None); torch's compiled autograd crashes the process
(SIGSEGV). The compiled run is made in a child process. Exit 1 (and
"reproduces") when the child dies by a signal, raises, or its gradients
differ from eager's; 0 when it agrees.
"""

import functools
import subprocess
import sys

import torch
from torch._dynamo import compiled_autograd


def grads(compiled: bool) -> list:
    x0 = torch.tensor([0.5, -0.25], requires_grad=True)
    x1 = torch.tensor([[0.75]], dtype=torch.float64, requires_grad=True)
    v0 = x0 + x1
    v1 = v0.clone()
    v0.retain_grad()
    v1.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (None,) * len(grad_inputs))
    loss = v1.sum()
    if not compiled:
        loss.backward()
    else:
        with compiled_autograd._enable(functools.partial(torch.compile, backend="eager")):
            loss.backward()
    return [None if t.grad is None else t.grad.tolist() for t in (x0, x1, v0)]


if len(sys.argv) > 1 and sys.argv[1] == "--compiled":
    print(repr(grads(True)))
    sys.exit(0)
eager = grads(False)
child = subprocess.run([sys.executable, __file__, "--compiled"], capture_output=True, text=True, timeout=300)
if child.returncode != 0:
    why = f"signal {-child.returncode}" if child.returncode < 0 else f"exit {child.returncode}"
    print("torch", torch.__version__, "eager", eager, "compiled autograd:", why, child.stderr.strip().splitlines()[-1:])
    print("reproduces")
    sys.exit(1)
ca = eval(child.stdout.strip().splitlines()[-1])
print("torch", torch.__version__, "eager", eager, "compiled autograd", ca)
print("agrees" if ca == eager else "reproduces")
sys.exit(0 if ca == eager else 1)
