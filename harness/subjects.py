"""Subjects: the engines whose backward the oracle checks against eager autograd.

A subject is selected by name:

* ``"eager"``: plain torch autograd (the reference runs it too; as a subject
  it checks that a second eager run is deterministic).
* ``"cagrad[<backend>]"``: the backward runs inside
  ``cagrad.enable(<backend>)``; ``<backend>`` is ``eager``, ``aot_eager`` or
  ``inductor`` (any ``torch.compile`` backend name cagrad accepts).
* ``"torch_ca[<backend>]"``: PyTorch's own compiled autograd, entered as
  ``torch._dynamo.compiled_autograd._enable(functools.partial(torch.compile,
  backend=<backend>, fullgraph=False))`` (the ``compiler_fn`` receives the
  captured ``GraphModule``; see ``torch/_dynamo/compiled_autograd.py``).

Both compiled families accept a second bracket item, ``dynamic`` or
``static``, passed as ``dynamic=True/False`` to their enable call
(``"cagrad[aot_eager,dynamic]"``); without it each uses its own default.
cagrad also accepts ``reduce-overhead`` there, alone or after the other
(``"cagrad[inductor,reduce-overhead]"``,
``"cagrad[inductor,dynamic,reduce-overhead]"``): ``cagrad.enable(...,
mode="reduce-overhead")``, CUDA graphs. A CUDA graph is recorded on a
backward's second call at its sizes and replayed from the third on, so that
subject runs each program :data:`CUDA_GRAPH_STEPS` times (a warm-up, a
recording, two replays, the last of them started before its guard ran),
and the oracle compares every one of them with eager.

A subject resets its engine's state before every run (``cagrad.reset()``,
``compiled_autograd.reset()``, ``torch._dynamo.reset()``) and reports counter
deltas over the run, so runs do not leak into each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from harness.capture_rule import CaptureRule
from harness.program import ProgramRun, run_backward

KNOWN_BACKENDS = ("eager", "aot_eager", "inductor")

CUDA_GRAPH_STEPS = 4
"""Runs of each program under a ``reduce-overhead`` subject: the warm-up
(the backend compiles), the recording (and its first replay), a replay that
teaches the graph's replay history, and a replay started early
(:meth:`cagrad.compile.cuda_graphs.CudaGraphed.speculate`)."""


@dataclasses.dataclass(frozen=True)
class SizeProbe:
    """What a subject's graph says about sizes, for the capture rule
    (:mod:`harness.capture_rule`).

    Attributes:
        static: what in the graph keeps sizes static in this engine by
            design (names; empty: none): the capture rule is then checked in
            its weaker form.
        size_values: the engine's size slots (cagrad: every size, stride
            and offset its cache key reads, in slot order): the value of
            each slot that may become a symbol, None for one that stays
            static; empty when unknown. Slots of equal value share a symbol
            (duck sizing), so a variant where equal slots come apart, or
            the reverse, may cost a capture.
    """

    static: list[str] = dataclasses.field(default_factory=list)
    size_values: tuple[int | None, ...] = ()


class Subject:
    """Base class: plain eager autograd; subclasses override the hooks below.

    Attributes:
        name: the selection name, also written into outcomes.
        backend: the compiler backend name the tolerance policy keys on
            (``None`` for plain eager).
    """

    name: str = "eager"
    backend: str | None = None
    #: How many times :func:`harness.execution.execute` builds the program
    #: and runs its backward in a row, the subject's state kept between
    #: them (each step is compared with eager's one run).
    steps: int = 1
    #: A peer is an engine the harness compares against eager for
    #: information (torch's own compiled autograd): its failures are
    #: reported, but they do not fail a suite that tests cagrad.
    peer: bool = False

    def prepare(self) -> None:
        """Called once per :func:`~harness.runner.run_differential`, before
        any run (the eager reference's included): imports and global setup,
        so that every run of the report sees the same process state.
        Must not raise; failures show up again in :meth:`reset`."""

    def reset(self) -> None:
        """Returns the engine to a fresh state (empty caches). Called before
        each run and after a run that raised."""

    def counters(self) -> dict[str, Any]:
        """A snapshot of the engine's cumulative counters: int values, and
        optionally ``"fallback_reasons"``, a ``{reason: count}`` dict."""
        return {}

    def capture_rule(self) -> CaptureRule | None:
        """The rule a size sequence's captures are checked with
        (:mod:`harness.capture_rule`), or None when the subject's captures
        are only reported (eager, torch's compiled autograd)."""
        return None

    def size_probe(self, run: ProgramRun) -> SizeProbe:
        """What the capture rule needs to know of ``run``'s graph in this
        engine (:class:`SizeProbe`; :mod:`harness.capture_rule`). Called
        after the build, before the backward."""
        return SizeProbe()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The context in which this subject's backward runs."""
        yield

    def run(self, run: ProgramRun) -> tuple[torch.Tensor | None, ...] | None:
        """Runs the program's backward under this subject (see
        :func:`harness.program.run_backward`); raises what the engine raises."""
        with self.active():
            return run_backward(run)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class EagerSubject(Subject):
    """Plain torch autograd."""

    def __init__(self, name: str = "eager") -> None:
        self.name = name


def _bracket(family: str, backend: str, dynamic: bool | None, mode: str | None = None) -> str:
    items = [backend]
    if dynamic is not None:
        items.append("dynamic" if dynamic else "static")
    if mode is not None:
        items.append(mode)
    return f"{family}[{','.join(items)}]"


class CagradSubject(Subject):
    """The backward runs through ``cagrad.enable(backend[, dynamic=...])``.

    Counters reported (deltas over the run): every integer counter cagrad
    exposes (``backwards``, ``captures``, ``cache_hits``, ``fallbacks``,
    ``recompiles_*``, ...), ``recompiles`` as the sum of the ``recompiles_*``
    ones, and ``fallback_reasons``. ``import cagrad`` happens at first use, so
    a broken cagrad shows up as an ``error`` outcome, not an import failure of
    the harness.
    """

    def __init__(self, backend: str = "eager", dynamic: bool | None = None, mode: str | None = None) -> None:
        self.backend = backend
        self.dynamic = dynamic
        self.mode = mode  # cagrad.enable's mode: None or "reduce-overhead"
        self.steps = CUDA_GRAPH_STEPS if mode == "reduce-overhead" else 1
        self.name = _bracket("cagrad", backend, dynamic, mode)

    @staticmethod
    def _cagrad() -> Any:
        import cagrad

        return cagrad

    def prepare(self) -> None:
        # ``import cagrad`` installs its hook-registration interception
        # process-wide; import it before the eager reference runs so that the
        # reference and the subjects build their graphs under the same patch.
        try:
            self._cagrad()
        except Exception:
            pass

    def reset(self) -> None:
        self._cagrad().reset()
        torch._dynamo.reset()

    def capture_rule(self) -> CaptureRule | None:
        return CaptureRule(self.dynamic)  # None: cagrad.enable's default

    def size_probe(self, run: ProgramRun) -> SizeProbe:
        """Traces the backward with ``cagrad.capture(..., dynamic=True)``
        (nothing runs) and reports its size slots' values
        (:attr:`SizeProbe.size_values`) and what may cost captures beyond
        the rule by design (:attr:`SizeProbe.static`): generated nodes with
        ``SymInt`` attributes and no Python formula (``cagrad.autograd.formulas``:
        their sizes stay static), sizes the trace specialized to a constant
        >= 2 (a C++ node's formula that reads a size as an int), and guards
        the trace recorded on the symbols (a new size that breaks one
        recaptures). A backward cagrad cannot compile gives no values."""
        import operator

        cagrad = self._cagrad()
        from cagrad.autograd.formulas import FORMULAS
        from cagrad.autograd.node_schema import NodeKind, schema_of

        found = set()
        for node in graph_nodes(run.outputs):
            schema = schema_of(node)
            if schema.kind is NodeKind.GENERATED and schema.sym_values and schema.name not in FORMULAS:
                found.add(schema.name)
        try:
            inputs = run.inputs if run.mode == "grad" else None
            captured = cagrad.capture(run.outputs, run.grad_outputs, inputs, dynamic=True)
        except Exception:  # noqa: BLE001 - unsupported: it falls back, nothing is captured
            return SizeProbe(sorted(found))
        graph = captured.graph_module.graph
        shape_env = None
        for n in graph.nodes:
            val = n.meta.get("val")
            if isinstance(val, torch.SymInt):
                shape_env = shape_env or val.node.shape_env
            if n.op == "call_function" and n.target is operator.getitem and getattr(n.args[0], "name", "") == "sizes":
                if isinstance(val, torch.SymInt) and val.node.expr.is_number and int(val) >= 2:
                    found.add(f"sizes[{n.args[1]}] specialized to {int(val)}")
        if shape_env is not None:
            guards = [shape_env.replace(g.expr) for g in shape_env.guards]
            guards = [g for g in guards if not (g.is_number or g == True)]  # noqa: E712 - sympy.true
            if guards:
                found.add(f"{len(guards)} guard(s) on sizes, e.g. {guards[0]}")
        return SizeProbe(sorted(found), tuple(captured.size_values))

    def counters(self) -> dict[str, Any]:
        counters: Mapping[str, Any] = self._cagrad().counters
        snap: dict[str, Any] = {k: v for k, v in counters.items() if isinstance(v, int) and not isinstance(v, bool)}
        snap["fallback_reasons"] = dict(counters.get("fallback_reasons", {}))
        return snap

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        cagrad = self._cagrad()
        kwargs: dict[str, Any] = {} if self.dynamic is None else {"dynamic": self.dynamic}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        with cagrad.enable(self.backend, **kwargs):
            yield


class TorchCompiledAutogradSubject(Subject):
    """PyTorch's built-in compiled autograd, as a peer of cagrad.

    Counters reported (deltas): ``captures`` (``torch._dynamo.utils.counters
    ["compiled_autograd"]["captures"]``: graphs traced by
    ``AutogradCompilerInstance.begin_capture``), ``recompiles`` (captures
    after the first) and ``dynamo_graphs`` (``counters["stats"]
    ["unique_graphs"]``: graphs Dynamo compiled, the CA graph and any hook
    graphs). Torch's compiled autograd has no fallback counter.
    """

    peer = True

    def __init__(self, backend: str = "eager", dynamic: bool | None = None) -> None:
        self.backend = backend
        self.dynamic = dynamic
        self.name = _bracket("torch_ca", backend, dynamic)

    def reset(self) -> None:
        from torch._dynamo import compiled_autograd

        compiled_autograd.reset()
        torch._dynamo.reset()

    def counters(self) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        return {
            "captures": int(counters["compiled_autograd"]["captures"]),
            "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
        }

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        from torch._dynamo import compiled_autograd

        compiler_fn = functools.partial(torch.compile, backend=self.backend, fullgraph=False)
        kwargs = {} if self.dynamic is None else {"dynamic": self.dynamic}
        with compiled_autograd._enable(compiler_fn, **kwargs):
            yield


def graph_nodes(outputs: Iterable[torch.Tensor]) -> list[Any]:
    """Every autograd node reachable from ``outputs``' ``grad_fn`` s."""
    seen: set[int] = set()
    out: list[Any] = []
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return out


def counter_deltas(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
    """``(counts, fallback_reasons)`` that changed between two snapshots.

    ``counts`` has every integer key of ``after`` (delta), plus ``recompiles``
    (sum of ``recompiles_*`` keys when the subject has them, else captures
    beyond the first).
    """
    counts = {
        k: int(v) - int(before.get(k, 0))
        for k, v in after.items()
        if k != "fallback_reasons" and isinstance(v, int)
    }
    if counts:
        parts = [v for k, v in counts.items() if k.startswith("recompiles_")]
        if parts:
            counts["recompiles"] = sum(parts)
        elif "captures" in counts:
            counts["recompiles"] = max(0, counts["captures"] - 1)
    reasons_before = before.get("fallback_reasons", {}) or {}
    reasons_after = after.get("fallback_reasons", {}) or {}
    reasons = {
        str(r): int(n) - int(reasons_before.get(r, 0))
        for r, n in reasons_after.items()
        if int(n) - int(reasons_before.get(r, 0)) > 0
    }
    return counts, reasons


_NAME = re.compile(
    r"^(?P<family>[a-z_]+)(?:\[(?P<backend>[A-Za-z0-9_.\-]+)(?:,(?P<mode>dynamic|static))?"
    r"(?:,(?P<graphs>reduce-overhead))?\])?$"
)

_FAMILIES = {"cagrad": CagradSubject, "torch_ca": TorchCompiledAutogradSubject}


def split_names(text: str) -> list[str]:
    """Comma-separated subject names, commas inside brackets kept:
    ``"cagrad[aot_eager,dynamic], eager"`` -> ``["cagrad[aot_eager,dynamic]",
    "eager"]`` (blank items dropped, each stripped)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [s.strip() for s in out if s.strip()]


def make_subject(name: str) -> Subject:
    """The subject a name selects (see the module docstring for the grammar).

    Raises:
        ValueError: the name does not parse, names an unknown family,
            gives a backend to ``eager`` / omits it for a compiled family, or
            gives ``reduce-overhead`` to a family other than cagrad.
    """
    m = _NAME.match(name.replace(" ", ""))
    if not m:
        raise ValueError(f"bad subject name {name!r}; expected e.g. 'eager', 'cagrad[aot_eager]', 'torch_ca[eager]'")
    family, backend, mode, graphs = m["family"], m["backend"], m["mode"], m["graphs"]
    if family == "eager":
        if backend is not None:
            raise ValueError(f"subject 'eager' takes no backend (got {name!r})")
        return EagerSubject()
    if family not in _FAMILIES:
        raise ValueError(f"unknown subject family {family!r} in {name!r}; known: eager, {', '.join(_FAMILIES)}")
    if backend is None:
        raise ValueError(f"subject {name!r} needs a backend, e.g. {family}[eager]")
    dynamic = None if mode is None else mode == "dynamic"
    if graphs is not None:
        if family != "cagrad":
            raise ValueError(f"{graphs!r} is a cagrad mode; {family} takes only dynamic or static (got {name!r})")
        return CagradSubject(backend, dynamic, graphs)
    return _FAMILIES[family](backend, dynamic)


def resolve_subjects(subjects: Iterable[Subject | str] | Subject | str | None) -> list[Subject]:
    """Turns names and/or :class:`Subject` objects into subjects;
    ``None`` means :func:`default_subjects`."""
    if subjects is None:
        return default_subjects()
    if isinstance(subjects, (str, Subject)):
        subjects = [subjects]
    return [make_subject(s) if isinstance(s, str) else s for s in subjects]


def default_subjects(inductor: bool = False) -> list[Subject]:
    """``cagrad[eager]``, ``cagrad[aot_eager]``, ``torch_ca[eager]``; with
    ``inductor=True`` also ``cagrad[inductor]`` and ``torch_ca[inductor]``
    (inductor compiles take seconds each on CPU)."""
    names = ["cagrad[eager]", "cagrad[aot_eager]", "torch_ca[eager]"]
    if inductor:
        names += ["cagrad[inductor]", "torch_ca[inductor]"]
    return [make_subject(n) for n in names]


def all_subject_names() -> list[str]:
    """Every subject name with a known backend: eager, then each family x backend."""
    return ["eager"] + [f"{fam}[{b}]" for fam in _FAMILIES for b in KNOWN_BACKENDS]
