"""Importing cagrad leaves what torch.compile does unchanged.

cagrad wraps a few of torch's functions (``torch._C._autograd._push_saved_
tensors_default_hooks`` and ``_pop_...``, ``torch._C._current_graph_task_id``,
``torch._C._will_engine_execute_node``,
``torch._C._autograd._get_current_graph_task_keep_graph``). Dynamo's frame
hook skips torch's own files; a wrapper in cagrad's would be traced when it
runs inside a compiled region, as checkpoint's unpack hook does from the
graph of torch's compiled autograd: Dynamo then warned that it does not know
how to trace the builtins the wrapper calls and broke its graph there. The
wrappers are ``torch.compiler.disable``\\ d. Each check runs in a fresh
process: Dynamo warns about a builtin once per process.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import HANG_GUARD_S

SCRIPT = """
import json, sys, warnings
import torch, torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
if sys.argv[1] == "cagrad":
    import cagrad
from torch._dynamo import compiled_autograd

w = torch.rand(4, 4, dtype=torch.float64, requires_grad=True)
x = torch.rand(3, 4, dtype=torch.float64)
loss = checkpoint(lambda h: F.dropout(h @ w, 0.5, training=True).sin(), x, use_reentrant=False).sum()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager")):
        loss.backward()
print(json.dumps([str(c.message) for c in caught]))
"""


def _warnings_of(mode: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=HANG_GUARD_S, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_checkpoint_under_torchs_compiled_autograd_warns_as_without_cagrad() -> None:
    without = _warnings_of("torch")
    assert _warnings_of("cagrad") == without, without
