"""The core acceptance test on CUDA (skipped without a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

import cagrad

from .models import MODELS, loss_fn

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# cuDNN/cuBLAS may pick different algorithms for the fused forward graph and
# the eager one; the eager and aot_eager backends replay eager's kernels, so
# the tolerance is float32 round-off.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _train(model, make_batch, backward):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        x, y = (t.cuda() for t in make_batch(step))
        backward(loss_fn(model(x), y))
        out.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_trains_like_eager_on_cuda(name, backend):
    torch.manual_seed(0)
    model, make_batch = MODELS[name]()
    model = model.cuda()
    twin = copy.deepcopy(model)
    expected = _train(model, make_batch, lambda loss: loss.backward())

    def compiled(loss):
        with cagrad.enable(backend):
            loss.backward()

    actual = _train(twin, make_batch, compiled)
    for step, (exp, act) in enumerate(zip(expected, actual)):
        for i, (e, a) in enumerate(zip(exp, act)):
            torch.testing.assert_close(a, e, **TOL, msg=lambda m: f"step {step} param {i}: {m}")
    if name == "lstm" and backend == "inductor":
        # inductor must never compile cuDNN's RNN backward (on its denylist in
        # cagrad/compile/backends.py): the node runs as itself inside the compiled
        # backward (forced opaque when its trace fails, torch 2.11), or every
        # step falls back, counted; the gradients are eager's either way
        reasons = dict(cagrad.counters["fallback_reasons"])
        opaque = dict(cagrad.counters["opaque_reasons"])
        denied = {"backend_denylist:inductor:_cudnn_rnn_backward": 3}
        forced = {"trace_failed:CudnnRnnBackward0": 1}
        assert reasons == denied or (not reasons and opaque == forced), (reasons, opaque)
        return
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1
    assert cagrad.counters["cache_hits"] == 2


@pytest.mark.inductor
@pytest.mark.parametrize("scale", [0.25, 4])
def test_lifted_scalar_beside_cuda_tensors_compiles_under_inductor(scale):
    """A Python scalar in a backward formula (``x.sin() * scale``, the 1/n of
    gradient accumulation) is lifted as a 0-dim CPU tensor; inductor's CUDA
    code reads it with ``.item()``, which fails under AOTAutograd's first-call
    custom-op aliasing check on torch 2.11 (see cagrad/compile/backends.py). It must
    compile, and stay compiled when the scalar changes."""
    x = torch.randn(64, device="cuda", requires_grad=True)
    for step in range(3):
        x.grad = None
        with cagrad.enable("inductor"):
            (x.sin() * (scale + step)).sum().backward()
        torch.testing.assert_close(x.grad, x.detach().cos() * (scale + step), **TOL)
    assert cagrad.counters["fallbacks"] == 0, dict(cagrad.counters["fallback_reasons"])
    assert cagrad.counters["captures"] == 1 and cagrad.counters["cache_hits"] == 2
