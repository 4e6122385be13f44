"""A stack of several threads, each training its own model with the
subject's engine entered in that thread (placement ``"thread"``).

Each step, the threads open their engine contexts one by one in thread
order, all run their backward while every context is open, and then close
them in the same order (first opened, first closed): not the reverse order
of opening, so an engine whose contexts are not per thread fails here."""

from __future__ import annotations

import threading

import torch

from harness.stacks.models import IN, OUT, mlp, mse
from harness.stacks.registry import register
from harness.stacks.stack import StackContext

THREADS, STEPS = 4, 3
#: Seconds a thread waits for the others, and the main thread for each
#: worker, before giving up (bounded runs).
WAIT_S = 120.0


class ThreadTimeout(RuntimeError):
    """A worker thread did not finish, or did not get its turn, within :data:`WAIT_S`."""


class Turns:
    """Lets threads ``0 .. n-1`` pass a point one at a time, in index order,
    round after round."""

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition()
        self._next, self._n = 0, n

    def wait(self, t: int) -> None:
        """Blocks until it is thread ``t``'s turn.

        Raises:
            ThreadTimeout: not within :data:`WAIT_S` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._next == t, WAIT_S):
                raise ThreadTimeout(f"thread {t} waited {WAIT_S} s for its turn")

    def done(self) -> None:
        """Ends the current turn; the next thread's begins."""
        with self._cond:
            self._next = (self._next + 1) % self._n
            self._cond.notify_all()


@register(
    "threads",
    "4 threads, each training its own MLP (3 SGD steps) with the engine entered around its own backward; "
    "contexts opened in thread order, all open at once, closed in the same order",
    placement="thread",
)
def threads(ctx: StackContext) -> None:
    # models and data are built here, from the seed, so that thread
    # scheduling cannot change them
    models = [mlp(ctx.device, seed=10 + t) for t in range(THREADS)]
    g = ctx.generator(10)
    data = [[(ctx.randn(5, IN, generator=g), ctx.randn(5, OUT, generator=g)) for _ in range(STEPS)] for _ in models]
    barrier = threading.Barrier(THREADS, timeout=WAIT_S)
    turns = Turns(THREADS)
    errors: list[BaseException | None] = [None] * THREADS

    def work(t: int) -> None:
        try:
            model = models[t]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step, (x, y) in enumerate(data[t]):
                opt.zero_grad()
                loss = mse(model(x), y)
                engine = ctx.engine()
                turns.wait(t)
                try:
                    engine.__enter__()
                finally:
                    turns.done()
                try:
                    barrier.wait()  # every thread's context is open
                    loss.backward()
                    barrier.wait()  # every backward is done, every context still open
                finally:
                    turns.wait(t)
                    try:
                        engine.__exit__(None, None, None)
                    finally:
                        turns.done()
                ctx.record_grads(f"thread{t}.step{step}", model)
                opt.step()
                ctx.record_params(f"thread{t}.step{step}", model)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            errors[t] = exc
            barrier.abort()

    workers = [threading.Thread(target=work, args=(t,), name=f"stack-thread{t}", daemon=True) for t in range(THREADS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(WAIT_S * 4)
        if w.is_alive():
            raise ThreadTimeout(f"{w.name} did not finish within {WAIT_S * 4} s")
    # a thread's own error, not the BrokenBarrierError it caused in the others
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
