"""The bridge from IR programs to the harness' differential oracle.

:class:`Oracle` holds the subjects and devices of a campaign and runs one IR
program through :func:`harness.run_differential`, reducing the report to
:class:`FailureKey` s: ``(subject, device, status, kind)`` where ``kind`` is
the exception type of an ``error`` outcome, or for a ``mismatch`` what
differs (:func:`mismatch_kind`: ``value``, ``meta``, ``trace``,
``unexpected-success``, ``captures``, ``cache`` or ``state``). A failure's
*signature* adds the sorted op set of its shrunk program and its hook kinds
(``hook:<kind>.<action>``).

Subjects are harness subject names (``"cagrad[aot_eager]"``) or *plugins*:
``"path/to/file.py:NAME"`` or ``"package.module:NAME"``, where ``NAME`` is a
:class:`harness.Subject` instance, a subclass (instantiated without
arguments), or a callable returning one or a list of them. Plugins let a
campaign check an engine the harness does not name; the tests use one to
inject a known divergence.

Cache soundness (``Oracle(neighbours=N)``): after a program agrees with
eager under a cagrad subject, up to ``N`` neighbours
(:func:`fuzz.neighbours.derive`: one change each, derived from the program
alone) run under that subject in the same cagrad state, no reset in
between, each checked against eager. They run right after the subject's
own run of the program (``harness.run_differential``'s ``after_subject``),
before the next subject resets, so the program never runs a second time to
rebuild that state. One that differs is run again in a
fresh state: if that run agrees with eager, the first was a wrong cache hit,
reported as a ``mismatch`` of kind ``cache`` (its first mismatch is at
``"cache"`` and names the neighbour's change); if it differs too, it is an
ordinary divergence of the neighbour (its mismatches name the neighbour).
Either replaces the subject's outcome for the program, so the program is
what the campaign shrinks (the neighbours are re-derived from each
candidate), and a reproducer with ``NEIGHBOURS`` replays the sequence.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import harness
from fuzz.interpret import IRProgram
from fuzz.ir import Program
from fuzz.neighbours import Neighbour, derive
from harness.compile_overheads import skip_guard_latency_profile


@dataclasses.dataclass(frozen=True, order=True)
class FailureKey:
    subject: str
    device: str
    status: str
    kind: str

    def text(self) -> str:
        return f"{self.subject}@{self.device} {self.status} {self.kind}"

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, str]) -> FailureKey:
        return cls(**data)


def signature(key: FailureKey, op_set: Sequence[str]) -> str:
    return f"{key.text()} [{','.join(op_set)}]"


# "state cpu_rng", "step 2/4: state cpu_rng" (harness.compare.compare_state)
_STATE_WHERE = re.compile(r"(?:^|: )state \w+$")
# "warnings", "step 2/4: warnings" (harness.warnings_seen.compare_warnings)
_WARNINGS_WHERE = re.compile(r"(?:^|: )warnings$")
_LIFETIME_WHERE = re.compile(r"(?:^|: )lifetime$")


def mismatch_kind(m: harness.Mismatch | None) -> str:
    """``value`` (numbers differ), ``meta`` (None versus a tensor, shape,
    dtype), ``trace`` (hook trace), ``unexpected-success`` (eager raised),
    ``captures`` (a size sequence's captures break cagrad's rule, see
    :mod:`harness.capture_rule`), ``cache`` (a neighbour program got a
    wrong cache hit, see :class:`Oracle`), ``state`` (the backward left
    the process state, a random stream or a flag, otherwise than eager's:
    :func:`harness.compare.compare_state`), ``warnings`` (the backward
    emitted other Python warnings than eager's:
    :mod:`harness.warnings_seen`) or ``lifetime`` (the run left other
    storages of the forward alive than eager's: :mod:`harness.lifetimes`)."""
    if m is None:
        return "value"
    if _STATE_WHERE.search(m.where):
        return "state"
    if _WARNINGS_WHERE.search(m.where):
        return "warnings"
    if _LIFETIME_WHERE.search(m.where):
        return "lifetime"
    if m.where == "cache":
        return "cache"
    if m.where == "captures":
        return "captures"
    if m.where == "exception":
        return "unexpected-success"
    if m.where.startswith("trace"):
        return "trace"
    return "meta" if m.max_abs is None else "value"


def failure_key(outcome: harness.Outcome) -> FailureKey:
    status = outcome.status.value
    if outcome.status is harness.Status.MISMATCH:
        kind = mismatch_kind(outcome.mismatch)
    elif outcome.error is not None:
        kind = outcome.error.type
    else:  # pragma: no cover - the harness sets error on every error outcome
        kind = "unknown"
    return FailureKey(outcome.subject, outcome.device, status, kind)


@dataclasses.dataclass
class NeighbourCheck:
    """One neighbour run after the program under one subject on one device.

    Attributes:
        subject, device: where it ran.
        index: 1-based position in the sequence; ``kind``, ``label``: what
            changed (:class:`fuzz.neighbours.Neighbour`).
        status: ``equal`` (agreed with eager), ``cache`` (differed after the
            program, agreed in a fresh state: a wrong cache hit),
            ``diverged`` (differed in a fresh state too) or ``skipped`` (it
            does not build under eager).
        hit: the run after the program was a cache hit (``cache_hits`` > 0).
        detail: what differed (empty when equal).
    """

    subject: str
    device: str
    index: int
    kind: str
    label: str
    status: str
    hit: bool = False
    detail: str = ""

    def text(self) -> str:
        hit = "hit" if self.hit else "miss"
        more = f": {self.detail}" if self.detail else ""
        return f"neighbour {self.index} ({self.label}) {hit}, {self.status}{more}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Verdict:
    """One program's result: ``report`` (None on a build error), the failure
    keys in the report's order, or ``build_error`` when the program does not
    build under eager (a bug in the fuzzer's catalog, not in a subject).
    ``neighbours`` lists the neighbour runs of :class:`Oracle`
    (``neighbours=N``), in run order."""

    report: harness.DifferentialReport | None
    keys: list[FailureKey]
    build_error: str | None = None
    neighbours: list[NeighbourCheck] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.keys and self.build_error is None

    def outcome(self, key: FailureKey) -> harness.Outcome | None:
        if self.report is None:
            return None
        for o in self.report.failures():
            if failure_key(o) == key:
                return o
        return None


def load_plugin(spec: str) -> list[harness.Subject]:
    """Subjects from ``"file.py:NAME"`` or ``"module:NAME"`` (see module doc)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"bad subject plugin {spec!r}; expected 'path/file.py:NAME' or 'module:NAME'")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ValueError(f"subject plugin file {str(path)!r} does not exist")
        mod_name = f"_cagrad_fuzz_plugin_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            assert loader_spec is not None and loader_spec.loader is not None
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    try:
        obj: Any = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"subject plugin {spec!r}: no attribute {attr!r}") from None
    if isinstance(obj, type) and issubclass(obj, harness.Subject):
        obj = obj()
    elif not isinstance(obj, harness.Subject) and callable(obj):
        obj = obj()
    subjects = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    for s in subjects:
        if not isinstance(s, harness.Subject):
            raise ValueError(f"subject plugin {spec!r} gave {s!r}, not a harness.Subject")
    return subjects


class Oracle:
    """Runs IR programs under eager and the chosen subjects.

    Args:
        subjects: harness subject names; ``None`` for
            :func:`harness.default_subjects` when no plugin is given, and
            for none when one is (a plugin alone runs only its subjects).
        plugins: plugin specs adding subjects (see module doc).
        devices: device names; ``None`` for every available device.
        neighbours: after the program, run up to this many neighbour
            programs under each cagrad subject without a reset (see the
            module doc); 0 turns it off.

    Raises:
        ValueError: no subject, one selected twice, a bad plugin, a
            negative ``neighbours``.
    """

    def __init__(
        self,
        subjects: Sequence[str] | None = None,
        plugins: Sequence[str] = (),
        devices: Sequence[str] | None = None,
        neighbours: int = 0,
    ):
        if neighbours < 0:
            raise ValueError(f"neighbours must be >= 0, got {neighbours}")
        self.neighbours = int(neighbours)
        self.subject_names = list(subjects) if subjects is not None else None
        self.plugins = list(plugins)
        resolved: list[harness.Subject] = []
        if subjects is None and not plugins:
            resolved = harness.default_subjects()
        elif subjects is not None:
            resolved = harness.resolve_subjects(list(subjects))
        self.plugin_of: dict[str, str] = {}
        for spec in self.plugins:
            for s in load_plugin(spec):
                self.plugin_of[s.name] = spec
                resolved.append(s)
        if not resolved:
            raise ValueError("no subjects selected")
        names = [s.name for s in resolved]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"subject(s) selected twice: {dupes}")
        self.subjects = resolved
        self.devices = [str(d) for d in harness.resolve_devices(list(devices) if devices else None)]
        # Dynamo's compiles time their guards for a metric only: skipped
        # here, where torch's compiled autograd compiles every new graph
        skip_guard_latency_profile()

    @property
    def peers(self) -> list[harness.Subject]:
        """The subjects run for comparison only: torch's compiled autograd
        (``torch_ca[...]``). A campaign may run them on a sample of its
        programs (``--peer-every``); cagrad's subjects and plugins run on
        every program."""
        return [s for s in self.subjects if isinstance(s, harness.TorchCompiledAutogradSubject)]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.subjects]

    def subject(self, name: str) -> harness.Subject:
        for s in self.subjects:
            if s.name == name:
                return s
        raise KeyError(name)

    def run(self, program: Program, only: FailureKey | None = None, peers: bool = True) -> Verdict:
        """Runs every subject on every device, or only ``only``'s pair (all
        subjects on its device when ``only`` names none of them, as for a
        crash of the harness itself). ``peers=False`` leaves out
        :attr:`peers` (unless nothing else is selected)."""
        subjects, devices = self.subjects, self.devices
        if not peers and only is None:
            peer_names = {s.name for s in self.peers}
            subjects = [s for s in subjects if s.name not in peer_names] or subjects
        if only is not None:
            devices = [only.device]
            named = [s for s in self.subjects if s.name == only.subject]
            subjects = named or self.subjects
        neighbours = _Neighbours(self, program, subjects) if self.neighbours else None
        try:
            report = harness.run_differential(
                IRProgram(program), subjects, devices, after_subject=neighbours.after if neighbours else None
            )
        except harness.ProgramBuildError as e:
            return Verdict(None, [], build_error=str(e))
        checks = neighbours.apply(report) if neighbours is not None else []
        return Verdict(report, [failure_key(o) for o in report.failures()], neighbours=checks)

    # ------------------------------------------------------------ neighbours
    def _sequence(
        self,
        subject: harness.Subject,
        device: torch.device,
        nbs: Sequence[Neighbour],
        references: dict[int, harness.Execution],
    ) -> list[tuple[NeighbourCheck, harness.Outcome | None]]:
        """The neighbours in order, no reset, up to the first that fails;
        each with the outcome that replaces the program's when it failed."""
        out: list[tuple[NeighbourCheck, harness.Outcome | None]] = []
        for k, nb in enumerate(nbs, 1):
            run = IRProgram(nb.program)
            reference = references.get(k)
            if reference is None:
                # as the program's own reference: run again where it warned
                # or records lifetimes (harness.runner.eager_reference)
                reference = references[k] = harness.eager_reference(run, device)
            check = NeighbourCheck(subject.name, str(device), k, nb.kind, nb.label, "equal")
            if reference.phase == "build":
                check.status = "skipped"
                check.detail = "does not build under eager"
                out.append((check, None))
                continue
            got = harness.execute(subject, run, device, reset=False)
            check.hit = got.counts.get("cache_hits", 0) > 0
            after = harness.judge(subject, device, reference, got)
            if after.ok:
                out.append((check, None))
                continue
            fresh = harness.judge(subject, device, reference, harness.execute(subject, run, device, reset=True))
            where = f"neighbour {k} ({nb.label})"
            if fresh.ok:
                check.status = "cache"
                check.detail = after.describe()
                out.append((check, _cache_outcome(after, where)))
            else:
                check.status = "diverged"
                check.detail = fresh.describe()
                out.append((check, _relabel(fresh, where)))
            break
        return out


class _Neighbours:
    """The neighbour sequences of one :meth:`Oracle.run` (module doc).

    :meth:`after` is ``run_differential``'s ``after_subject``: right after a
    cagrad subject agreed with eager on the program, its neighbours run in
    the state that run left (no replay of the program is needed).
    :meth:`apply` then puts each failed sequence's outcome in place of the
    program's and adds one note per (subject, device), in run order.
    """

    def __init__(self, oracle: Oracle, program: Program, subjects: Sequence[harness.Subject]):
        self.oracle = oracle
        compiled = any(isinstance(s, harness.CagradSubject) for s in subjects)
        self.nbs = derive(program, oracle.neighbours) if compiled else []
        #: device -> neighbour index -> eager's run of that neighbour, shared
        #: by the subjects of a device
        self.references: dict[str, dict[int, harness.Execution]] = {}
        self.done: list[tuple[harness.Outcome, list[tuple[NeighbourCheck, harness.Outcome | None]]]] = []

    def after(self, subject: harness.Subject, device: torch.device, outcome: harness.Outcome) -> None:
        if not self.nbs or not isinstance(subject, harness.CagradSubject) or not outcome.ok:
            return
        references = self.references.setdefault(str(device), {})
        pair = self.oracle._sequence(subject, device, self.nbs, references)
        self.done.append((outcome, pair))

    def apply(self, report: harness.DifferentialReport) -> list[NeighbourCheck]:
        checks: list[NeighbourCheck] = []
        for outcome, pair in self.done:
            checks += [c for c, _ in pair]
            if not pair:
                continue
            report.notes.append(f"{outcome.subject}@{outcome.device}: " + "; ".join(c.text() for c, _ in pair))
            failed = pair[-1][1]
            if failed is not None:
                index = next(i for i, o in enumerate(report.outcomes) if o is outcome)
                report.outcomes[index] = failed
        return checks


def _relabel(outcome: harness.Outcome, where: str) -> harness.Outcome:
    """``outcome`` with every mismatch detail prefixed by ``where``."""
    mismatches = [dataclasses.replace(m, detail=f"{where}: {m.detail}") for m in outcome.mismatches]
    return dataclasses.replace(outcome, mismatches=mismatches)


def _cache_outcome(after: harness.Outcome, where: str) -> harness.Outcome:
    """A ``mismatch`` whose first entry is at ``"cache"``: ``where`` ran
    after the program and differed from eager (``after``), and agreed in a
    fresh cagrad state."""
    what = after.describe() or after.status.value
    first = harness.Mismatch(
        "cache", f"{where} ran after the program and gave a wrong result ({what}); in a fresh cache it agrees with eager"
    )
    relabelled = _relabel(after, where)
    return dataclasses.replace(relabelled, status=harness.Status.MISMATCH, mismatches=[first, *relabelled.mismatches])
