"""Warm start across processes: captured graphs stored on disk.

With ``cagrad.enable(..., cache_dir=DIR)`` (or the environment variable
``CAGRAD_CACHE_DIR``), a capture that misses the in-memory cache first
looks for its graph in ``DIR``; a second process that runs the same model
then skips cagrad's trace, and hands the rebuilt graph to the backend, whose
own disk caches (inductor's FX graph cache, AOTAutograd's cache) find their
compiled code under the same key as in the first process.

What is stored
--------------

One file per key sequence, ``DIR/<sha256 of the disk key>.cagrad-graph``,
holding what rebuilds the capture's :class:`~cagrad.capture.traced.Traced` without
tracing: the graph's nodes (:mod:`cagrad.compile.graph_serde`), the fake value of
every ``inputs[i]`` and ``sizes[j]`` read (dtype, device, sizes, strides and
offset as expressions over the trace's symbols), the symbols in the order
the trace created them (each recreated from its source name, so it gets the
same name, and with sympy's ``positive`` assumption or without it, as the
trace made it: :func:`cagrad.capture.shape_env.create_symbol`), the :class:`~cagrad.keys.sizes.SizeCheck` as data, the size inputs as
expressions, and the input/output plan (``input_indices``,
``leaf_outputs``, ``capture_outputs``, ``returns_input``). It is taken right
after the trace, before the backend adds its guards (the backend adds them
again when it compiles the rebuilt graph, from its own cache or not), and
written once the compile succeeded.

Before a record is written it is rebuilt in the writing process and must
give back the same record and the same graph code; anything that does not
round-trip exactly is not stored.

The disk key
------------

The sha256 is taken over, length-prefixed: a magic string and this module's
format version; torch's version and git revision; the Python version;
sympy's version; a digest of cagrad's own source files (any change to
cagrad's code makes new keys); torch's symbolic-shapes configuration; the
backend name and the ``dynamic`` flag; Dynamo's global state the compiled
graph runs in (grad mode, deterministic algorithms, default dtype, ...;
the thread count left out); then the type name and bytes of every
:class:`~cagrad.keys.cache_key.CacheKey` of the backward, the GraphTask key
first, in order: the in-memory cache's whole key. The file repeats the key
bytes, and a lookup compares them.

What is not stored (``counters["disk_skips"]``, reason logged at DEBUG on
the ``cagrad`` logger): graphs compiled by a callable ``compiler_fn`` or a
backend other than ``"eager"``, ``"aot_eager"`` and ``"inductor"`` (the
rebuilt graph keeps node metadata only on its inputs); graphs with hooks,
opaque calls, custom ``autograd.Function``\\ s, inlined AOTAutograd
backwards (their keys name a process-local id), segments or nodes forced
opaque; backwards under foreign saved-tensor hooks or with hooks added from
C++; graphs with a target or argument :mod:`cagrad.compile.graph_serde` does not
cover. Their graphs depend on Python objects of the process that traced
them, or on more than the key says.

Files
-----

::

    cagrad-graph-cache\\n                      magic line
    {"format": 1, "torch": ..., ...}\\n        header (JSON, one line)
    {...}                                     body (JSON)

The header holds the format, torch, Python and cagrad versions, the sha256
of the key and of the body, and the body's length. A file is written to a
temporary file in the same directory, flushed, and renamed over the entry
(``os.replace``): readers see a whole file, old or new, and concurrent
writers of one key leave one of their (equal) files. A file that cannot be
used raises :class:`cagrad.CacheFileError` naming it and what is wrong
(no wrong graph is ever used, and no file is ever deleted by cagrad).
A stored graph whose size check rejects the current sizes is not used; the
backward is traced and its file replaced.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import platform
import struct
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx

from ..autograd import run_context, saved_variables
from ..autograd.walk import Kind
from ..counters import counters
from ..errors import CacheFileError
from .graph_serde import NotSerializable
from .traced_serde import traced_from_data, traced_to_data

log = logging.getLogger("cagrad")

FORMAT = 1
MAGIC = b"cagrad-graph-cache\n"
SUFFIX = ".cagrad-graph"
ENV_VAR = "CAGRAD_CACHE_DIR"
STORED_BACKENDS = ("eager", "aot_eager", "inductor")

_KINDS = (Kind.ROOT, Kind.TRACED, Kind.ACCUMULATE)
_OTHER_PLACEHOLDERS = ("scalars", "hooks", "packed_inputs")


def resolve_dir(cache_dir: Any) -> str | None:
    """The directory ``enable(cache_dir=...)`` means (absolute): ``cache_dir``
    itself, else ``$CAGRAD_CACHE_DIR`` if set and not empty, else None (no
    disk cache). ``False`` means none even when the variable is set."""
    if cache_dir is False:
        return None
    if cache_dir is None:
        cache_dir = os.environ.get(ENV_VAR) or None
    if cache_dir is None:
        return None
    return os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))


# -- the key ------------------------------------------------------------------

_environment: bytes | None = None


def _source_digest() -> str:
    # every module of the package, by its path inside it
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        name = path.relative_to(root).as_posix()
        h.update(name.encode() + b"\0" + struct.pack("<Q", len(data)) + data)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _versions() -> dict[str, Any]:
    """What a file's header must name (computed once; do not mutate)."""
    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "python": f"{platform.python_implementation()} {'.'.join(map(str, sys.version_info[:3]))}",
        "cagrad": _source_digest(),
    }


def _environment_bytes() -> bytes:
    """What the trace depends on besides the keys (computed once)."""
    global _environment
    if _environment is None:
        from torch.fx.experimental import _config as fx_config

        env = {
            **_versions(),
            "torch_git": getattr(torch.version, "git_version", None),
            "sympy": sympy.__version__,
            "fx_config": repr(sorted(fx_config.get_config_copy().items())),
        }
        _environment = json.dumps(env, sort_keys=True).encode()
    return _environment


def _global_state() -> str:
    """Dynamo's global state under the grad mode compiled graphs run in, as
    JSON without the thread count.

    Raises:
        NotSerializable: this torch's ``GlobalStateGuard`` has no state to read.
    """
    with run_context.grad_mode():
        guard = torch._C._dynamo.guards.GlobalStateGuard()
    getstate = getattr(guard, "__getstate__", None)
    try:
        state = json.loads(getstate())
    except Exception as e:  # noqa: BLE001 - any failure means no key
        raise NotSerializable("global_state", f"cannot read Dynamo's global state ({e})") from e
    state.pop("num_threads", None)
    return json.dumps(state, sort_keys=True)


def _lp(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def disk_key(keys: Sequence[Any], backend: str, dynamic: bool | None) -> bytes:
    """The bytes a stored graph is filed under (see the module docstring).

    Raises:
        NotSerializable: the global state cannot be read.
    """
    parts = [
        _lp(MAGIC),
        _lp(_environment_bytes()),
        _lp(json.dumps({"backend": backend, "dynamic": dynamic}, sort_keys=True).encode()),
        _lp(_global_state().encode()),
        struct.pack("<Q", len(keys)),
    ]
    for key in keys:
        parts.append(_lp(key.node_type.encode()))
        parts.append(_lp(key.key))
    return b"".join(parts)


# -- what may be stored -------------------------------------------------------


def collected_reason(collected: Any, compiler_fn: Any) -> str | None:
    """Why this backward's graph may not be stored or loaded, or None."""
    if not isinstance(compiler_fn, str):
        return "callable_compiler"
    if compiler_fn not in STORED_BACKENDS:
        return f"backend:{compiler_fn}"
    collector = collected.collector
    if collector.needs_host:
        return "cpp_hooks"
    if collector.has_subclass:
        return "tensor_subclass"  # the graph data holds no subclass specs
    foreign = collector.census.claim_slots  # pack hooks were pushed at some point
    for call, plan in zip(collected.task.order, collector.plans):
        if plan.kind not in _KINDS:
            return f"node_kind:{plan.kind.value}"
        if plan.hooks is not None:
            return "hooks"
        if foreign and plan.kind is Kind.TRACED and call.node is not None:
            if saved_variables.may_have_foreign_hooks(call.node):
                return "saved_tensors_hooks"
    if collector.any_opaque:
        return "opaque"
    return None


def traced_reason(traced: Any) -> str | None:
    """Why this capture may not be stored (beyond :func:`collected_reason`)."""
    if traced.force_opaque:
        return "forced_opaque"
    if traced.has_opaque_calls:
        return "opaque_calls"
    if traced.retain_outputs:
        return "retain_grad"  # the record holds no retain_outputs: .grad would not be set
    for node in traced.graph_module.graph.nodes:
        if node.op == "placeholder" and node.target in _OTHER_PLACEHOLDERS and node.users:
            return "runtime_objects"
    return None


# -- files ----------------------------------------------------------------------


@dataclasses.dataclass
class Record:
    """A capture ready to be written once its compile succeeded."""

    path: str
    blob: bytes


class DiskCache:
    """The graphs of one cache directory (see the module docstring).

    Args:
        directory: where the files are; created on the first store.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def path_of(self, key: bytes) -> str:
        return os.path.join(self.directory, hashlib.sha256(key).hexdigest() + SUFFIX)

    def load(self, collected: Any, compiler_fn: Any, dynamic: bool | None) -> tuple[Any, bool]:
        """``(traced, other_sizes)``: the stored capture of this backward,
        rebuilt, or None (nothing stored, not storable, or its size check
        rejects these sizes); ``other_sizes`` is True in the last case (a
        process ran this graph at other sizes: evidence that they change,
        which ``dynamic=None`` traces symbolic at once on). Counts
        ``disk_hits``.

        Raises:
            cagrad.CacheFileError: the file for this key cannot be used.
        """
        if collected_reason(collected, compiler_fn) is not None:
            return None, False
        try:
            key = disk_key(collected.keys, compiler_fn, dynamic)
        except Exception:  # noqa: BLE001 - no key, no lookup (the store skips it too)
            log.debug("cagrad: no disk key for this backward", exc_info=True)
            return None, False
        path = self.path_of(key)
        try:
            raw = pathlib.Path(path).read_bytes()
        except FileNotFoundError:
            return None, False
        except OSError as e:
            raise CacheFileError(path, f"it cannot be read ({e})") from e
        data = _parse(path, raw, key)
        values = collected.collector.sizes.values
        try:
            traced = traced_from_data(data, collected.collector.plans, values)
        except Exception as e:  # noqa: BLE001 - a record that does not rebuild is unusable
            raise CacheFileError(path, f"its graph cannot be rebuilt ({type(e).__name__}: {e})") from e
        if traced is None:
            log.debug("cagrad: the stored graph %s does not accept these sizes; tracing", path)
            return None, True
        counters.bump("disk_hits")
        log.debug("cagrad: graph loaded from %s", path)
        return traced, False

    def record(self, collected: Any, traced: Any, compiler_fn: Any, dynamic: bool | None) -> Record | None:
        """The file a fresh capture would be stored as, checked by rebuilding
        it; None (counted in ``disk_skips``, reason logged) when it may not
        be stored or does not rebuild exactly. Call it before compiling."""
        reason = collected_reason(collected, compiler_fn) or traced_reason(traced)
        try:
            if reason is None:
                key = disk_key(collected.keys, compiler_fn, dynamic)
                data = traced_to_data(traced)
                text = json.dumps(data, separators=(",", ":"), allow_nan=False)
                reason = _round_trip_problem(text, traced, collected)
        except NotSerializable as e:
            reason = f"unserializable:{e.reason}"
            log.debug("cagrad: graph not stored (%s)", e)
        except Exception as e:  # noqa: BLE001 - a record that cannot be made is not stored
            reason = f"record_failed:{type(e).__name__}"
            log.debug("cagrad: no record for this graph", exc_info=True)
        if reason is not None:
            counters.bump("disk_skips")
            log.debug("cagrad: graph not stored on disk (%s)", reason)
            return None
        body = json.loads(text)
        body["key"] = base64.b64encode(key).decode()
        return Record(self.path_of(key), _file_bytes(key, body))

    def store(self, record: Record) -> None:
        """Writes ``record`` atomically; counts ``disk_stores`` (a write that
        fails is logged as a warning and counted in ``disk_skips``)."""
        try:
            _write_atomic(record.path, record.blob)
        except OSError as e:
            counters.bump("disk_skips")
            log.warning("cagrad: could not write the cache file %s: %s", record.path, e)
            return
        counters.bump("disk_stores")
        log.debug("cagrad: graph stored in %s", record.path)


def _round_trip_problem(text: str, traced: Any, collected: Any) -> str | None:
    """None if the record rebuilds the same record and graph code."""
    try:
        again = traced_from_data(json.loads(text), collected.collector.plans, traced.check.expected, hints=False)
    except Exception as e:  # noqa: BLE001 - whatever fails is a reason not to store
        log.debug("cagrad: a stored graph would not rebuild", exc_info=True)
        return f"rebuild_failed:{type(e).__name__}"
    if again is None:
        return "rebuild_rejects_sizes"
    if again.graph_module.code != traced.graph_module.code:
        return "rebuild_code_differs"
    if json.loads(json.dumps(traced_to_data(again))) != json.loads(text):
        return "rebuild_record_differs"
    return None


def _file_bytes(key: bytes, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    header = {
        **_versions(),
        "key_sha256": hashlib.sha256(key).hexdigest(),
        "body_sha256": hashlib.sha256(payload).hexdigest(),
        "body_bytes": len(payload),
    }
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def _parse(path: str, raw: bytes, key: bytes) -> dict[str, Any]:
    """The body of a cache file, checked against ``key``.

    Raises:
        cagrad.CacheFileError: see its docstring.
    """
    if not raw.startswith(MAGIC):
        raise CacheFileError(path, "it is not a cagrad graph cache file (no magic line)")
    end = raw.find(b"\n", len(MAGIC))
    if end < 0:
        raise CacheFileError(path, "it is truncated (no complete header line)")
    try:
        header = json.loads(raw[len(MAGIC) : end])
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise CacheFileError(path, f"its header is not JSON ({e})") from e
    ours = _versions()
    named = (("format", "file format"), ("torch", "torch"), ("python", "Python"), ("cagrad", "cagrad source"))
    for field, what in named:
        if header.get(field) != ours[field]:
            raise CacheFileError(
                path, f"it was written for {what} {header.get(field)!r}; this process has {ours[field]!r}"
            )
    if header.get("key_sha256") != hashlib.sha256(key).hexdigest():
        raise CacheFileError(path, "its header names another key")
    body = raw[end + 1 :]
    if len(body) != header.get("body_bytes"):
        raise CacheFileError(
            path,
            f"it is truncated or has extra bytes (body {len(body)} bytes, header says {header.get('body_bytes')})",
        )
    if hashlib.sha256(body).hexdigest() != header.get("body_sha256"):
        raise CacheFileError(path, "its body does not match its checksum (corrupt)")
    try:
        data = json.loads(body)
        stored_key = base64.b64decode(data["key"], validate=True)
    except Exception as e:  # noqa: BLE001 - whatever the body is, it is not ours
        raise CacheFileError(path, f"its body is not a cagrad record ({type(e).__name__}: {e})") from e
    if stored_key != key:
        raise CacheFileError(path, "the key stored in it is not the key it was looked up for")
    return data


def _write_atomic(path: str, blob: bytes) -> None:
    """Writes ``blob`` to a temporary file next to ``path``, then renames it."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
