"""Small graphs and keys pinned inline with expecttest.

``assertExpectedInline`` compares with the string literal in this file;
``EXPECTTEST_ACCEPT=1 python -m pytest tests/cagrad/test_inline_graphs.py``
rewrites the literals from the current output (review the diff). The text is
golden_graphs' normalizer of cagrad's graph (:mod:`golden_graphs.normalize`),
so it carries no addresses or process-dependent names.
"""

from __future__ import annotations

import expecttest
import torch

import cagrad
from golden_graphs import key_fields
from golden_graphs.normalize import graph_text


def _capture(loss: torch.Tensor, **kwargs) -> cagrad.Capture:
    return cagrad.capture(loss, **kwargs)


def _op_lines(cap) -> str:
    """The graph without its placeholder lines (they are the same for every graph)."""
    return "".join(line + "\n" for line in graph_text(cap.graph_module).splitlines() if not line.startswith("placeholder"))


class TestInlineGraphs(expecttest.TestCase):
    def test_mul_by_constant_graph(self):
        x = torch.ones(2, 3, requires_grad=True)
        self.assertExpectedInline(_op_lines(_capture((x * 3.0).sum())), """\
%in0 : f32[] = inputs[0]
%in1 : f64[] = inputs[1]
# SumBackward0 (NodeCall 0)
%expand : f32[2, 3] stride=(0, 0) = aten.expand.default(%in0, [2, 3])
# MulBackward0 (NodeCall 1)
%mul : f32[2, 3] = aten.mul.Tensor(%expand, %in1)
return [%mul]
""")

    def test_sum_dim_key_fields(self):
        x = torch.ones(2, 3, requires_grad=True)
        with key_fields.recording() as writers:
            cap = _capture(x.sum(dim=1).sum())
        fields = key_fields.fields_of(writers, cap.cache_keys)
        text = "".join(
            f"{key.node_type}: {f.line()}\n"
            for key, fs in zip(cap.cache_keys, fields)
            for f in fs
            if f.name.startswith("attribute")
        )
        self.assertExpectedInline(text, """\
SumBackward0: attribute self_sym_sizes: symints = sequence (size slots)
SumBackward0: attribute self_sym_sizes: length = 1
SumBackward1: attribute dim = (1,)
SumBackward1: attribute keepdim = False
SumBackward1: attribute self_sym_sizes: symints = sequence (size slots)
SumBackward1: attribute self_sym_sizes: length = 2
""")
