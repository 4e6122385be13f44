"""Taking a snapshot: build a scenario, capture its backward, normalize it."""

from __future__ import annotations

import dataclasses

import cagrad
from cagrad import CacheKey

from . import key_fields, scenarios
from .normalize import graph_lines
from .snapshot import Snapshot
from .store import torch_version


def take(name: str, version: str | None = None) -> Snapshot:
    """The current :class:`Snapshot` of scenario ``name``.

    Builds the scenario (seeded, see :func:`golden_graphs.scenarios.build`)
    and calls :func:`cagrad.capture` with the keys' fields recorded
    (:func:`golden_graphs.key_fields.recording`), which traces without compiling or
    running anything and leaves cagrad's caches and counters alone.

    Args:
        name: a registered scenario.
        version: the torch ``major.minor`` to record (default: the running one).

    Raises:
        KeyError: no such scenario.
        cagrad.Unsupported: cagrad cannot capture the scenario's backward.
        Exception: whatever the scenario's forward raises.
    """
    sc = scenarios.get(name)
    bw = scenarios.build(name)
    with key_fields.recording() as writers:
        cap = cagrad.capture(
            bw.outputs, bw.grad_outputs, bw.inputs, dynamic=bw.dynamic, create_graph=bw.create_graph
        )
    task_fields, *node_fields = key_fields.fields_of(writers, [cap.task_key, *cap.cache_keys])
    tokens: dict[bytes, bytes] = {}
    node_fields = [_tokenized(fields, tokens) for fields in node_fields]
    cache_keys = [CacheKey(k.node_type, b"".join(f.data for f in fields)) for k, fields in zip(cap.cache_keys, node_fields)]
    return Snapshot(
        scenario=name,
        torch=version or torch_version(),
        about=sc.description,
        task_key=cap.task_key,
        cache_keys=tuple(cache_keys),
        graph=tuple(graph_lines(cap.graph_module)),
        task_fields=task_fields,
        key_fields=tuple(node_fields),
    )


FINGERPRINT = ": fingerprint"
"""Name suffix of the key fields that hold a fingerprint of Python code."""


def _tokenized(fields: tuple[key_fields.Field, ...], tokens: dict[bytes, bytes]) -> tuple[key_fields.Field, ...]:
    """``fields`` with each fingerprint of Python code replaced by a token.

    A traced hook's fingerprint (:mod:`cagrad.hooks.hook_tracing`) hashes its
    bytecode, which differs between Python versions (3.11 and 3.12 give
    other bytes for the same hook), while a snapshot set is made per torch
    version. So a snapshot pins which hooks share a fingerprint, not its
    bytes: the n-th distinct fingerprint of the scenario, in key order, is
    written ``fp-000000000000n`` (the same 16 ASCII characters in length,
    so the key bytes stay well formed). That the bytes are deterministic
    across processes is tested in ``tests/cagrad`` (the hook-tracing tests).
    ``tokens`` maps each fingerprint's bytes to its token, across the keys
    of one snapshot."""
    out = []
    for f in fields:
        if f.name.endswith(FINGERPRINT) and len(f.data) > 16:
            head, digest = f.data[:-16], f.data[-16:]
            token = tokens.setdefault(digest, f"fp-{len(tokens) + 1:013d}".encode())
            f = dataclasses.replace(f, data=head + token, value=repr(token.decode()))
        out.append(f)
    return tuple(out)
