"""The bridge from IR programs to the harness' differential oracle.

:class:`Oracle` holds the subjects and devices of a campaign and runs one IR
program through :func:`harness.run_differential`, reducing the report to
:class:`FailureKey` s: ``(subject, device, status, kind)`` where ``kind`` is
the exception type of an ``error`` outcome, or for a ``mismatch`` what
differs (:func:`mismatch_kind`: ``value``, ``meta``, ``trace``,
``unexpected-success`` or ``captures``). A failure's *signature* adds the sorted op set of
its shrunk program and its hook kinds (``hook:<kind>.<action>``).

Subjects are harness subject names (``"cagrad[aot_eager]"``) or *plugins*:
``"path/to/file.py:NAME"`` or ``"package.module:NAME"``, where ``NAME`` is a
:class:`harness.Subject` instance, a subclass (instantiated without
arguments), or a callable returning one or a list of them. Plugins let a
campaign check an engine the harness does not name; the tests use one to
inject a known divergence.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness
from fuzz.interpret import IRProgram
from fuzz.ir import Program


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


def mismatch_kind(m: harness.Mismatch | None) -> str:
    """``value`` (numbers differ), ``meta`` (None versus a tensor, shape,
    dtype), ``trace`` (hook trace), ``unexpected-success`` (eager raised) or
    ``captures`` (a size sequence's captures break cagrad's rule, see
    :mod:`harness.capture_rule`)."""
    if m is None:
        return "value"
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
class Verdict:
    """One program's result: ``report`` (None on a build error), the failure
    keys in the report's order, or ``build_error`` when the program does not
    build under eager (a bug in the fuzzer's catalog, not in a subject)."""

    report: harness.DifferentialReport | None
    keys: list[FailureKey]
    build_error: str | None = None

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
    """

    def __init__(
        self,
        subjects: Sequence[str] | None = None,
        plugins: Sequence[str] = (),
        devices: Sequence[str] | None = None,
    ):
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

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.subjects]

    def subject(self, name: str) -> harness.Subject:
        for s in self.subjects:
            if s.name == name:
                return s
        raise KeyError(name)

    def run(self, program: Program, only: FailureKey | None = None) -> Verdict:
        """Runs every subject on every device, or only ``only``'s pair (all
        subjects on its device when ``only`` names none of them, as for a
        crash of the harness itself)."""
        subjects, devices = self.subjects, self.devices
        if only is not None:
            devices = [only.device]
            named = [s for s in self.subjects if s.name == only.subject]
            subjects = named or self.subjects
        try:
            report = harness.run_differential(IRProgram(program), subjects, devices)
        except harness.ProgramBuildError as e:
            return Verdict(None, [], build_error=str(e))
        return Verdict(report, [failure_key(o) for o in report.failures()])
