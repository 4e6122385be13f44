"""The programs a seed generates are the same on every torch.

Torch 2.11 has no derivative for ``aminmax``; the catalog keeps the op (and
so its slots of the op table, :mod:`fuzz.op_table`) and runs it as ``amin``
and ``amax`` there (:data:`fuzz.ops_graph.AMINMAX`). These tests take the
derivative away from this torch in a fresh interpreter
(``tests/fuzz/old_torch/sitecustomize.py``) and compare what it generates
with an interpreter that has it: the catalog, a round's programs and the
coverage of a short campaign preview must be identical, and the substitute
must give the gradients that were worked out by hand. The same interpreter
imports ``fuzz.ops_graph`` before ``fuzz.ops``, which must not reorder the
catalog (:func:`fuzz.op_spec.order_catalog`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fuzz import ops as catalog
from fuzz.op_spec import order_catalog

ROOT = Path(__file__).resolve().parents[2]
OLD_TORCH = Path(__file__).resolve().parent / "old_torch"

_SCRIPT = """
import hashlib, json
import fuzz.ops_graph  # first: the catalog's order must not depend on it
import torch
from fuzz import ops as catalog
from fuzz.campaign.steer import RoundPlan, preview, round_test
from fuzz.ops_graph import AMINMAX, SUBSTITUTIONS
from fuzz.strategies import GenConfig

out = []
round_test(RoundPlan().gen(GenConfig()), 77, 20, lambda p: out.append(p.to_json(indent=None)))()
spec = catalog.OPS.get("aminmax")
x = torch.tensor([[1.0, 1.0, 2.0], [3.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
grads = []
for lo, hi in (spec.run([x], {"dim": 1}), eval(spec.code(["x"], {"dim": 1}))) if spec else ():
    x.grad = None
    torch.autograd.backward([lo, hi], [torch.tensor([1.0, 10.0], dtype=torch.float64),
                                       torch.tensor([100.0, 1000.0], dtype=torch.float64)])
    grads.append(x.grad.tolist())
print(json.dumps({
    "aminmax_derivative": AMINMAX,
    "substitutions": SUBSTITUTIONS,
    "code": spec and spec.code(["x"], {"dim": 1}),
    "grads": grads,
    "ops": list(catalog.OPS),
    "round": hashlib.sha256("\\n".join(out).encode()).hexdigest(),
    "preview": preview(GenConfig(), 1, 30, 10),
}, sort_keys=True))
"""


def _start(simulate: str) -> subprocess.Popen[str]:
    path = [str(OLD_TORCH), str(ROOT)] if simulate else [str(ROOT)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), FUZZ_SIMULATE_OLD_TORCH=simulate)
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout)


def test_a_torch_without_an_aminmax_derivative_generates_the_same_programs() -> None:
    procs = [_start(""), _start("aminmax_derivative")]  # side by side
    here, old = (_result(p) for p in procs)
    assert old["aminmax_derivative"] is False  # the simulation took effect
    # the catalog (whatever was imported first), a round's programs and
    # the coverage of a steered preview: the same with or without it
    assert here["ops"] == old["ops"] == list(catalog.OPS)
    assert old["round"] == here["round"]
    assert json.dumps(old["preview"]) == json.dumps(here["preview"])
    assert old["preview"]["programs"] == 30 and "aminmax" in old["preview"]["op_counts"]
    # by hand: each row's min and max take their output's gradient, split
    # evenly over tied elements ([1, 1, 2]: min 1 twice; [3, 0, 0]: min 0 twice);
    # the op's impl and its rendered code (reproducers) alike
    assert "aminmax" in old["substitutions"] and old["code"] == "(torch.amin(x, dim=1), torch.amax(x, dim=1))"
    by_hand = [[0.5, 0.5, 100.0], [1000.0, 5.0, 5.0]]
    assert here["grads"] == old["grads"] == [by_hand, by_hand]

def test_the_catalog_order_is_by_declared_module() -> None:
    names = list(catalog.OPS)
    assert names[0] == "neg" and names.index("var_mean") < names.index("aminmax") < names.index("topk")
    assert catalog.MODULE_ORDER[-1] == "fuzz.ops_dynamic"
    try:
        with pytest.raises(ValueError, match=r"registered by modules not in the catalog's order"):
            order_catalog(catalog.MODULE_ORDER[:-1])
        order_catalog(tuple(reversed(catalog.MODULE_ORDER)))
        assert next(iter(catalog.OPS)) != "neg"
    finally:
        order_catalog(catalog.MODULE_ORDER)
    assert list(catalog.OPS) == names
