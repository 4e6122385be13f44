"""The fuzzer's warning hooks (``tensor.warn``, opt-in) and the oracle's
``warnings`` kind: cagrad emits eager's warnings on generated programs whose
hooks warn; a subject that loses them is found by a campaign, reported as
one signature of kind ``warnings``, shrunk with the warning hook kept, and
its reproducer shows it."""

from __future__ import annotations

import json
import runpy
import warnings
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from fuzz.interpret import eager_grads
from fuzz.ir import Hook, Leaf, Op, Program
from fuzz.oracle import Oracle
from fuzz.render import render_source
from fuzz.strategies import programs
from harness.warnings_seen import recording
from tests.conftest import CAMPAIGN_TIMEOUTS, examples
from tests.fuzz.test_fuzz_campaign import _campaign

HERE = Path(__file__).resolve().parent
SILENCES = f"{HERE / 'broken_subject.py'}:SilencesWarnings"
WARN_ACTIONS = ("tensor.warn", "tensor.observe", "tensor.pure_scale", "post_accumulate.observe")


def _warning_program() -> Program:
    return Program(
        leaves=(Leaf("x0", (3, 4), "float64"),),
        ops=(Op("v0", "sin", ("x0",), {}), Op("v1", "mul", ("v0", "v0"), {})),
        roots=("v1",),
        seed=3,
        hooks=(Hook("h0", "tensor", "v0", "warn"), Hook("h1", "tensor", "x0", "warn")),
    )


def test_the_rendered_program_warns_as_the_interpreted_one() -> None:
    program = _warning_program()
    with recording() as interpreted:
        eager_grads(program, trace=[])
    namespace: dict = {}
    exec(render_source(program), namespace)  # noqa: S102 - the rendering is ours
    with recording() as rendered:
        namespace["run"](trace=[])
    want = [("UserWarning", "h0 tensor v0 saw a gradient"), ("UserWarning", "h1 tensor x0 saw a gradient")]
    assert [(r.category, r.message) for r in interpreted] == want
    assert [(r.category, r.message) for r in rendered] == want


@settings(max_examples=examples(8), deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(max_ops=6, hook_actions=WARN_ACTIONS))
def test_cagrad_emits_eagers_warnings_on_programs_whose_hooks_warn(program: Program) -> None:
    verdict = Oracle(["cagrad[eager]"], devices=["cpu"], neighbours=1).run(program)
    assert verdict.build_error is None, verdict.build_error
    assert verdict.ok, f"{verdict.report.summary()}\n{program.to_json(indent=None)}"


def test_a_subject_that_loses_warnings_is_found_and_shrunk(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    proc = _campaign(
        "--budget", "600", "--max-programs", "6", "--seed", "2", "--out", str(out), "--plugin", SILENCES,
        "--no-progress", "--known", "none", "--ops", "sin,mul,exp", "--hook-actions", "tensor.warn",
        "--neighbours", "0", "--workers", "1", *CAMPAIGN_TIMEOUTS,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failures = json.loads((out / "report.json").read_text())["failures"]
    signature = (
        "silences[sin]@cpu mismatch warnings: warnings: UserWarning '<name> tensor <name> saw a gradient' "
        "fewer times than eager's"
    )
    assert [f["signature"] for f in failures] == [signature]
    (f,) = failures
    shrunk = Program.from_json((out / f["program_json"]).read_text())
    assert "sin" in shrunk.op_names() and any(h.action == "warn" for h in shrunk.hooks)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reproducer's own eager run warns
        assert runpy.run_path(str(out / f["reproducer"]), run_name="repro")["main"]([]) == 1
    assert "warnings" in capsys.readouterr().out
