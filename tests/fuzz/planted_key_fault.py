"""A cagrad subject whose cache key leaves out one attribute of one node type.

Loading this file (``--plugin PATH/planted_key_fault.py:KeyLeavesOutOneAttribute``)
patches cagrad's key collector in that process, so that ``CumsumBackward0``'s
key no longer holds its ``dim`` (``CAGRAD_PLANTED_KEY_FAULT=Node.attribute``
picks another): a later ``cumsum`` over another dim, run in the same cagrad
state, hits the earlier entry and silently gets its gradients. This is the
fault the issue planted by hand, planted here by the test; the package never
imports it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import harness
from cagrad.keys import compiled_node_args

NODE, ATTRIBUTE = os.environ.get("CAGRAD_PLANTED_KEY_FAULT", "CumsumBackward0.dim").split(".")

_original = compiled_node_args.Collector._write_traced


def _faulty(self: Any, w: Any, call: Any, schema: Any) -> None:
    if schema.name == NODE:
        schema = dataclasses.replace(schema, values=tuple(a for a in schema.values if a != ATTRIBUTE))
    _original(self, w, call, schema)


compiled_node_args.Collector._write_traced = _faulty


class KeyLeavesOutOneAttribute(harness.CagradSubject):
    """``cagrad[eager]`` with the planted key fault (module doc)."""

    def __init__(self) -> None:
        super().__init__("eager")
        self.name = f"cagrad-without-{NODE}.{ATTRIBUTE}[eager]"
