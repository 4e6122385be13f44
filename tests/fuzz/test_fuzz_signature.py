"""Root-cause signatures (fuzz/signature.py): one bug, one failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuzz.ir import Program
from fuzz.oracle import Oracle, failure_key
from fuzz.signature import MAX_CHARS, make_signature, message_template, root_cause, template

BROKEN = str(Path(__file__).with_name("broken_subject.py")) + ":BrokenMulSubject"


def _program(ops: list[dict], leaves: list[tuple[str, list[int]]], roots: list[str], mode: str = "backward") -> Program:
    doc = {
        "schema": 2,
        "name": "sig",
        "seed": 7,
        "leaves": [{"name": n, "shape": s, "dtype": "float32", "requires_grad": True} for n, s in leaves],
        "ops": ops,
        "roots": roots,
        "loss": "sum",
        "mode": mode,
        "inputs": [n for n, _ in leaves] if mode == "grad" else None,
        "retain_graph": None,
        "repeat": 1,
        "hooks": [],
    }
    return Program.from_json(json.dumps(doc))


def _signatures(program: Program) -> list[str]:
    verdict = Oracle(subjects=[], plugins=[BROKEN], devices=["cpu"]).run(program)
    assert verdict.report is not None
    out = []
    for o in verdict.report.failures():
        k = failure_key(o)
        out.append(make_signature(k.subject, k.device, k.status, k.kind, o.to_json()))
    return out


def test_a_planted_fault_hit_by_different_op_sets_is_one_signature() -> None:
    # BrokenMulSubject adds 1 to every gradient of a graph with a MulBackward0:
    # a binary mul under .backward() and a scalar mul after sin under
    # autograd.grad both hit it, in different op sets and entry points.
    a = _program(
        [{"name": "v0", "op": "mul", "inputs": ["x0", "x1"], "attrs": {}}],
        [("x0", [2, 3]), ("x1", [2, 3])],
        ["v0"],
    )
    b = _program(
        [
            {"name": "v0", "op": "sin", "inputs": ["x0"], "attrs": {}},
            {"name": "v1", "op": "mul_scalar", "inputs": ["v0"], "attrs": {"scalar": 2.0}},
        ],
        [("x0", [4])],
        ["v1"],
        mode="grad",
    )
    sig_a, sig_b = _signatures(a), _signatures(b)
    assert sig_a == sig_b == ["broken[mul]@cpu mismatch value: grad values differ"]
    # a program without MulBackward0 does not diverge at all
    assert _signatures(_program([{"name": "v0", "op": "sin", "inputs": ["x0"], "attrs": {}}], [("x0", [3])], ["v0"])) == []


DRAWS = str(Path(__file__).with_name("broken_subject.py")) + ":DrawsOnExp"


def test_a_planted_draw_is_one_state_signature_across_programs() -> None:
    # DrawsOnExp draws once from the global generator after a backward with
    # an ExpBackward0: the generator digests differ from program to program,
    # the signature does not
    a = _program([{"name": "v0", "op": "exp", "inputs": ["x0"], "attrs": {}}], [("x0", [2, 3])], ["v0"])
    b = _program(
        [
            {"name": "v0", "op": "sin", "inputs": ["x0"], "attrs": {}},
            {"name": "v1", "op": "exp", "inputs": ["v0"], "attrs": {}},
        ],
        [("x0", [4])],
        ["v1"],
        mode="grad",
    )
    sigs = []
    for prog in (a, b):
        verdict = Oracle(subjects=[], plugins=[DRAWS], devices=["cpu"]).run(prog)
        assert verdict.report is not None
        (o,) = verdict.report.failures()
        k = failure_key(o)
        assert k.kind == "state"
        sigs.append(make_signature(k.subject, k.device, k.status, k.kind, o.to_json()))
    assert sigs[0] == sigs[1] == "draws[exp]@cpu mismatch state: state cpu_rng left otherwise than eager's"


def test_a_state_mismatch_of_a_later_step_has_the_same_cause() -> None:
    first = {"status": "mismatch", "mismatches": [{"where": "state cpu_rng", "detail": "the backward left cpu_rng at 'ab'"}]}
    later = {"status": "mismatch", "mismatches": [{"where": "step 2/4: state cpu_rng", "detail": "... at 'cd'"}]}
    assert root_cause(first) == root_cause(later) == "state cpu_rng left otherwise than eager's"


def _error(type_: str, message: str, **extra) -> dict:
    return {"subject": "s", "device": "cpu", "status": "error", "mismatches": [],
            "error": {"type": type_, "message": message, "traceback": "Traceback ..."}, "eager_error": None, **extra}


def test_error_messages_are_templated() -> None:
    a = _error("RuntimeError", "shape '[2, 3]' is invalid for input of size 7")
    b = _error("RuntimeError", "shape '[5]' is invalid for input of size 12")
    assert root_cause(a) == root_cause(b) == "RuntimeError: shape '<shape>' is invalid for input of size <n>"
    c = _error("RuntimeError", "The size of tensor a (4) must match the size of tensor b (3) at non-singleton dimension 1")
    assert root_cause(c) == (
        "RuntimeError: The size of tensor a (<n>) must match the size of tensor b (<n>) at non-singleton dimension <n>"
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("got tensor([[1., 2.],\n        [3., 4.]], requires_grad=True) here", "got <tensor> here"),
        ("object at 0x7f3a2b4c5d60 freed", "object at <addr> freed"),
        ("expected torch.Size([3, 1]) got torch.Size([])", "expected <shape> got <shape>"),
        ("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)", "mat1 and mat2 shapes cannot be multiplied (<shape> and <shape>)"),
        ('File "/usr/lib/python3.11/x.py", line 12, in f', "File <path>, in f"),
        ("see /work/main/fuzz/hooks.py for x3 and getitem_11", "see <path> for <name> and getitem_<n>"),
        ("atol 1e-05 and rtol 1.3e-06, -2.5 nan", "atol <n> and rtol <n>, <n> <n>"),
        ("output 0 of MulBackward0 is float32 on cuda:1", "output <n> of MulBackward0 is float32 on cuda:<n>"),
    ],
)
def test_template_placeholders(text: str, expected: str) -> None:
    assert template(text) == expected


def test_message_template_keeps_the_first_paragraph_only() -> None:
    msg = (
        "queue_callback() is only supported when Compiled Autograd is enabled with fullgraph=True\n\n"
        "from user code:\n   File \"<eval_with_key>.205\", line 27, in forward\n"
    )
    assert message_template(msg) == (
        "queue_callback() is only supported when Compiled Autograd is enabled with fullgraph=True"
    )
    chained = "backend='aot_eager' raised:\nRuntimeError: bad size 3\n\nWhile executing %mul"
    assert message_template(chained) == "backend='aot_eager' raised: | RuntimeError: bad size <n>"


def test_dynamo_call_arguments_and_hints_are_dropped() -> None:
    def msg(a: str, b: str) -> str:
        return (
            "RuntimeError when making fake tensor call\n  Explanation: Dynamo failed to run FX node with fake tensors: "
            f"call_function <built-in function mul>(*(None, FakeTensor(..., size=({a}))), **{{}}): got TypeError('x')\n"
            f"  Hint: {b}\n\nfrom user code:\n  File \"<eval_with_key>.4\", line 9"
        )

    one, two = message_template(msg("1, 5", "use eager")), message_template(msg("s3, 2", "other hint"))
    assert one == two == (
        "RuntimeError when making fake tensor call | Explanation: Dynamo failed to run FX node with fake tensors: "
        "call_function <built-in function mul>(...): got TypeError('x')"
    )
    assert template("expected [s70, s36, 3] got [u0]") == "expected <shape> got <shape>"


def test_different_error_types_and_causes_differ() -> None:
    a = _error("RuntimeError", "boom 1")
    b = _error("TypeError", "boom 2")
    assert root_cause(a) != root_cause(b)
    both = _error("RuntimeError", "boom", eager_error={"type": "ValueError", "message": "x", "traceback": ""})
    assert root_cause(both) == "RuntimeError: boom (eager raised ValueError)"
    assert make_signature("s", "cpu", "error", "RuntimeError", a) == "s@cpu error RuntimeError: RuntimeError: boom <n>"


def test_long_messages_are_cut() -> None:
    long = _error("RuntimeError", "word " * 200)
    cause = root_cause(long)
    assert len(cause) == MAX_CHARS and cause.endswith("...")


def _mismatch(*mismatches: dict, **extra) -> dict:
    return {"subject": "s", "device": "cpu", "status": "mismatch", "mismatches": list(mismatches), "error": None,
            "eager_error": None, **extra}


def _m(where: str, detail: str, max_abs: float | None = None) -> dict:
    return {"where": where, "detail": detail, "max_abs": max_abs, "max_rel": None, "rtol": None, "atol": None}


def test_mismatches_group_by_what_differs() -> None:
    leaf = _mismatch(_m("leaf 3 .grad", "Tensor-likes are not close!", 1.0))
    result = _mismatch(_m("grad result 0", "Tensor-likes are not close!", 0.25))
    assert root_cause(leaf) == root_cause(result) == "grad values differ"
    meta_a = _mismatch(_m("leaf 0 .grad", "shape differs: eager torch.Size([2, 3]), subject torch.Size([3])"))
    meta_b = _mismatch(_m("leaf 4 .grad", "shape differs: eager torch.Size([5]), subject torch.Size([1, 5])"))
    assert root_cause(meta_a) == root_cause(meta_b) == "grad: shape differs: eager <shape>, subject <shape>"
    none = _mismatch(_m("grad result 1", "eager has None, subject has tensor(shape=(2,), dtype=torch.float32, device=cpu)"))
    assert root_cause(none) == "grad: eager has None, subject has <tensor>"
    assert len({root_cause(leaf), root_cause(meta_a), root_cause(none)}) == 3


def test_hook_order_mismatches_are_one_cause() -> None:
    # recorded from torch_ca[eager] on torch 2.13 (two programs, other hooks)
    a = _mismatch(_m("trace[0][0]", "eager has 'h3 post v2', subject has 'h1 pre v0'"),
                  _m("trace[0][1]", "length differs: eager 2, subject 1"))
    b = _mismatch(_m("trace[0][0]", "eager has 'h2 pre v1', subject has 'h0 tensor v0'"))
    c = _mismatch(_m("trace[1][0]", "eager has 'h0 tensor v3', subject has 'h1s tensor v2:1'"))
    assert root_cause(a) == root_cause(b) == root_cause(c) == "trace: hook events in another order"
    values = _mismatch(_m("trace[2][1]", "Tensor-likes are not close!", 3.0))
    assert root_cause(values) == "trace values differ"
    length = _mismatch(_m("trace length", "eager recorded 4 events, subject 3"))
    assert root_cause(length) == "trace length: eager recorded <n> events, subject <n>"


def test_a_named_first_node_wins() -> None:
    a = _mismatch(_m("leaf 0 .grad", "Tensor-likes are not close!", 1.0), first_node="MulBackward0")
    b = _mismatch({**_m("trace[1]", "x"), "first_node": {"type": "MulBackward0", "index": 4}})
    assert root_cause(a) == root_cause(b) == "first differing node MulBackward0"


def test_crash_and_timeout() -> None:
    assert root_cause({"status": "crash", "signal": "SIGABRT", "detail": "core dumped at 0x1"}) == "SIGABRT"
    assert root_cause({"status": "crash", "signal": 11, "detail": ""}) == "SIGSEGV"
    assert root_cause({"status": "crash", "signal": -6}) == "SIGABRT"
    assert root_cause({"status": "timeout", "seconds": 30.0}) == "timeout"
    assert make_signature("torch_ca[eager]", "cuda", "crash", "crash", {"status": "crash", "signal": "SIGSEGV"}) == (
        "torch_ca[eager]@cuda crash crash: SIGSEGV"
    )
    with pytest.raises(TypeError, match="outcome dict"):
        root_cause("error")  # type: ignore[arg-type]
