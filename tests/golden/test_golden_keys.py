"""Cache keys and graph text: deterministic, stable, and discriminating."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import torch

import cagrad
from golden_graphs import normalize, scenarios
from golden_graphs.snapshot import render
from golden_graphs.take import take

CROSS_PROCESS = ["mlp_step", "two_losses", "views", "autograd_grad_inputs"]

_SCRIPT = textwrap.dedent(
    """
    import sys
    from golden_graphs.snapshot import render
    from golden_graphs.take import take
    for name in sys.argv[1:]:
        sys.stdout.write(render(take(name)))
    """
)


def test_keys_and_graphs_are_identical_across_processes():
    """Two fresh interpreters (different hash seeds) render the same bytes,
    and so does this process."""
    procs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _SCRIPT, *CROSS_PROCESS],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                text=True,
            )
        )
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out)
    here = "".join(render(take(name)) for name in CROSS_PROCESS)
    assert outs[0] == outs[1] == here
    assert outs[0].count("[cache_keys]") == len(CROSS_PROCESS)


def test_retracing_gives_the_same_snapshot():
    """Capturing a scenario again (new autograd graph, new FX tracer, FX
    name counters in a different state) gives the same text."""
    first = render(take("shared_subexpression"))
    take("matmul_chain")
    assert render(take("shared_subexpression")) == first


def test_building_a_scenario_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    scenarios.build("mlp_step")
    assert torch.equal(torch.rand(3), expected)


def _capture_sum(dim: int, seed: int):
    torch.manual_seed(seed)
    x = torch.randn(3, 3, requires_grad=True)
    return cagrad.capture(x.sum(dim=dim).exp().sum())


def test_key_distinguishes_a_baked_reduction_dim():
    """sum over dim 0 vs dim 1: same node types, same shapes; only the
    SumBackward1 key (its saved dim) differs, and so does the graph."""
    a, b = _capture_sum(0, seed=0), _capture_sum(1, seed=0)
    assert [k.node_type for k in a.cache_keys] == [k.node_type for k in b.cache_keys]
    differing = [ka.node_type for ka, kb in zip(a.cache_keys, b.cache_keys) if ka != kb]
    assert differing == ["SumBackward1"]
    assert a.task_key == b.task_key
    assert normalize.graph_text(a.graph_module) != normalize.graph_text(b.graph_module)


def test_identical_graphs_give_identical_keys():
    """Same program, different tensor values: same keys, same graph text."""
    a, b = _capture_sum(1, seed=0), _capture_sum(1, seed=1)
    assert a.cache_keys == b.cache_keys
    assert a.task_key == b.task_key
    assert normalize.graph_text(a.graph_module) == normalize.graph_text(b.graph_module)


def test_graph_text_has_no_addresses_ids_or_paths():
    for name in scenarios.names():
        text = "\n".join(take(name).graph)
        assert not re.search(r"0x[0-9a-fA-F]{4,}", text), name
        assert " at 0x" not in text and "/" not in text.replace("//", ""), name
        assert "<" not in text, name  # no <object ...> or <function ...> reprs


def test_normalize_names_and_annotations():
    """Own naming (independent of FX's), dtype/shape/stride annotations,
    and one comment per run of ops of one autograd node."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, requires_grad=True)
    cap = cagrad.capture((x.t() * 2.0).sum())
    lines = normalize.graph_lines(cap.graph_module)
    assert lines[:5] == [f"placeholder {p}" for p in ("inputs", "sizes", "scalars", "hooks", "packed_inputs")]
    assert "%in0 : f32[] = inputs[0]" in lines
    assert "# SumBackward0 (NodeCall 0)" in lines
    assert any(re.fullmatch(r"%expand : f32\[3, 2\] stride=\(0, 0\) = aten\.expand\.default\(%in0, \[3, 2\]\)", line) for line in lines)
    assert lines[-1].startswith("return [")
    comments = [line for line in lines if line.startswith("# ")]
    assert len(comments) == len(set(comments))


def test_normalize_strips_addresses_from_opaque_targets_and_constants():
    class Opaque:
        pass

    def hook(*args):
        return args

    graph = torch.fx.Graph()
    inputs = graph.placeholder("inputs")
    first = graph.call_function(lambda s, i: s[i], (inputs, 0))
    call = graph.call_function(hook, (first, Opaque()))
    graph.output([call])
    text = normalize.graph_text(graph)  # a GraphModule could not even codegen this
    assert "0x?" in text
    assert not re.search(r"0x[0-9a-fA-F]{4,}", text)
    assert "# engine (no autograd_node)" in text


def test_a_snapshot_pins_which_hooks_share_a_fingerprint_not_its_python_bytes(monkeypatch):
    """A traced hook's fingerprint hashes its bytecode, which another Python
    version compiles to other bytes: the snapshot of a scenario with three
    traced hooks (three fingerprints) is the same when every fingerprint
    changes as it would on another Python, and still tells the three apart."""
    import hashlib

    from cagrad.hooks import hook_tracing

    name = "traced_hook_captured_values"
    here = render(take(name))
    original = hook_tracing.fingerprint

    def other_python(hook):
        fp = original(hook)
        return None if fp is None else hashlib.sha256(b"another bytecode" + fp).digest()[: len(fp)]

    monkeypatch.setattr(hook_tracing, "fingerprint", other_python)
    there = render(take(name))
    assert there == here
    shown = set(re.findall(r"fingerprint = '([^']*)'", here))
    assert len(shown) == 3, shown
