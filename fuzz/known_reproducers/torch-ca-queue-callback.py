"""torch-ca-queue-callback (fuzz/known_issues.toml), in plain torch.

A tensor hook that queues an engine callback
(Variable._execution_engine.queue_callback) during the backward: eager runs
the callback after the backward; torch's compiled autograd (fullgraph=False,
as the harness runs it) raises AssertionError. Exit 1 (and "reproduces")
when compiled autograd raises or runs the callback a different number of
times, 0 when it agrees with eager.
"""

import functools
import sys

import torch
from torch._dynamo import compiled_autograd
from torch.autograd import Variable


def callbacks(compiled: bool) -> list[str]:
    ran: list[str] = []
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    t = x * 2

    def hook(g):
        Variable._execution_engine.queue_callback(lambda: ran.append("callback"))
        return g

    t.register_hook(hook)
    loss = (t * 3).sum()
    if not compiled:
        loss.backward()
    else:
        with compiled_autograd._enable(functools.partial(torch.compile, backend="eager", fullgraph=False)):
            loss.backward()
    return ran


eager = callbacks(False)
try:
    ca = callbacks(True)
except Exception as e:  # noqa: BLE001 - the divergence is the exception
    print("torch", torch.__version__, "eager", eager, "compiled autograd raised", f"{type(e).__name__}: {e}".splitlines()[0][:200])
    print("reproduces")
    sys.exit(1)
print("torch", torch.__version__, "eager", eager, "compiled autograd", ca)
print("agrees" if eager == ca else "reproduces")
sys.exit(0 if eager == ca else 1)
