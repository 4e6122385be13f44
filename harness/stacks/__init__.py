"""The stacks suite: named training-step programs (optimizer steps, gradient
accumulation, checkpointing, engine callbacks, double backward, sparse
gradients, threads, mixed precision, DDP and FSDP2 on 2 ranks), each run
under eager autograd and under every subject, and compared value by value::

    from harness import stacks
    report = stacks.run_stacks(stacks.select(["mlp_sgd", "ddp_default"]), ["cagrad[eager]"])
    assert report.ok, [o.describe() for o in report.failures()]

or ``python -m harness stacks`` (see :mod:`harness.stacks.cli`).

Modules, one concept each: ``stack`` (the Stack contract and its context),
``registry``, ``models``, the stack definitions (``optim``,
``checkpointing``, ``higher_order``, ``sparse``, ``callbacks``, ``threads``,
``ddp``, ``fsdp``), ``execute`` (one run in this process), ``distributed``
(spawned ranks), ``judge`` (the compare layer), ``outcome``, ``runner``,
``table``, ``cli``.
"""

from harness.stacks.execute import execute
from harness.stacks.judge import compare_results, judge
from harness.stacks.outcome import RankRun, StackOutcome, StackRun, StacksReport, StackStatus
from harness.stacks.registry import all_stacks, get, register, select
from harness.stacks.runner import DEFAULT_SUBJECTS, run_stack, run_stacks
from harness.stacks.stack import Stack, StackContext

__all__ = [
    "DEFAULT_SUBJECTS",
    "RankRun",
    "Stack",
    "StackContext",
    "StackOutcome",
    "StackRun",
    "StackStatus",
    "StacksReport",
    "all_stacks",
    "compare_results",
    "execute",
    "get",
    "judge",
    "run_stack",
    "run_stacks",
    "select",
    "register",
]
