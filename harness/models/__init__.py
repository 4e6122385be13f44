"""The models suite: small models of the libraries people train with
(transformers, torchvision, timm), trained a few optimizer steps under eager
autograd and under every subject from the same seed, and compared step by
step: loss, every ``.grad`` (values and strides), every parameter after the
step, and the global state a backward may leave changed::

    from harness import models
    report = models.run_models(models.select(["gpt2", "resnet"]), ["cagrad[eager]"], isolate=False)
    assert report.ok, [o.describe() for o in report.failures()]

or ``python -m harness models`` (:mod:`harness.models.cli`; docs/models.md).

Modules, one concept each: ``row`` (the row contract), ``registry``,
``libraries`` (offline imports, the torchvision workaround, skip reasons),
the row catalogs ``hf_rows`` (transformers) and ``vision_rows``
(torchvision, timm), ``train`` (one run: the training loop and what cagrad
did), ``judge``, ``outcome``, ``runner`` (spawn isolation), ``table``,
``cli``.
"""

from harness.models.judge import judge
from harness.models.outcome import ModelsReport, RowOutcome, RowStatus
from harness.models.registry import all_rows, get, row, select
from harness.models.row import ModelRow, Setup
from harness.models.runner import DEFAULT_SUBJECTS, run_models, run_row, run_row_isolated
from harness.models.train import RowRun, train

__all__ = [
    "DEFAULT_SUBJECTS",
    "ModelRow",
    "ModelsReport",
    "RowOutcome",
    "RowRun",
    "RowStatus",
    "Setup",
    "all_rows",
    "get",
    "judge",
    "row",
    "run_models",
    "run_row",
    "run_row_isolated",
    "select",
    "train",
]
