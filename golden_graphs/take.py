"""Taking a snapshot: build a scenario, capture its backward, normalize it."""

from __future__ import annotations

import cagrad

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
    return Snapshot(
        scenario=name,
        torch=version or torch_version(),
        about=sc.description,
        task_key=cap.task_key,
        cache_keys=tuple(cap.cache_keys),
        graph=tuple(graph_lines(cap.graph_module)),
        task_fields=task_fields,
        key_fields=tuple(node_fields),
    )
