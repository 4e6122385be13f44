"""torch-ca-split-resized-negative-dim (fuzz/known_issues.toml), in plain torch.

``torch.split(x, 4)`` of a leaf of 5 rows, the first piece summed; then the
same program with a leaf of 1 row (one piece, of 1 row). Eager runs both;
torch's compiled autograd, recompiling for the new size, runs
SplitBackward0 on fake tensors and raises TorchRuntimeError ("Trying to
create tensor with negative dimension"). Exit 1 (and "reproduces") when
compiled autograd raises or a gradient differs, 0 when it agrees.
"""

import functools
import sys

import torch
from torch._dynamo import compiled_autograd


def grad(rows: int) -> torch.Tensor:
    x = torch.arange(float(rows)).reshape(rows, 1, 1).requires_grad_(True)
    torch.split(x, 4, 0)[0].sum().backward()
    return x.grad


eager = [grad(5), grad(1)]
try:
    with compiled_autograd._enable(functools.partial(torch.compile, backend="eager")):
        ca = [grad(5), grad(1)]
except Exception as e:  # noqa: BLE001 - the divergence is the exception
    print("torch", torch.__version__, "compiled autograd raised", f"{type(e).__name__}: {e}".splitlines()[0][:200])
    print("reproduces")
    sys.exit(1)
same = all(torch.equal(a, b) for a, b in zip(eager, ca))
print("torch", torch.__version__, "agrees" if same else "reproduces")
sys.exit(0 if same else 1)
