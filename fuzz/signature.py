"""Root-cause signatures: one bug, one failure.

A campaign groups the programs that diverge by *what failed*, not by which
ops the program happened to use: a fault in one backward formula hits every
program whose graph holds that node, whatever else the program does, and must
come back as one failure.

:func:`root_cause` reduces one harness outcome (the JSON of
:meth:`harness.Outcome.to_json`, or a ``crash``/``timeout`` dict written by a
campaign worker) to a short text that is stable across programs:

* ``error``: the exception type and a *template* of its message: the first
  paragraph (at most :data:`MAX_LINES` lines; dynamo's ``Hint:`` and ``from user
  code:`` sections and anything after them dropped; a dynamo
  ``call_function f(*args)`` written ``call_function f(...)``), with numbers, shapes, sizes, tensor reprs,
  addresses, file paths and generated names replaced by placeholders
  (``<n>``, ``<shape>``, ``<tensor>``, ``<addr>``, ``<path>``, ``<name>``).
  When eager raised too (another type), `` (eager raised T)`` is appended.
* ``mismatch``: the first autograd node whose output differs (its type name,
  ``MulBackward0``) when the outcome names one (``first_node`` in the outcome
  or in its first mismatch); otherwise what differs, from the first
  mismatch: the value's role (``grad`` for leaf ``.grad`` and
  ``autograd.grad`` results alike, ``trace``, ``captures``, ``exception``,
  ``result count``, ...) and the template of its detail; numeric
  differences say only ``values differ``, and hook events recorded in
  another order than eager's say ``hook events in another order``; a
  field of the process state the backward left otherwise than eager's
  says ``state <field> left otherwise than eager's`` (``state cpu_rng``:
  the subject drew from the CPU generator, or did not draw as eager did);
  a warning emitted another number of times than eager's says
  ``warnings: <category> <message template> fewer|more times than eager's``;
  a storage of the forward that the run left alive where eager freed it
  (or the reverse) says ``lifetime: forward storages alive|freed <point>
  where eager ...`` without the list of storages
  (:func:`harness.lifetimes.compare_lifetimes`).
* ``crash``: the signal name (``SIGSEGV``); ``timeout``: ``timeout``.

:func:`make_signature` prefixes it with ``subject@device status kind``.
"""

from __future__ import annotations

import re
import signal
from typing import Any

#: Lines of an exception message kept in its template.
MAX_LINES = 3
#: Characters of a root cause kept (longer ones are cut, ending in ``...``).
MAX_CHARS = 320

# Each rule is (pattern, placeholder), applied in order. Structured values
# first (a tensor repr holds numbers and shapes), bare numbers last.
_PATH = r"(?:[A-Za-z]:|[.~])?/(?:[\w.\-<>]+/)*[\w.\-<>]+"
_RULES: list[tuple[re.Pattern[str], str]] = [
    # dynamo's "call_function f(*(args...), **{kwargs})": the arguments vary
    (re.compile(r"(call_(?:function|method|module) (?:<[^>]*>|[^\s(]+))\(\*.*?\*\*\{[^}]*\}\)"), r"\1(...)"),
    (re.compile(r'File "[^"]*", line \d+'), "File <path>"),
    (re.compile(r"<eval_with_key>\.\d+"), "<eval_with_key>"),
    (re.compile(r"\b0x[0-9A-Fa-f]+\b"), "<addr>"),
    (re.compile(r"torch\.Size\(\[[^\]]*\]\)"), "<shape>"),
    # shapes written as lists or tuples of integers: [2, 3], (4,), []
    # (symbolic sizes too: s57, u0)
    (re.compile(r"\[\s*(?:(?:-?\d+|[su]\d+)\s*,\s*)*(?:-?\d+|[su]\d+)\s*,?\s*\]|\[\]"), "<shape>"),
    (re.compile(r"\(\s*(?:-?\d+\s*,\s*)+(?:-?\d+\s*)?\)"), "<shape>"),
    (re.compile(r"\b\d+(?:x\d+)+\b"), "<shape>"),
    (re.compile(r"(?<![\w.])" + _PATH), "<path>"),
    # generated names: fuzz IR values ("mul:0"), graph nodes ("getitem_11",
    # "mul_3"), leaves and temporaries ("t3", "x12")
    (re.compile(r"\b([A-Za-z]+):\d+\b"), r"\1:<n>"),
    (re.compile(r"\b([a-z][a-z0-9]*)_\d+\b"), r"\1_<n>"),
    (re.compile(r"\b[a-z]\d+[a-z]?\b"), "<name>"),
    (re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w])"), "<n>"),
    (re.compile(r"\b(?:nan|inf)\b"), "<n>"),
    (re.compile(r"[ \t]+"), " "),
]

# where-labels of harness.Mismatch -> the role of the value that differs
_STATE_WHERE = re.compile(r"(?:^|: )(state \w+)$")
_WHERE_ROLES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^leaf \d+ \.grad$"), "grad"),
    (re.compile(r"^grad result \d+$"), "grad"),
    (re.compile(r"^trace length$"), "trace length"),
    (re.compile(r"^trace\b"), "trace"),
    (re.compile(r"(?:^|: )warnings$"), "warnings"),
    (re.compile(r"(?:^|: )lifetime$"), "lifetime"),
]


# harness.warnings_seen.compare_warnings's detail
_WARNED = re.compile(
    r"^the backward emitted (?P<category>\w+) (?P<text>.*) \(at [^()]*\) (?P<got>\d+) time\(s\); "
    r"eager's emitted it (?P<want>\d+) time\(s\)"
)

# a trace entry whose hook label differs: "eager has 'h3 post v2', subject has 'h1 pre v0'"
_HOOK_LABEL = r"'h\d+\w* \w+ [^']*'"
_HOOK_ORDER = re.compile(rf"eager has {_HOOK_LABEL}, subject has {_HOOK_LABEL}$")


def _replace_tensor_reprs(text: str) -> str:
    """``tensor(...)`` (balanced parentheses, possibly over several lines)
    becomes ``<tensor>``."""
    out: list[str] = []
    i = 0
    for m in re.finditer(r"\b(?:tensor|Parameter|FakeTensor|FunctionalTensor)\(", text):
        if m.start() < i:
            continue
        depth, j = 0, m.end() - 1
        while j < len(text):
            if text[j] == "(":
                depth += 1
            elif text[j] == ")":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        out.append(text[i : m.start()])
        out.append("<tensor>")
        i = j + 1
    out.append(text[i:])
    return "".join(out)


def template(text: str) -> str:
    """``text`` with the parts that vary between programs replaced by
    placeholders (see the module doc), whitespace runs collapsed.

    >>> template("shape '[2, 3]' is invalid for input of size 7")
    "shape '<shape>' is invalid for input of size <n>"
    """
    text = _replace_tensor_reprs(text)
    for pattern, placeholder in _RULES:
        text = pattern.sub(placeholder, text)
    return text.strip()


def _cut(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."


# lines where the informative part of a (dynamo) message has ended
_BOILERPLATE = ("from user code:", "Set TORCHDYNAMO_VERBOSE", "Hint:", "Developer debug context")


def message_template(message: str) -> str:
    """The template of an exception message: its first paragraph (up to
    :data:`MAX_LINES` non-empty lines, stopping at a blank line or at
    dynamo's ``from user code:`` or ``Hint:``), templated, lines joined
    with `` | ``."""
    kept: list[str] = []
    started = False
    for line in _replace_tensor_reprs(message).splitlines():
        stripped = line.strip()
        if not stripped:
            if started:
                break
            continue
        if stripped.startswith(_BOILERPLATE):
            break
        started = True
        kept.append(template(stripped))
        if len(kept) == MAX_LINES:
            break
    return " | ".join(kept)


def _where_role(where: str) -> str:
    for pattern, role in _WHERE_ROLES:
        if pattern.search(where):
            return role
    return template(where)


def _first_node(outcome: dict[str, Any]) -> str | None:
    node = outcome.get("first_node")
    mismatches = outcome.get("mismatches") or []
    if not node and mismatches and isinstance(mismatches[0], dict):
        node = mismatches[0].get("first_node") or mismatches[0].get("node")
    if isinstance(node, dict):  # {"type": "MulBackward0", ...}
        node = node.get("type") or node.get("name")
    return str(node) if node else None


def _mismatch_cause(outcome: dict[str, Any]) -> str:
    node = _first_node(outcome)
    if node:
        return f"first differing node {node}"
    mismatches = [m for m in outcome.get("mismatches") or [] if isinstance(m, dict)]
    if not mismatches:
        return "mismatch"
    first = mismatches[0]
    state = _STATE_WHERE.search(str(first.get("where", "")))
    if state:
        # the values (generator digests, config values) vary with the program
        return f"{state[1]} left otherwise than eager's"
    role = _where_role(str(first.get("where", "")))
    detail = str(first.get("detail", "")).strip()
    warned = _WARNED.match(detail) if role == "warnings" else None
    if role == "lifetime":
        # which storages vary with the program; the point and direction do not
        return f"lifetime: {detail.partition(':')[0]}"
    if warned:
        fewer = int(warned["got"]) < int(warned["want"])
        return f"warnings: {warned['category']} {message_template(warned['text'])} {'fewer' if fewer else 'more'} times than eager's"
    # numeric differences keep only that they differ: the numbers vary with
    # the program, and assert_close's first line names no cause
    if first.get("max_abs") is not None or detail.startswith(("Tensor-likes are not", "Scalars are not")):
        return f"{role} values differ"
    if role == "trace" and _HOOK_ORDER.match(detail):
        return "trace: hook events in another order"
    if detail.startswith("float differs"):
        return f"{role} float differs"
    return f"{role}: {message_template(detail)}" if detail else role


def _signal_name(sig: Any) -> str:
    if isinstance(sig, int) or (isinstance(sig, str) and sig.lstrip("-").isdigit()):
        try:
            return signal.Signals(abs(int(sig))).name
        except ValueError:
            return f"signal {abs(int(sig))}"
    return str(sig) if sig else "crash"


def root_cause(outcome: dict[str, Any]) -> str:
    """A short, stable text naming what failed in one outcome.

    Args:
        outcome: a harness outcome as JSON (:meth:`harness.Outcome.to_json`),
            or ``{"status": "crash", "signal": "SIGABRT" | 6, "detail": ...}``
            or ``{"status": "timeout", "seconds": 30.0}``.

    Returns:
        At most :data:`MAX_CHARS` characters (see the module doc); for an
        outcome that did not fail (``equal``, ``fallback``), its status.

    Raises:
        TypeError: ``outcome`` is not a dict.
    """
    if not isinstance(outcome, dict):
        raise TypeError(f"root_cause expects an outcome dict, got {type(outcome).__name__}")
    status = str(outcome.get("status", ""))
    if status == "crash":
        return _signal_name(outcome.get("signal"))
    if status == "timeout":
        return "timeout"
    if status == "mismatch":
        return _cut(_mismatch_cause(outcome))
    error = outcome.get("error")
    if isinstance(error, dict):
        text = str(error.get("type", "Exception"))
        msg = message_template(str(error.get("message", "")))
        if msg:
            text += f": {msg}"
        eager = outcome.get("eager_error")
        if isinstance(eager, dict) and eager.get("type"):
            suffix = f" (eager raised {eager['type']})"
            return _cut(text)[: max(0, MAX_CHARS - len(suffix))] + suffix
        return _cut(text)
    return status or "unknown"


def make_signature(subject: str, device: str, status: str, kind: str, outcome: dict[str, Any]) -> str:
    """``"{subject}@{device} {status} {kind}: {root_cause(outcome)}"``.

    Programs whose failures have the same signature are one failure.
    """
    return f"{subject}@{device} {status} {kind}: {root_cause(outcome)}"
