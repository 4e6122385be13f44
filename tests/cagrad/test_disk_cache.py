"""Warm start across processes: ``cagrad.enable(..., cache_dir=...)``.

A second process (or a second session after ``cagrad.reset()``) finds its
captured graph on disk and rebuilds it instead of tracing; gradients stay
eager's. Files that are not cagrad's own, or not for this key, raise
``cagrad.CacheFileError``; graphs that depend on process-local objects are
not stored.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import cagrad
from cagrad.compile import disk_cache, graph_serde

from .conftest import same

CHILD_TIMEOUT_S = 120

# one backward of a small model in a fresh interpreter; prints the counters
# and whether the gradients are eager's (bitwise: eager/aot_eager backends)
_CHILD = textwrap.dedent(
    """
    import json, sys, torch, cagrad
    backend, cache_dir, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    x = torch.randn(batch, 8)
    loss = model(x).log_softmax(-1).mean()
    expected = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    with cagrad.enable(backend, cache_dir=cache_dir):
        loss.backward()
    equal = all(torch.equal(e, p.grad) for e, p in zip(expected, model.parameters()))
    print(json.dumps({"equal": equal, "counters": cagrad.counters.snapshot()}))
    """
)


def _spawn(backend: str, cache_dir: pathlib.Path, batch: int = 5) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != disk_cache.ENV_VAR}
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, backend, str(cache_dir), str(batch)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def _files(cache_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(cache_dir.glob("*" + disk_cache.SUFFIX))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 2))


def _grads(model, batch: int, backend: str | None = None, **kw) -> list[torch.Tensor]:
    """One backward of ``model`` on a batch (eager with ``backend=None``)."""
    torch.manual_seed(batch)
    x = torch.randn(batch, 6)
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    if backend is None:
        loss.backward()
    else:
        with cagrad.enable(backend, **kw):
            loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _new_session() -> None:
    """What a new process starts with: no in-memory graphs, zero counters."""
    cagrad.reset()


# -- across processes -------------------------------------------------------------


def test_a_second_process_loads_the_graph_instead_of_tracing(tmp_path):
    first = _result(_spawn("aot_eager", tmp_path))
    assert first["equal"]
    assert first["counters"]["disk_stores"] == 1 and first["counters"]["disk_hits"] == 0
    assert len(_files(tmp_path)) == 1
    # the same batch size: the static graph is loaded
    again = _result(_spawn("aot_eager", tmp_path))
    assert again["equal"]
    c = again["counters"]
    assert c["disk_hits"] == 1 and c["captures"] == 1 and c["disk_stores"] == 0 and c["fallbacks"] == 0
    # another batch size: the stored static graph rejects it, so the sizes
    # change across runs: the graph is traced symbolic at once, and replaces it
    second = _result(_spawn("aot_eager", tmp_path, batch=7))
    assert second["equal"]
    c = second["counters"]
    assert c["disk_hits"] == 0 and c["captures"] == 1 and c["disk_stores"] == 1 and c["fallbacks"] == 0
    # a third size: the symbolic graph's size check accepts it
    third = _result(_spawn("aot_eager", tmp_path, batch=9))
    assert third["equal"]
    c = third["counters"]
    assert c["disk_hits"] == 1 and c["captures"] == 1 and c["disk_stores"] == 0 and c["fallbacks"] == 0
    assert len(_files(tmp_path)) == 1


def test_concurrent_writers_of_one_key_leave_a_valid_file(tmp_path):
    procs = [_spawn("eager", tmp_path) for _ in range(2)]
    results = [_result(p) for p in procs]
    assert all(r["equal"] for r in results)
    assert sum(r["counters"]["disk_stores"] + r["counters"]["disk_hits"] for r in results) == 2
    (path,) = _files(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    # the file that won is whole, and loads in this process too
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    loss = model(torch.randn(5, 8)).log_softmax(-1).mean()
    expected = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    with cagrad.enable("eager", cache_dir=tmp_path):
        loss.backward()
    assert cagrad.counters["disk_hits"] == 1
    for e, p in zip(expected, model.parameters()):
        same(e, p.grad)
    assert _files(tmp_path) == [path]


# -- in one process, after a reset (what a new process starts with) ---------------


@pytest.mark.parametrize(
    "backend, dynamic, first_sizes",
    [
        ("eager", True, (4,)),
        ("aot_eager", True, (4,)),
        # the default stores the static graph at 4, then the symbolic one over it
        ("eager", None, (4, 9)),
    ],
)
def test_a_loaded_graph_gives_eager_gradients_at_other_sizes(tmp_path, backend, dynamic, first_sizes):
    model = _model()
    expected = [_grads(model, n) for n in (4, 9)]
    for n in first_sizes:
        _grads(model, n, backend, dynamic=dynamic, cache_dir=tmp_path)
    assert cagrad.counters["disk_stores"] == len(first_sizes)
    assert len(_files(tmp_path)) == 1
    _new_session()
    actual = [_grads(model, n, backend, dynamic=dynamic, cache_dir=tmp_path) for n in (4, 9)]
    assert cagrad.counters["disk_hits"] == 1
    assert cagrad.counters["captures"] == 1 and cagrad.counters["cache_hits"] == 1
    for e, a in zip(expected, actual):
        for x, y in zip(e, a):
            same(x, y)


def test_a_static_graph_is_not_used_for_other_sizes(tmp_path):
    model = _model()
    expected = _grads(model, 7)
    _grads(model, 4, "eager", dynamic=False, cache_dir=tmp_path)
    _new_session()
    actual = _grads(model, 7, "eager", dynamic=False, cache_dir=tmp_path)
    c = cagrad.counters
    assert c["disk_hits"] == 0 and c["captures"] == 1 and c["disk_stores"] == 1
    for x, y in zip(expected, actual):
        same(x, y)
    _new_session()
    _grads(model, 7, "eager", dynamic=False, cache_dir=tmp_path)  # the file now holds batch 7
    assert cagrad.counters["disk_hits"] == 1


def test_the_key_covers_the_backend_and_the_dynamic_flag(tmp_path):
    model = _model()
    _grads(model, 4, "eager", cache_dir=tmp_path)
    _new_session()
    _grads(model, 4, "aot_eager", cache_dir=tmp_path)
    _grads(model, 4, "eager", dynamic=False, cache_dir=tmp_path)
    assert cagrad.counters["disk_hits"] == 0
    assert len(_files(tmp_path)) == 3


def test_double_backward_graph_round_trips(tmp_path):
    def penalty(backend=None):
        torch.manual_seed(0)
        w = torch.randn(5, 5, requires_grad=True)
        x = torch.randn(3, 5, requires_grad=True)
        y = torch.tanh(x @ w).sum()
        if backend is None:
            (g,) = torch.autograd.grad(y, x, create_graph=True)
            g.square().sum().backward()
        else:
            with cagrad.enable(backend, cache_dir=tmp_path):
                (g,) = torch.autograd.grad(y, x, create_graph=True)
                g.square().sum().backward()
        return w.grad, x.grad

    expected = penalty()
    penalty("aot_eager")
    stored = cagrad.counters["disk_stores"]
    assert stored >= 1
    _new_session()
    actual = penalty("aot_eager")
    assert cagrad.counters["disk_hits"] == stored
    for x, y in zip(expected, actual):
        torch.testing.assert_close(x, y)


def test_the_environment_variable_names_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.ENV_VAR, str(tmp_path))
    model = _model()
    _grads(model, 4, "eager")
    assert len(_files(tmp_path)) == 1
    _new_session()
    _grads(model, 4, "eager", cache_dir=False)  # False: no disk cache
    assert cagrad.counters["disk_hits"] == 0
    _new_session()
    _grads(model, 4, "eager")
    assert cagrad.counters["disk_hits"] == 1


# -- what is not stored ------------------------------------------------------------


def test_a_graph_with_a_python_hook_is_not_stored(tmp_path):
    model = _model()
    handle = model[0].weight.register_hook(lambda g: g * 2)
    try:
        expected = _grads(model, 4)
        actual = _grads(model, 4, "eager", cache_dir=tmp_path)
    finally:
        handle.remove()
    for x, y in zip(expected, actual):
        same(x, y)
    assert cagrad.counters["disk_skips"] == 1 and cagrad.counters["disk_stores"] == 0
    assert _files(tmp_path) == []


def test_a_callable_compiler_or_a_custom_function_is_not_stored(tmp_path):
    model = _model()
    _grads(model, 4, lambda gm: gm, cache_dir=tmp_path)

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.randn(3, requires_grad=True)
    with cagrad.enable("eager", cache_dir=tmp_path):
        Double.apply(x).sin().sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(2 * x.detach()))
    assert cagrad.counters["disk_skips"] == 2 and cagrad.counters["disk_stores"] == 0
    assert _files(tmp_path) == []


def test_a_graph_under_saved_tensor_hooks_is_not_stored(tmp_path):
    model = _model()
    torch.manual_seed(4)
    x = torch.randn(4, 6)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        loss = model(x).square().mean()
    expected = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    with cagrad.enable("eager", cache_dir=tmp_path):
        loss.backward()
    for e, p in zip(expected, model.parameters()):
        same(e, p.grad)
    assert cagrad.counters["disk_stores"] == 0 and _files(tmp_path) == []


def test_inductor_reuses_its_own_cache_for_a_loaded_graph(tmp_path):
    import torch._inductor.config
    from torch._dynamo.utils import counters as torch_counters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())

    def grads(backend=None):
        torch.manual_seed(1)
        x = torch.randn(5, 4)
        model.zero_grad(set_to_none=True)
        loss = model(x).sum()
        if backend is None:
            loss.backward()
        else:
            with cagrad.enable(backend, cache_dir=tmp_path):
                loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = grads()
    grads("inductor")
    assert cagrad.counters["disk_stores"] == 1
    _new_session()

    def backend_cache_hits():
        return torch_counters["aot_autograd"]["autograd_cache_hit"] + torch_counters["inductor"]["fxgraph_cache_hit"]

    hits = backend_cache_hits()
    actual = grads("inductor")
    assert cagrad.counters["disk_hits"] == 1
    if torch._inductor.config.fx_graph_cache:  # the same graph and fakes: the same cache key
        assert backend_cache_hits() > hits
    for x, y in zip(expected, actual):
        torch.testing.assert_close(x, y)


# -- files that are not usable -----------------------------------------------------


def _stored_file(tmp_path) -> pathlib.Path:
    _grads(_model(), 4, "eager", cache_dir=tmp_path)
    (path,) = _files(tmp_path)
    _new_session()
    return path


def _load_fails(tmp_path, match: str) -> None:
    model = _model()
    with pytest.raises(cagrad.CacheFileError, match=match) as info:
        _grads(model, 4, "eager", cache_dir=tmp_path)
    assert str(_files(tmp_path)[0]) in str(info.value)
    # nothing ran, nothing was counted as a hit; after deleting it, it works
    assert cagrad.counters["disk_hits"] == 0
    for path in _files(tmp_path):
        path.unlink()
    _new_session()
    expected = _grads(model, 4)
    for x, y in zip(expected, _grads(model, 4, "eager", cache_dir=tmp_path)):
        same(x, y)
    assert cagrad.counters["disk_stores"] == 1


def _rewrite_header(path: pathlib.Path, **fields) -> None:
    raw = path.read_bytes()
    end = raw.index(b"\n", len(disk_cache.MAGIC))
    header = json.loads(raw[len(disk_cache.MAGIC) : end])
    header.update(fields)
    path.write_bytes(disk_cache.MAGIC + json.dumps(header).encode() + raw[end:])


def test_a_file_of_another_torch_version_raises(tmp_path):
    path = _stored_file(tmp_path)
    _rewrite_header(path, torch="1.13.0")
    _load_fails(tmp_path, "written for torch '1.13.0'")


def test_a_truncated_file_raises(tmp_path):
    path = _stored_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])
    _load_fails(tmp_path, "truncated")


def test_a_corrupt_file_raises(tmp_path):
    path = _stored_file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-50] ^= 0x01
    path.write_bytes(bytes(raw))
    _load_fails(tmp_path, "checksum")


def test_a_foreign_file_raises(tmp_path):
    path = _stored_file(tmp_path)
    path.write_bytes(b"\x80\x04\x95 not ours at all")
    _load_fails(tmp_path, "not a cagrad graph cache file")


def test_a_file_holding_another_key_raises(tmp_path):
    path = _stored_file(tmp_path)
    # another backward's file (batch of another rank) copied over this one
    other = tmp_path / "other"
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    with cagrad.enable("eager", cache_dir=other):
        x.exp().sum().backward()
    (theirs,) = _files(other)
    raw = theirs.read_bytes()
    theirs.unlink()
    other.rmdir()
    path.write_bytes(raw)
    _load_fails(tmp_path, "another key")
    # the header made to agree with the name: the key stored in it still differs
    _new_session()
    path = _stored_file(tmp_path)
    key_sha = path.name.removesuffix(disk_cache.SUFFIX)
    path.write_bytes(raw)
    _rewrite_header(path, key_sha256=key_sha)
    _load_fails(tmp_path, "not the key it was looked up for")


# -- the plain-data encoding never runs what a file names ------------------------


def test_a_record_names_only_known_targets_and_heads():
    with pytest.raises(ValueError, match="not one cagrad stores"):
        graph_serde.graph_from_data([["call_function", "x", ["op", "os::system", "default"], ["t", []], {}]])
    with pytest.raises(ValueError, match="malformed target"):
        graph_serde.graph_from_data([["call_function", "x", ["fn", "os.system"], ["t", []], {}]])
    with pytest.raises(ValueError, match="unknown expression head"):
        graph_serde.expr_from_data(["builtins.eval", ["sym", "s0"]], {})
    with pytest.raises(ValueError, match="unknown symbol"):
        graph_serde.expr_from_data(["sym", "s0"], {})
    gm = torch.fx.symbolic_trace(lambda x: x.relu())  # a call_method node
    with pytest.raises(graph_serde.NotSerializable):
        graph_serde.graph_to_data(gm)


def test_a_record_is_checked_by_rebuilding_it_before_it_is_written():
    from cagrad.keys import collection
    from cagrad.compile import variants
    from cagrad.keys.cache import CacheNode

    torch.manual_seed(0)
    loss = _model()(torch.randn(4, 6)).square().mean()
    collected = collection.collect_backward([loss], [torch.ones_like(loss)], [], True)
    slots = frozenset(i for i, ok in enumerate(collected.collector.sizes.dynamic_ok) if ok)
    traced = variants.trace_with_retries(collected, CacheNode(), slots, count=False)
    data = disk_cache.traced_to_data(traced)
    assert data["symbols"] and data["check"]["bound"]  # a dynamic graph
    assert disk_cache._round_trip_problem(json.dumps(data), traced, collected) is None
    # a record that would rebuild another graph than the traced one
    node = next(n for n in data["graph"] if '"f"' in json.dumps(n[3]))
    node[3] = json.loads(json.dumps(node[3]).replace('"f", "', '"f", "-', 1))
    assert disk_cache._round_trip_problem(json.dumps(data), traced, collected) == "rebuild_code_differs"


def test_a_graph_that_sets_a_retained_grad_is_not_stored(tmp_path):
    """A traced ``retain_grad`` is set from a graph output after the graph
    (``Traced.retain_outputs``), which a record does not hold: a graph loaded
    from one would leave the retained ``.grad`` unset."""

    def run(cache_dir=None):
        torch.manual_seed(0)
        w = torch.randn(3, 4, requires_grad=True)
        h = (w * 2).sin()
        h.retain_grad()
        loss = h.square().sum()
        if cache_dir is None:
            loss.backward()
        else:
            with cagrad.enable("eager", cache_dir=cache_dir):
                loss.backward()
        return w.grad, h.grad

    expected = run()
    for _ in range(2):
        _new_session()
        actual = run(tmp_path)
        for x, y in zip(expected, actual):
            same(x, y)
    assert cagrad.counters["disk_stores"] == 0 and cagrad.counters["disk_hits"] == 0
    assert cagrad.counters["disk_skips"] == 1 and cagrad.counters["captures"] == 1
    assert _files(tmp_path) == []
