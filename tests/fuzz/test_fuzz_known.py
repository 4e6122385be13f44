"""Known-issues files (fuzz/known.py) and the shipped fuzz/known_issues.toml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuzz.known import KnownIssue, KnownIssues, KnownIssuesError
from fuzz.signature import make_signature

GOOD = """\
schema = 1

[[issue]]
id = "ca-order"
pattern = "torch_ca[eager]@* mismatch trace: *"
subjects = ["torch_ca*"]
torch = ">=2.11,<2.14"
note = "hook order"
link = "https://example.org/1"

[[issue]]
id = "any-timeout"
pattern = "*@* timeout timeout: timeout"
note = "slow"
"""


def _write(tmp_path: Path, text: str, name: str = "known.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_good_file_loads_and_matches(tmp_path: Path) -> None:
    known = KnownIssues.load(_write(tmp_path, GOOD))
    assert [i.id for i in known] == ["ca-order", "any-timeout"]
    first = known.issues[0]
    assert first.subjects == ("torch_ca*",) and first.torch == ">=2.11,<2.14" and first.link == "https://example.org/1"
    assert known.issues[1].subjects == () and known.issues[1].torch is None and known.issues[1].link == ""
    sig = "torch_ca[eager]@cpu mismatch trace: trace: hook events in another order"
    assert known.match(sig, "2.13.0+cpu") is first
    assert known.match("cagrad[eager]@cpu timeout timeout: timeout", "2.13.0") is known.issues[1]
    assert known.match("cagrad[eager]@cpu mismatch trace: trace values differ", "2.13.0") is None


def test_matching_by_torch_version(tmp_path: Path) -> None:
    known = KnownIssues.load(_write(tmp_path, GOOD))
    sig = "torch_ca[eager]@cuda mismatch trace: x"
    assert known.match(sig, "2.11.0") is not None
    assert known.match(sig, "2.13.0a0+git1234abc") is not None  # pre-release and local builds count
    assert known.match(sig, "2.10.1") is None
    assert known.match(sig, "2.14.0") is None
    with pytest.raises(ValueError, match="not a PEP 440 version"):
        known.match(sig, "banana")


def test_matching_by_subject() -> None:
    issue = KnownIssue(id="x", pattern="*mismatch value: *", subjects=("torch_ca*", "broken[mul]"), note="n")
    known = KnownIssues([issue])
    assert known.match("torch_ca[aot_eager]@cpu mismatch value: grad values differ", "2.13.0") is issue
    # brackets are literal, not a character class
    assert known.match("broken[mul]@cpu mismatch value: grad values differ", "2.13.0") is issue
    assert known.match("brokenm@cpu mismatch value: grad values differ", "2.13.0") is None
    assert known.match("cagrad[eager]@cpu mismatch value: grad values differ", "2.13.0") is None


def test_an_entry_with_ops_matches_only_programs_that_use_every_one() -> None:
    # a backend's kernel bug: narrowed to the op whose backward hits it, so a
    # value mismatch of the same subject in another program stays a failure
    issue = KnownIssue(id="k", pattern="*@cuda mismatch value: *", subjects=("cagrad[inductor*",),
                       ops=("index_select", "sum*"), note="n")  # fmt: skip
    known = KnownIssues([issue])
    sig = "cagrad[inductor]@cuda mismatch value: step <n>/<n>: leaf <n> .grad values differ"
    assert known.match(sig, "2.11.0", ["mul", "index_select", "sum_dim"]) is issue
    assert known.match(sig, "2.11.0", ["mul", "sum_dim"]) is None  # one glob matches no op
    assert known.match(sig, "2.11.0", []) is None
    assert known.match(sig, "2.11.0") is None  # the program is not known: no match
    # an entry without ops matches whatever the program
    plain = KnownIssues([KnownIssue(id="p", pattern="*", note="n")])
    assert plain.match(sig, "2.11.0") is not None and plain.match(sig, "2.11.0", ["mul"]) is not None
    assert issue.to_json()["ops"] == ["index_select", "sum*"]


def test_json_files_load_too(tmp_path: Path) -> None:
    doc = {"issue": [{"id": "a", "pattern": "x*", "note": "n", "torch": "==2.13.*"}]}
    known = KnownIssues.load(_write(tmp_path, json.dumps(doc), "known.json"))
    assert known.match("xyz@cpu", "2.13.0") is known.issues[0]
    with pytest.raises(KnownIssuesError, match=r"bad\.json:1: not valid JSON: Expecting property name"):
        KnownIssues.load(_write(tmp_path, "{", "bad.json"))


@pytest.mark.parametrize(
    "text, message",
    [
        # unknown key, pointing at its line
        (GOOD.replace('note = "slow"', 'note = "slow"\nsubject = ["x"]'),
         r"known\.toml:15: issue 2: unknown key\(s\) \['subject'\]; expected \['id', 'pattern', 'note'\]"),
        # missing pattern, pointing at the entry's header
        (GOOD.replace('pattern = "*@* timeout timeout: timeout"\n', ""),
         r"known\.toml:11: issue 2: missing required key 'pattern'"),
        # a bad specifier
        (GOOD.replace(">=2.11,<2.14", "2.13 or later"),
         r"known\.toml:7: issue 1: 'torch' = '2\.13 or later' is not a PEP 440 version specifier; expected e\.g\."),
        # wrong types
        (GOOD.replace('subjects = ["torch_ca*"]', 'subjects = "torch_ca*"'),
         r"known\.toml:6: issue 1: 'subjects' must be a list of glob strings"),
        (GOOD.replace('id = "any-timeout"', "id = 3"), r"known\.toml:12: issue 2: 'id' must be a non-empty string, got 3"),
        (GOOD.replace('note = "slow"', 'note = "slow"\nops = "mul"'),
         r"known\.toml:15: issue 2: 'ops' must be a list of glob strings over op names"),
        # duplicate ids
        (GOOD.replace('"any-timeout"', '"ca-order"'),
         r"known\.toml:12: issue 2: id 'ca-order' is already used by issue 1"),
        # unknown top-level key, schema
        ("issues = []\n", r"known\.toml:1: unknown top-level key\(s\) \['issues'\]; expected \['schema', 'issue'\]"),
        ("schema = 2\n", r"known\.toml:1: schema 2 is not supported; expected 1"),
        ("issue = 3\n", r"'issue' must be a list of tables"),
        # not TOML at all
        ("[[issue]\nid = 1", r"known\.toml: not valid TOML: .*line 1"),
    ],
)
def test_bad_files_name_the_file_line_and_what_was_expected(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(KnownIssuesError, match=message):
        KnownIssues.load(_write(tmp_path, text))


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KnownIssuesError, match=r"nope\.toml: cannot read known-issues file"):
        KnownIssues.load(tmp_path / "nope.toml")


# Outcomes recorded from `python -m fuzz campaign --subjects 'torch_ca[eager]'`
# on torch 2.13.0 (CPU), seeds 1, 2 and 5 (first_outcome of report.json,
# tracebacks cut).
TORCH_CA_213 = {
    "torch-ca-queue-callback": ("error", "AssertionError", {
        "status": "error", "mismatches": [], "eager_error": None,
        "error": {"type": "AssertionError", "traceback": "...", "message": (
            "queue_callback() is only supported when Compiled Autograd is enabled with fullgraph=True\n\n"
            "from user code:\n   File \"<eval_with_key>.72\", line 27, in forward\n    call_hook = "
            "torch__dynamo_external_utils_call_hook(getitem_11, getitem_1, hook_type = 'post_acc_grad_hook')\n")}}),
    "torch-ca-post-hook-drop": ("error", "TypeError", {
        "status": "error", "mismatches": [], "eager_error": None,
        "error": {"type": "TypeError", "traceback": "...",
                  "message": "add(): argument 'input' (position 1) must be Tensor, not NoneType"}}),
    "torch-ca-post-hook-drop-function": ("error", "torch._dynamo.exc.TorchRuntimeError", {
        "status": "error", "mismatches": [], "eager_error": None,
        "error": {"type": "torch._dynamo.exc.TorchRuntimeError", "traceback": "...", "message": (
            "RuntimeError when making fake tensor call\n  Explanation: Dynamo failed to run FX node with fake "
            "tensors: call_function <built-in function mul>(*(None, FakeTensor(..., size=(1, 5, 3, 2))), **{}): "
            "got TypeError(\"unsupported operand type(s) for *: 'NoneType' and 'FakeTensor'\")\n  Hint: Your code "
            "may result in an error when running in eager.\n\nfrom user code:\n   File \"<eval_with_key>.432\"")}}),
    # torch 2.11 (H100, seed 47) and 2.13 (CPU, its reproducer)
    "torch-ca-post-hook-drop-function-arithmetic": ("error", "TypeError", {
        "status": "error", "mismatches": [], "eager_error": None,
        "error": {"type": "TypeError", "traceback": "...",
                  "message": "unsupported operand type(s) for *: 'int' and 'NoneType'"}}),
    "torch-ca-dynamic-split-validate-outputs": ("error", "torch._dynamo.exc.TorchRuntimeError", {
        "status": "error", "mismatches": [], "eager_error": None,
        "error": {"type": "torch._dynamo.exc.TorchRuntimeError", "traceback": "...", "message": (
            "RuntimeError when making fake tensor call\n  Explanation: Dynamo failed to run FX node with fake "
            "tensors: call_function torch._dynamo.compiled_autograd.ops.validate_outputs(*([FakeTensor(..., "
            "size=(s57, s40, 3))], [((None, None, device(type='cpu'), 6, 0, None), [s70, s36, s13], False, 6)]), "
            "**{}): got RuntimeError('[Compiled Autograd Tracing:]invalid gradient at index 0 - got [s57, s40, 3] "
            "but expected shape compatible with [s70, s36, s13]')\n  Hint: Your code may result in an error when "
            "running in eager.\n\n  Developer debug context: \n\nfrom user code:\n")}}),
    "torch-ca-segfault-post-hook-drop": ("crash", "crash", {
        "status": "crash", "signal": "SIGSEGV", "detail": "worker exit code -11"}),
    "torch-ca-retain-grad-autograd-grad": ("mismatch", "meta", {
        "status": "mismatch", "error": None, "eager_error": None, "mismatches": [
            {"where": "leaf 1 .grad", "detail": "eager has tensor(shape=(1, 1), dtype=torch.float32, device=cpu), "
             "subject has None", "max_abs": None, "max_rel": None, "rtol": None, "atol": None}]}),
    "torch-ca-hook-on-unused-function-output": ("error", "AttributeError", {
        "status": "error", "mismatches": [], "eager_error": None,
        "error": {"type": "AttributeError", "traceback": "...", "message": "'NoneType' object has no attribute 'op'"}}),
    "torch-ca-hook-order": ("mismatch", "trace", {
        "status": "mismatch", "error": None, "eager_error": None, "mismatches": [
            {"where": "trace[0][0]", "detail": "eager has 'h3 post v2', subject has 'h1 pre v0'",
             "max_abs": None, "max_rel": None, "rtol": None, "atol": None},
            {"where": "trace[0][1]", "detail": "length differs: eager 2, subject 1",
             "max_abs": None, "max_rel": None, "rtol": None, "atol": None}]}),
    "torch-ca-grad-values": ("mismatch", "value", {
        "status": "mismatch", "error": None, "eager_error": None, "mismatches": [
            {"where": "grad result 1", "detail": "Tensor-likes are not close!",
             "max_abs": 1.0, "max_rel": 1.0, "rtol": 1.3e-06, "atol": 1e-05}]}),
}


def test_the_shipped_file_matches_torch_ca_divergences_on_213() -> None:
    known = KnownIssues.default()
    assert {i.id for i in known} >= set(TORCH_CA_213)
    for issue_id, (status, kind, outcome) in TORCH_CA_213.items():
        for device in ("cpu", "cuda"):
            sig = make_signature("torch_ca[eager]", device, status, kind, {"subject": "torch_ca[eager]", **outcome})
            hit = known.match(sig, "2.13.0+cpu")
            assert hit is not None and hit.id == issue_id, sig
            assert hit.note
            # the same divergence of another subject is not known
            assert known.match(sig.replace("torch_ca[eager]", "cagrad[eager]", 1), "2.13.0") is None
            # nor on a torch version the entry does not name
            assert known.match(sig, "2.10.0") is None
    # a new divergence of torch_ca is not known
    assert known.match("torch_ca[eager]@cpu error RuntimeError: RuntimeError: something new", "2.13.0") is None


def _mismatch(where: str, detail: str) -> dict:
    return {"status": "mismatch", "error": None, "eager_error": None, "mismatches": [
        {"where": where, "detail": detail, "max_abs": None, "max_rel": None, "rtol": None, "atol": None}]}  # fmt: skip


# Outcomes of the H100 campaign --seed 41 (torch 2.11.0+cu130,
# CAGRAD_FUZZ_STRIDES=1): (subject, kind, outcome, the program's ops, the
# subjects the entry covers). cagrad falls back where inductor adds wrongly,
# so a cagrad subject with that value mismatch is a new failure.
SHIPPED_211 = {
    "inductor-cuda-index-add-one-element-unmasked-atomic": (
        "cagrad[inductor,reduce-overhead]", "value",
        _mismatch("step 1/4: leaf 0 .grad", "Tensor-likes are not close!"), ["index_select"],
        ["torch_ca[inductor]", "torch_ca[inductor,reduce-overhead]"]),
    "inductor-log-softmax-backward-meta-strides": (
        "cagrad[inductor]", "meta",
        _mismatch("grad result 0", "strides differ: eager (45, 9, 3, 1), subject (1, 6, 2, 30) "
                  "(size variant x2[2, 5, 3, 3] c0[2, 5, 3, 3])"), ["log_softmax", "permute"],
        ["cagrad[inductor]", "cagrad[inductor,reduce-overhead]", "torch_ca[inductor]",
         "torch_ca[inductor,reduce-overhead]"]),
    # seen under cagrad[aot_eager] too, before cagrad ran ProdBackward itself
    # for a non-contiguous saved input: a cagrad subject is a new failure now
    "traced-prod-backward-zero-safe-path-strides": (
        "torch_ca[eager]", "cache",
        _mismatch("cache", "neighbour 1 (ops[0].attrs.dim1: 3 -> 1) ran after the program and gave a wrong "
                  "result (grad result 0: strides differ: eager (16, 1, 4), subject (4, 8, 1)); in a fresh "
                  "cache it agrees with eager"), ["diagonal", "exp", "prod", "permute"],
        ["torch_ca[eager]", "torch_ca[inductor]", "torch_ca[inductor,reduce-overhead]"]),
}  # fmt: skip


@pytest.mark.parametrize("issue_id", sorted(SHIPPED_211))
def test_the_shipped_entries_for_backends_and_formulas_match_only_their_ops_and_subjects(issue_id: str) -> None:
    known = KnownIssues.default()
    subject, kind, outcome, ops, covered = SHIPPED_211[issue_id]
    sig = make_signature(subject, "cuda", "mismatch", kind, {"subject": subject, **outcome})
    for other in ("cagrad[inductor]", "cagrad[inductor,reduce-overhead]", "torch_ca[inductor]",
                  "torch_ca[inductor,reduce-overhead]", "cagrad[aot_eager]", "torch_ca[eager]"):  # fmt: skip
        hit = known.match(sig.replace(subject, other, 1), "2.11.0+cu130", ops)
        assert (hit.id if hit else None) == (issue_id if other in covered else None), other
    # the same divergence in a program without the op is a new failure
    sig = sig.replace(subject, covered[0], 1)
    issue = known.match(sig, "2.11.0+cu130", ops)
    assert known.match(sig, "2.11.0+cu130", [op for op in ops if op not in issue.ops]) is None
    assert known.match(sig, "2.11.0+cu130") is None


# The torch_ca errors of the H200 campaign --seed 1 (torch 2.11.0+cu130,
# 703 programs; cagrad had none): (signature as the campaign wrote it, the
# shrunk program's ops)
SEEN_211 = {
    "torch-ca-stateful-symbolic-context": (
        "torch_ca[eager]@cpu error AssertionError: AssertionError: Expected SubclassSymbolicContext or None, got "
        "<class 'torch.fx.experimental.symbolic_shapes.StatefulSymbolicContext'>", ["minimum"]),
    "torch-ca-duplicate-tensors-guard": (
        "torch_ca[eager]@cpu error AssertionError: AssertionError: Guard failed on the same frame it was created. "
        "This is a bug - please create an issue.Guard fail reason: !<n>/<n>/<n>: Duplicate tensors found:",
        ["fn_exp_saved_out"]),
}  # fmt: skip


@pytest.mark.parametrize("issue_id", sorted(SEEN_211))
def test_the_211_torch_ca_errors_match_only_torch_ca_on_211_with_their_op(issue_id: str) -> None:
    known = KnownIssues.default()
    sig, ops = SEEN_211[issue_id]
    assert known.match(sig, "2.11.0+cu130", ops).id == issue_id
    if issue_id == "torch-ca-stateful-symbolic-context":  # seen on 2.13.0 too (campaign seed 43, maximum)
        assert known.match(sig, "2.13.0", ["maximum"]).id == issue_id
        assert known.match(sig, "2.14.1", ops) is None
    else:
        assert known.match(sig, "2.13.0", ops) is None  # not seen on the versions CI runs
    assert known.match(sig.replace("torch_ca", "cagrad", 1), "2.11.0+cu130", ops) is None
    assert known.match(sig, "2.11.0+cu130", ["exp"]) is None
