"""cagrad leaves the process state as eager autograd leaves it (issue 36).

The state is :mod:`harness.global_state`'s: the CPU (and CUDA) random
streams, Python's and NumPy's, grad mode, the default dtype, deterministic
algorithms, thread counts, autocast, anomaly mode, the Dynamo, inductor and
functorch configs, and more. Each entry point of cagrad is read around; a
backward is compared with eager's backward of the same program from the same
seed, which also covers user code that draws during the backward (a tensor
hook, the recompute of a non-reentrant checkpoint with dropout).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import cagrad
from cagrad.autograd import accumulate
from cagrad.preserve import preserved
from harness import global_state

CHILD_TIMEOUT_S = 600  # a clean machine builds the extension in the child


def _diff(before: global_state.GlobalState, after: global_state.GlobalState) -> list[str]:
    return [str(d) for d in before.diff(after)]


@contextlib.contextmanager
def _unchanged(what: str) -> Iterator[None]:
    before = global_state.capture()
    yield
    assert _diff(before, global_state.capture()) == [], what


# -- programs: (loss, leaves) built from a fixed seed --------------------------------------------


def _plain() -> tuple[torch.Tensor, list[torch.Tensor]]:
    w = torch.rand(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.rand(3, 4, dtype=torch.float64)
    return (x @ w).sin().sum(), [w]


def _hook_draws() -> tuple[torch.Tensor, list[torch.Tensor]]:
    # the hook draws from the global generator during the backward: the
    # stream after it must be advanced exactly as in eager
    w = torch.rand(4, 4, dtype=torch.float64, requires_grad=True)
    y = torch.rand(3, 4, dtype=torch.float64) @ w
    y.register_hook(lambda g: g * torch.rand_like(g))
    return y.cos().sum(), [w]


def _checkpoint_dropout() -> tuple[torch.Tensor, list[torch.Tensor]]:
    # the recompute runs dropout again from the RNG state checkpoint saved,
    # then puts the caller's state back (torch.utils.checkpoint)
    w = torch.rand(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.rand(3, 4, dtype=torch.float64)

    def block(h: torch.Tensor) -> torch.Tensor:
        return F.dropout(h @ w, 0.5, training=True).sin()

    return checkpoint(block, x, use_reentrant=False).sum(), [w]


PROGRAMS: dict[str, Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]] = {
    "plain": _plain,
    "hook_draws": _hook_draws,
    "checkpoint_dropout": _checkpoint_dropout,
}


def _run(build: Callable, engine: Callable[[], contextlib.AbstractContextManager]) -> tuple[global_state.GlobalState, list]:
    """Seed 0, build, backward under ``engine()``; the state and grads after."""
    torch.manual_seed(0)
    loss, leaves = build()
    with engine():
        loss.backward()
    return global_state.capture(), [leaf.grad.clone() for leaf in leaves]


BACKENDS = ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_backward_leaves_the_state_eager_leaves(backend: str, program: str) -> None:
    build = PROGRAMS[program]
    expected, eager_grads = _run(build, contextlib.nullcontext)
    for call in ("capture", "hit"):
        got, grads = _run(build, lambda: cagrad.enable(backend))
        assert _diff(expected, got) == [], f"{program}, cagrad[{backend}] {call}"
        assert all(torch.equal(a, b) for a, b in zip(eager_grads, grads)), f"{program} {call}"
    assert cagrad.counters["captures"] == 1 and cagrad.counters["cache_hits"] == 1
    assert cagrad.counters["fallbacks"] == 0


def test_entry_points_leave_the_state_alone() -> None:
    torch.manual_seed(0)
    loss, _ = _checkpoint_dropout()
    with _unchanged("enable"):
        with cagrad.enable("aot_eager"):
            pass
    with _unchanged("capture"):
        cagrad.capture(loss)
    with _unchanged("explain"):
        cagrad.explain(loss, compiler_fn="aot_eager")
    with _unchanged("reset"):
        cagrad.reset()


def test_self_tests_draw_nothing() -> None:
    """The native extension's self-tests and accumulate's, run again outside
    cagrad's guard (:func:`cagrad.preserve.preserved`): the state they leave
    is the state they found, by construction."""
    from cagrad import native

    fns = native.accumulate_fns()
    if fns is None:
        pytest.skip("the native extension cannot be built here")
    with _unchanged("native self-tests"):
        assert native._load() is not None
    with _unchanged("accumulate self-test"):
        accumulate._self_test(*fns)


_DRAWN: list[float] = []


def _drawing_compiler(gm: torch.fx.GraphModule) -> Callable:
    # a compiler that draws and flips flags: eager runs no compiler, so
    # none of it may show after the backward
    _DRAWN.append(torch.rand(()).item())
    torch.set_grad_enabled(not torch.is_grad_enabled())
    torch._dynamo.config.recompile_limit += 1
    return gm


def _drawing_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    return _drawing_compiler(gm)


@pytest.mark.parametrize("compiler", ["callable", "registered backend"])
def test_a_compiler_that_changes_state_leaves_none_of_it(compiler: str) -> None:
    """A callable ``compiler_fn`` and a backend registered by name (compiled
    directly, without Dynamo: :mod:`cagrad.compile.direct_compile`)."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "cagrad_test_draws" not in list_backends(exclude_tags=()):
        register_backend(_drawing_backend, name="cagrad_test_draws")
    compiler_fn = _drawing_compiler if compiler == "callable" else "cagrad_test_draws"
    _DRAWN.clear()
    expected, eager_grads = _run(_plain, contextlib.nullcontext)
    got, grads = _run(_plain, lambda: cagrad.enable(compiler_fn))
    assert len(_DRAWN) >= 1, "the compiler ran"
    assert _diff(expected, got) == []
    assert all(torch.equal(a, b) for a, b in zip(eager_grads, grads))


@pytest.mark.parametrize("compiler", ["torch.compile", "draws"])
def test_torch_compat_leaves_the_state_eager_leaves(compiler: str) -> None:
    """torch's compiled-autograd entry point served by cagrad
    (:mod:`cagrad.torch_compat`): its ``compiler_fn``, and the lazy Dynamo
    compile of the graph at its first call.

    One difference is torch's own: on a machine with a GPU where CUDA is not
    initialized, the user's ``torch.compile`` compiles its frame at the
    graph's first call (inside the backward, outside cagrad's compile), and
    Dynamo's frame compile reads the CUDA generator
    (``torch._dynamo.convert_frame.preserve_global_state``), which
    initializes CUDA, as under torch's compiled autograd. That one field
    going from uninitialized to initialized is allowed there, and nothing
    else (seen on the H200, torch 2.11)."""
    import cagrad.torch_compat as tc

    def compile_lazily(gm: torch.fx.GraphModule) -> Callable:
        return torch.compile(gm, backend="aot_eager", fullgraph=True)

    compiler_fn = compile_lazily if compiler == "torch.compile" else _drawing_compiler
    _DRAWN.clear()
    torch._dynamo.reset()
    try:
        for build in (_hook_draws, _checkpoint_dropout):
            expected, eager_grads = _run(build, contextlib.nullcontext)
            cuda_was_initialized = torch.cuda.is_initialized()
            got, grads = _run(build, lambda: tc._enable(compiler_fn))
            diff = _diff(expected, got)
            if compiler == "torch.compile" and torch.cuda.is_available() and not cuda_was_initialized:
                diff = [d for d in diff if not d.startswith("cuda_rng: expected None")]
            assert diff == [], build.__name__
            assert all(torch.equal(a, b) for a, b in zip(eager_grads, grads)), build.__name__
        assert cagrad.counters["captures"] >= 2 and (compiler != "draws" or _DRAWN)
    finally:
        tc.reset()
        torch._dynamo.reset()


def test_preserved_puts_back_every_field_it_names() -> None:
    torch.manual_seed(0)
    before = global_state.capture()
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    with preserved():
        torch.rand(3)
        import random

        random.random()
        torch.set_default_dtype(torch.float64 if dtype != torch.float64 else torch.float32)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_num_threads(threads + 1)
        torch.set_anomaly_enabled(True, check_nan=False)
        torch.set_autocast_enabled("cpu", True)
        torch.set_autocast_dtype("cpu", torch.float16)
        torch.set_autocast_cache_enabled(False)
        torch.set_float32_matmul_precision("medium" if torch.get_float32_matmul_precision() != "medium" else "high")
        torch._dynamo.config.recompile_limit += 1
        torch._inductor.config.max_autotune = not torch._inductor.config.max_autotune
        torch._functorch.config.donated_buffer = not torch._functorch.config.donated_buffer
        torch.set_grad_enabled(False)
    assert _diff(before, global_state.capture()) == []


def test_preserved_restores_after_an_exception() -> None:
    before = global_state.capture()
    with pytest.raises(ValueError):
        with preserved():
            torch.rand(2)
            raise ValueError("inside")
    assert _diff(before, global_state.capture()) == []


# -- a seeded training loop with dropout -----------------------------------------------------------


def _train(
    engine: Callable[[], contextlib.AbstractContextManager],
    steps: int = 20,
    device: str = "cpu",
    dtype: torch.dtype = torch.float64,
) -> tuple[list, list, tuple]:
    """20 SGD steps of Linear(6, 16) -> dropout(0.5) -> ReLU -> Linear(16, 1),
    without biases, on batches of 8, float64, data and dropout masks from
    the global generator seeded once. Its backward rounds only in the
    matmuls (dropout scales by 2, ReLU selects, MSE's gradient divides by
    8), so inductor's code rounds it as eager does, bit for bit. (A bias's
    gradient is a sum that inductor adds in another order: the last bit
    differs, under torch's own compiled autograd as under cagrad.) On CUDA
    (float32) the batches and masks come from the CUDA generator, whose
    state is returned beside the CPU one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16, bias=False), torch.nn.Dropout(0.5), torch.nn.ReLU(), torch.nn.Linear(16, 1, bias=False)
    ).to(device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], []
    for _ in range(steps):
        x, y = torch.randn(8, 6, dtype=dtype, device=device), torch.randn(8, 1, dtype=dtype, device=device)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        with engine():
            loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    state = global_state.capture().values
    return losses, grads, (state["cpu_rng"], state["cuda_rng"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_training_with_dropout_is_bit_identical(backend: str) -> None:
    losses, grads, rng = _train(contextlib.nullcontext)
    got_losses, got_grads, got_rng = _train(lambda: cagrad.enable(backend))
    assert cagrad.counters["captures"] == 1 and cagrad.counters["fallbacks"] == 0
    assert got_losses == losses  # exact: the same masks and data at every step
    for step, (a, b) in enumerate(zip(grads, got_grads)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}"
    assert got_rng == rng


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_cuda_training_with_dropout_is_bit_identical(backend: str) -> None:
    """The same loop in float32 on the GPU: the CUDA generator draws the
    batches and dropout masks, and must be left where eager leaves it."""
    losses, grads, rng = _train(contextlib.nullcontext, device="cuda", dtype=torch.float32)
    got_losses, got_grads, got_rng = _train(lambda: cagrad.enable(backend), device="cuda", dtype=torch.float32)
    assert cagrad.counters["captures"] == 1 and cagrad.counters["fallbacks"] == 0
    assert got_losses == losses
    for step, (a, b) in enumerate(zip(grads, got_grads)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}"
    assert got_rng == rng and rng[1] is not None  # the CUDA generator was read


# -- once per process: import, and the first backward (extension build, self-tests) ----------------

_CHILD = textwrap.dedent(
    """
    import json, torch
    import torch._dynamo, torch._functorch.config, torch._inductor.config  # read their configs from the start
    from harness import global_state as gs

    def program():
        torch.manual_seed(0)
        w = torch.rand(4, 4, requires_grad=True)
        return (torch.rand(3, 4) @ w).sin().sum()

    before = gs.capture()
    import cagrad
    after_import = gs.capture()
    program().backward()
    eager = gs.capture()
    with cagrad.enable("eager"):
        program().backward()  # the process's first: builds and self-tests the extension
    first = gs.capture()
    torch.manual_seed(0)
    a = torch.rand(1)
    torch.manual_seed(0)
    print(json.dumps({
        "import": [str(d) for d in before.diff(after_import)],
        "first_backward": [str(d) for d in eager.diff(first)],
        "reseeded": bool(torch.equal(a, torch.rand(1))),
        "native": cagrad.native.load() is not None,
    }))
    """
)


def test_import_and_first_backward_of_a_process_leave_the_state_alone() -> None:
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["import"] == []
    assert out["first_backward"] == []
    assert out["reseeded"]


# -- CUDA stays uninitialized by a CPU program's compile ------------------------------------------


def test_a_cpu_compile_does_not_read_the_cuda_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine with a GPU where CUDA is not initialized yet: the
    aot_eager compile of a CPU backward must not read the CUDA generator
    (reading it creates a CUDA context eager never creates). Here
    ``torch.cuda`` pretends to be available, and reading its generator is
    recorded and refused."""
    reads: list[str] = []

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        reads.append("get_rng_state")
        raise AssertionError("the CUDA generator was read: CUDA would be initialized")

    w = torch.rand(5, 3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad((w.exp() * w).sum(), w)
    cagrad.reset()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state", refuse)
    with cagrad.enable("aot_eager"):
        (w.exp() * w).sum().backward()
    assert reads == []
    assert cagrad.counters["captures"] == 1 and cagrad.counters["fallbacks"] == 0
    assert torch.equal(w.grad, expected[0])
    import torch._functorch.aot_autograd as aot

    assert not hasattr(aot.preserve_rng_state, "cagrad_original")  # put back after the compile


def test_a_cpu_inductor_compile_does_not_read_the_gpu_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine with a GPU where CUDA is not initialized yet: the
    inductor compile of a CPU backward must not read the GPU's properties
    (inductor's cache keys name the GPU, ``CacheBase.get_system``, and that
    read initializes CUDA). Here ``torch.cuda`` pretends to be available,
    and reading a device's properties is recorded and refused; torch's own
    answer is cleared first, so that it is asked for. After the backward,
    nothing the stand-in answered is cached, so a later CUDA compile reads
    the GPU's name as without cagrad."""
    from torch._inductor.codecache import CacheBase

    reads: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        reads.append("".join(traceback.format_stack(limit=12)))
        raise AssertionError("the GPU was asked: CUDA would be initialized")

    w = torch.rand(5, 3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad((w.exp() * w.sin()).sum(), w)
    cagrad.reset()
    from torch.utils._triton import has_triton

    CacheBase.get_system.cache_clear()
    has_triton.cache_clear()
    CacheBase.get_local_cache_path.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state", refuse)
    monkeypatch.setattr(torch.cuda, "get_device_properties", refuse)
    monkeypatch.setattr(torch.cuda, "current_device", refuse)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "_lazy_init", refuse)
    # compiled here, with inductor's caches keyed but empty (a fresh cache folder)
    from torch._inductor.utils import fresh_cache

    with fresh_cache(), cagrad.enable("inductor"):
        (w.exp() * w.sin()).sum().backward()
    assert not reads, "\n".join(reads)
    assert cagrad.counters["captures"] == 1 and cagrad.counters["fallbacks"] == 0
    torch.testing.assert_close(w.grad, expected[0], rtol=1e-12, atol=1e-12)
    assert not hasattr(CacheBase.get_system, "cagrad_original")  # put back after the compile
    assert CacheBase.get_system.cache_info().currsize == 0
    assert CacheBase.get_local_cache_path.cache_info().currsize == 0
    assert has_triton.cache_info().currsize == 0


_CPU_ON_GPU_HOST = textwrap.dedent(
    """
    import json, torch, cagrad
    out = {}
    for backend in ("eager", "aot_eager", "inductor"):
        w = torch.rand(8, 8, requires_grad=True)
        with cagrad.enable(backend):
            (w.exp() @ w).sin().sum().backward()
        out[backend] = torch.cuda.is_initialized()
    print(json.dumps(out))
    """
)


@pytest.mark.cuda
def test_a_cpu_program_leaves_cuda_uninitialized_on_a_gpu_host() -> None:
    """Eager never initializes CUDA for a CPU program; neither does a CPU
    backward's capture and compile under any backend, inductor included
    (whose cache keys would read the GPU's name, ``CacheBase.get_system``;
    docs/global-state.md). A fresh process: the suite's own CUDA tests
    initialize CUDA in this one."""
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    proc = subprocess.run(
        [sys.executable, "-c", _CPU_ON_GPU_HOST], capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"eager": False, "aot_eager": False, "inductor": False}
