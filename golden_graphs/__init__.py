"""Golden graphs: reviewed snapshots of what cagrad captures.

Each named scenario (:mod:`~golden_graphs.scenarios`) builds a small
autograd graph; :func:`cagrad.capture` traces its backward, and the snapshot
(:mod:`~golden_graphs.snapshot`) stores the backward's task key, one cache
key per autograd node (type + hex bytes) and the normalized FX graph
(:mod:`~golden_graphs.normalize`), one file per scenario under
``snapshots/torch-<major>.<minor>/`` (:mod:`~golden_graphs.store`).
``python -m golden_graphs check`` (:mod:`~golden_graphs.cli`) fails with a
unified diff on any change (:mod:`~golden_graphs.compare`); ``accept``
rewrites snapshots (:mod:`~golden_graphs.accept`).

=================  ==========================================================
``scenarios``      the registry of named, seeded scenarios (and the first ones)
``feature_scenarios`` one scenario per feature (hooks, custom Functions, ...)
``model_scenarios`` small real models (CNN, transformer, LSTM, embedding)
``fault_scenarios`` one scenario per fault class of the planted-fault study
``subclass_scenarios`` tensor subclasses (TwoTensor, a jagged nested tensor)
``key_fields``     named fields of each cache key, recorded as written; field diffs
``markdown``       the pull-request review artifact
``normalize``      FX graph -> stable text lines
``snapshot``       the file format: render, parse, SnapshotError
``store``          the per-torch-version snapshot directory, atomic writes
``take``           scenario -> Snapshot (capture + normalize)
``compare``        current vs stored: Outcome, Status, unified diffs
``accept``         writing snapshots, reporting what changed
``cli``            check / accept / review / list
=================  ==========================================================
"""

from . import fault_scenarios, feature_scenarios, model_scenarios, subclass_scenarios  # noqa: F401 - they register scenarios
from .snapshot import Snapshot, SnapshotError, parse, render

__all__ = ["Snapshot", "SnapshotError", "parse", "render"]
