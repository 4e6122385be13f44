"""Two helpers around a compiled backward's run (cagrad.run), on their own.

* ``host.run_hosted``: a function run inside a backward of torch's engine,
  so that callbacks queued meanwhile go to torch's GraphTask and run right
  after it, as eager runs them after the whole backward; the cagrad
  backward around it owns its callbacks again afterwards.
* ``runtime.finish_whole``: a CUDA graph's outputs (``BorrowedOutputs``,
  overwritten by its next replay) are copied into ``.grad`` and into the
  results, never handed out; other outputs no one else holds become
  ``.grad`` as eager's AccumulateGrad steals them. ``BorrowedOutputs`` is a
  list type, so this runs on CPU tensors.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cagrad import engine
from cagrad.autograd import run_context
from cagrad.compile.cuda_graphs import BorrowedOutputs
from cagrad.run import host, runtime


def _torch_engine():
    return engine._eager_engine


def test_run_hosted_outside_a_cagrad_backward_returns_the_result():
    assert run_context.current() is None
    assert host.run_hosted(lambda: 3, _torch_engine()) == 3
    assert run_context.current() is None


def test_callbacks_queued_while_hosted_run_after_the_function_then_cagrad_owns_them_again():
    eager = _torch_engine()
    calls = []
    ctx = run_context.RunContext(keep_graph=False)
    with run_context.running(ctx):

        def fn():
            # torch's engine queues this on its host GraphTask (eager's
            # queue_callback raises outside a backward)
            eager.queue_callback(lambda: calls.append("torch's callback"))
            # and cagrad's queue hands it to torch's too, while hosted
            assert not run_context.queue(lambda: calls.append("never queued here"))
            calls.append("fn")
            return 5

        assert host.run_hosted(fn, eager) == 5
        assert calls == ["fn", "torch's callback"]
        # the cagrad backward goes on: its callbacks are its own again
        assert run_context.queue(lambda: calls.append("cagrad's callback"))
    ctx.drain()
    assert calls == ["fn", "torch's callback", "cagrad's callback"]


def _entry():
    # one leaf gradient (graph output 0, the leaf at order position 0) and
    # one autograd.grad result (output 1); neither output aliases an input
    traced = SimpleNamespace(
        leaf_outputs=[(0, 0)], capture_outputs=[1, None], returns_input=[False, False], output_specs=None, retain_outputs=[]
    )
    return SimpleNamespace(traced=traced)


def test_borrowed_outputs_are_copied_into_grad_and_results():
    torch.manual_seed(0)
    leaf = torch.zeros(4, 3, requires_grad=True)
    outs = BorrowedOutputs([torch.randn(4, 3), torch.randn(2)])
    expected = [t.clone() for t in outs]
    result = runtime.finish_whole(_entry(), [SimpleNamespace(variable=leaf)], outs)
    assert leaf.grad is not outs[0] and result[0] is not outs[1] and result[1] is None
    for t in outs:  # the next replay overwrites them
        t.fill_(7.0)
    torch.testing.assert_close(leaf.grad, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(result[0], expected[1], rtol=0, atol=0)


def test_plain_outputs_are_handed_over():
    # the control: outputs no one else holds become .grad and the results
    torch.manual_seed(0)
    leaf = torch.zeros(4, 3, requires_grad=True)
    outs = [torch.randn(4, 3), torch.randn(2)]
    result = runtime.finish_whole(_entry(), [SimpleNamespace(variable=leaf)], outs)
    assert leaf.grad is outs[0] and result[0] is outs[1] and result[1] is None
