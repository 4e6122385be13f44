"""Reproducer files run standalone, and ``python -m fuzz replay`` reads them."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fuzz.cli import main
from fuzz.ir import Leaf, Op, Program
from fuzz.reproducer import read_reproducer, write_reproducer

HERE = Path(__file__).resolve().parent
BROKEN = f"{HERE / 'broken_subject.py'}:BrokenMulSubject"


def _program(op: str = "mul_scalar") -> Program:
    ops = {
        "mul_scalar": Op("v0", "mul_scalar", ("x0",), {"scalar": 2.0}),
        "sin": Op("v0", "sin", ("x0",), {}),
    }
    return Program(
        leaves=(Leaf("x0", (2, 3), "float32", True),),
        ops=(ops[op], Op("v1", "sum", ("v0",), {"dim": [1], "keepdim": False})),
        roots=("v1",),
        loss="separate",
        seed=4,
        name=f"repro-{op}",
    )


def _run(path: Path, *args: str, uninstalled: bool = False, gpus: bool = True) -> subprocess.CompletedProcess:
    """Runs ``python FILE`` from the file's own directory. ``uninstalled``:
    with ``-S`` and only the site-packages directories on PYTHONPATH, so that
    no .pth file (an editable install of this project) is processed and the
    file has to find fuzz and harness through its PROJECT_ROOT. ``gpus``
    False: the child sees no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, str(path), *args]
    if uninstalled:
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p.endswith("site-packages"))
        cmd.insert(1, "-S")
    return subprocess.run(cmd, capture_output=True, text=True, cwd=path.parent, env=env, timeout=300)


def test_reproducer_exits_0_for_a_clean_program(tmp_path: Path) -> None:
    path = write_reproducer(
        tmp_path / "clean.py", _program("sin"), subjects=["eager", "torch_ca[eager]"], devices=["cpu"]
    )
    # no GPU for the child: torch_ca would create a CUDA context there (the
    # known state difference torch-ca-cuda-init), which is not this test's
    proc = _run(path, gpus=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout and "torch_ca[eager]" in proc.stdout


def test_reproducer_exits_1_for_an_injected_divergence(tmp_path: Path) -> None:
    path = write_reproducer(tmp_path / "broken.py", _program("mul_scalar"), plugins=[BROKEN], devices=["cpu"])
    proc = _run(path, uninstalled=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "broken[mul]" in proc.stdout and "mismatch" in proc.stdout


@pytest.mark.parametrize("strides", [False, True])
def test_a_reproducer_compares_strides_if_its_campaign_did(tmp_path: Path, monkeypatch, strides: bool) -> None:
    if strides:
        monkeypatch.setenv("CAGRAD_FUZZ_STRIDES", "1")
    else:
        monkeypatch.delenv("CAGRAD_FUZZ_STRIDES", raising=False)
    plugin = f"{HERE / 'broken_subject.py'}:TransposedGrads"
    path = write_reproducer(tmp_path / "strides.py", _program("sin"), plugins=[plugin], devices=["cpu"])
    monkeypatch.delenv("CAGRAD_FUZZ_STRIDES", raising=False)  # the file itself carries it
    proc = _run(path)
    assert proc.returncode == (1 if strides else 0), proc.stdout + proc.stderr
    assert ("strides differ" in proc.stdout) == strides


def _main_of(path: Path):
    return runpy.run_path(str(path), run_name="reproducer_under_test")["main"]


def test_reproducer_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_reproducer(tmp_path / "r.py", _program("mul_scalar"), plugins=[BROKEN], devices=["cpu"])
    main_fn = _main_of(path)
    # the same program under a correct subject agrees: exit 0
    assert main_fn(["--subjects", "eager"]) == 0
    assert "eager" in capsys.readouterr().out
    # --show prints plain torch that runs by itself
    assert main_fn(["--show"]) == 0
    namespace: dict = {}
    exec(capsys.readouterr().out, namespace)  # noqa: S102
    grads = namespace["run"]()
    assert grads[0].shape == (2, 3)
    # bad arguments: exit 2
    assert main_fn(["--no-such-flag"]) == 2


def test_read_reproducer_round_trip(tmp_path: Path) -> None:
    program = _program()
    path = write_reproducer(tmp_path / "r.py", program, subjects=["cagrad[eager]"], plugins=[BROKEN], devices=["cpu"])
    rec = read_reproducer(path)
    assert rec["program"] == program
    assert rec["subjects"] == ["cagrad[eager]"] and rec["plugins"] == [BROKEN] and rec["devices"] == ["cpu"]
    (tmp_path / "not.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="not a cagrad-fuzz reproducer"):
        read_reproducer(tmp_path / "not.py")


def test_replay_command(tmp_path: Path) -> None:
    runner = CliRunner()
    broken = write_reproducer(tmp_path / "b.py", _program("mul_scalar"), plugins=[BROKEN], devices=["cpu"])
    result = runner.invoke(main, ["replay", str(broken)])
    assert result.exit_code == 1, result.output
    assert "broken[mul]" in result.output

    program_json = tmp_path / "p.json"
    program_json.write_text(_program("mul_scalar").to_json())
    result = runner.invoke(main, ["replay", str(program_json), "--subjects", "eager"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["replay", str(program_json), "--plugin", BROKEN, "--json"])
    assert result.exit_code == 1 and '"status": "mismatch"' in result.output

    result = runner.invoke(main, ["replay", str(program_json), "--show"])
    assert result.exit_code == 0 and "torch.mul(x0, 2.0)" in result.output

    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": 1, "leaves": [], "ops": [{"name": "v", "op": "nope", "inputs": []}], "roots": []}')
    result = runner.invoke(main, ["replay", str(bad)])
    assert result.exit_code == 2 and "ops[0].op: unknown op 'nope'" in result.output

    result = runner.invoke(main, ["replay", str(program_json), "--subjects", "nonsense[x"])
    assert result.exit_code == 2 and "bad subject name" in result.output
