"""First backward: capture plus compile of a new graph, cold and warm.

Each cell runs in a fresh process (``python -m harness.bench.first CELL``,
the cell as JSON): the process imports torch, runs one small backward under
the subject (imports and backend start-up are paid there, as a fuzz worker
or a training job pays them once), builds the workload, runs its forward,
and times its first backward. For cagrad the time is split by
:class:`cagrad.events.CaptureEvent` into trace (the capture) and backend
compile; the rest (key collection, lookup, the graph's first run) is the
remainder. For every subject whose backend is inductor, the time spent
inside inductor's ``compile_fx`` is measured the same way for cagrad and
torch_ca (``backend_s``): it is what neither compiled autograd's own speed
can remove, so ``cagrad's backend_s / torch_ca's seconds`` is the lowest
ratio to torch_ca a cagrad cell can reach with the same backend. A cell's
disk caches (inductor's ``TORCHINDUCTOR_CACHE_DIR``,
cagrad's cache directory when it has one) are a directory of its own: a
*cold* cell starts with it empty; a *warm* cell is a second process on the
directory the cold one filled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

CHILD_TIMEOUT_S = 1800


@dataclasses.dataclass
class FirstCell:
    """One first-backward measurement.

    Attributes:
        seconds: wall time of the first backward (s).
        trace_s / compile_s: cagrad only: of that, tracing and the backend
            compile (s), summed over the captures it made.
        backend_s: seconds inside inductor's ``compile_fx`` (outermost calls
            only), any subject; None when inductor compiled nothing.
        nodes: autograd nodes in the backward.
        counters: cagrad's captures, fallbacks (with reasons) and
            ``disk_hits`` (captures loaded from its cache directory).
        error: what went wrong, if the cell could not be measured.
    """

    seconds: float | None = None
    trace_s: float | None = None
    compile_s: float | None = None
    backend_s: float | None = None
    nodes: int | None = None
    counters: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None


def measure_first(workload: str, subject: str, device: str, cache_dir: str, threads: int | None,
                  size: str | None = None) -> FirstCell:
    """Runs one cell in a fresh process with ``cache_dir`` as its disk caches
    (``size``: the model workloads' size, :mod:`harness.bench.model_workloads`)."""
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
    env["CAGRAD_CACHE_DIR"] = os.path.join(cache_dir, "cagrad")
    cell = {"workload": workload, "subject": subject, "device": device, "threads": threads, "size": size}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "harness.bench.first", json.dumps(cell)],
            capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return FirstCell(error=f"timeout: no first backward in {CHILD_TIMEOUT_S} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return FirstCell(error=f"exit {proc.returncode}: {tail}"[:200])
    return FirstCell(**json.loads(lines[-1]))


def fresh_cache_dir() -> str:
    """An empty directory for a cold cell (removed by the caller)."""
    return tempfile.mkdtemp(prefix="cagrad-bench-")


def growth_exponent(points: list[tuple[int, float]]) -> float | None:
    """The slope ``b`` of ``log(seconds) = a + b * log(nodes)``, least squares.

    Args:
        points: ``(nodes, seconds)`` of one subject over one workload family
            (two or more sizes).

    Returns:
        ``b`` (1.0: linear), or None with fewer than two distinct sizes.
    """
    pts = [(math.log(n), math.log(s)) for n, s in points if n and s]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    return sxy / sxx


def _child(cell: dict[str, Any]) -> FirstCell:
    import torch

    import cagrad
    from cagrad import events
    from cagrad.autograd.graph_task import GraphTask

    from .model_workloads import build
    from .subjects import SUBJECTS, backward_in

    if cell.get("threads"):
        torch.set_num_threads(cell["threads"])
    inductor_s = _time_inductor_compiles()
    subject = SUBJECTS[cell["subject"]]
    device = cell["device"]
    warm = torch.nn.Linear(3, 2).to(device)
    backward_in(subject, warm(torch.randn(4, 3, device=device)).sum())  # imports, backend start-up
    torch.manual_seed(0)
    workload = build(cell["workload"], device, cell.get("size"))
    model = subject.wrap(workload.model)
    out = FirstCell(nodes=len(GraphTask([workload.step(model)], [], True).order))
    captures: list[Any] = []
    events.on_capture.append(captures.append)
    cagrad.reset()
    inductor_s.clear()  # the warm-up's compiles are not the cell's
    loss = workload.step(model)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    backward_in(subject, loss)
    if device == "cuda":
        torch.cuda.synchronize()
    out.seconds = time.perf_counter() - start
    out.backend_s = sum(inductor_s) if inductor_s else None
    if subject.is_cagrad:
        out.trace_s = sum(c.trace_s for c in captures)
        out.compile_s = sum(c.compile_s for c in captures)
        snap = cagrad.counters.snapshot()
        out.counters = {k: snap[k] for k in ("captures", "fallbacks", "disk_hits")}
        if snap["fallbacks"]:
            out.counters["fallback_reasons"] = snap["fallback_reasons"]
    return out


def _time_inductor_compiles() -> list[float]:
    """Wraps ``torch._inductor.compile_fx.compile_fx`` (which Dynamo's and
    cagrad's ``"inductor"`` backend both look up when called) so that each
    outermost call appends its duration (s) to the returned list."""
    import torch._inductor.compile_fx as compile_fx_module

    real = compile_fx_module.compile_fx
    spent: list[float] = []
    depth = [0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        depth[0] += 1
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            depth[0] -= 1
            if not depth[0]:  # compile_fx calls itself under config patches
                spent.append(time.perf_counter() - start)

    compile_fx_module.compile_fx = timed
    return spent


def main(argv: list[str]) -> None:
    cell = json.loads(argv[0])
    try:
        result = _child(cell)
    except Exception as e:  # noqa: BLE001 - reported as the cell's error
        result = FirstCell(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200])
    print(json.dumps(dataclasses.asdict(result)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
