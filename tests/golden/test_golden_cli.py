"""The golden-graph CLI: check, accept, review, list."""

from __future__ import annotations

from pathlib import Path

from golden_graphs import scenarios
from golden_graphs.store import DEFAULT_ROOT, ROOT_ENV, torch_version

from .conftest import cli


def _graph_op_line(text: str) -> str:
    """The first op line of the first autograd node in the [graph] section."""
    lines = text.splitlines()
    start = lines.index("[graph]")
    comment = next(i for i in range(start, len(lines)) if lines[i].startswith("# "))
    return lines[comment + 1]


def test_committed_snapshots_match(committed):
    """The suite's golden check: every committed snapshot matches cagrad."""
    result = cli("--root", DEFAULT_ROOT, "check")
    assert result.exit_code == 0, result.output
    assert "check passed" in result.output


def test_at_least_the_required_scenarios():
    required = {
        "mlp_step", "broadcast", "reduction_dims", "views", "matmul_chain",
        "softmax", "shared_subexpression", "two_losses",
    }  # fmt: skip
    assert required <= set(scenarios.names())


def test_edited_graph_line_fails_with_diff(root, version_dir):
    path = version_dir / "two_losses.txt"
    text = path.read_text()
    original = _graph_op_line(text)
    edited = original.replace("= aten.", "= aten.edited_", 1)
    assert edited != original
    path.write_text(text.replace(original + "\n", edited + "\n", 1))

    result = cli("--root", root, "check")
    assert result.exit_code == 1
    out = result.output
    assert "CHANGED two_losses" in out
    assert f"\n-{edited}\n" in out
    assert f"\n+{original}\n" in out
    assert "--- " in out and "+++ " in out and "@@ -" in out
    assert "accept two_losses" in out  # the hint names what to accept
    assert "CHANGED views" not in out  # the others still match


def test_edited_cache_key_fails_with_diff(root, version_dir):
    path = version_dir / "broadcast.txt"
    lines = path.read_text().splitlines(keepends=True)
    i = lines.index("[cache_keys]\n") + 1
    node_type, hexbytes = lines[i].split()
    flipped = "ff" if hexbytes[-2:] != "ff" else "00"
    lines[i] = f"{node_type} {hexbytes[:-2]}{flipped}\n"
    # the key's last decoded field ends with the flipped byte: keep the file consistent
    last = next(j for j in range(i + 1, len(lines)) if not lines[j].startswith("    ")) - 1
    field_hex = lines[last].split("]")[0].removeprefix("    [")
    lines[last] = lines[last].replace(f"[{field_hex}]", f"[{field_hex[:-2]}{flipped}]", 1)
    path.write_text("".join(lines))

    result = cli("--root", root, "check", "broadcast")
    assert result.exit_code == 1, result.output
    assert "CHANGED broadcast" in result.output
    assert f"\n-{lines[i].rstrip()}\n" in result.output
    assert f"\n+{node_type} {hexbytes}\n" in result.output
    assert f"NodeCall 0 {node_type}: `" in result.output  # the field-level line
    assert "[cache_keys]" in result.output.split("@@")[2]  # the hunk names its section


def test_missing_and_stale_snapshots_fail(root, version_dir):
    (version_dir / "softmax.txt").unlink()
    (version_dir / "retired_scenario.txt").write_text("whatever\n")
    result = cli("--root", root, "check")
    assert result.exit_code == 1
    assert "MISSING softmax" in result.output
    assert "STALE retired_scenario" in result.output
    assert "--prune" in result.output


def test_malformed_snapshot_names_file_and_line(root, version_dir):
    path = version_dir / "views.txt"
    lines = path.read_text().splitlines(keepends=True)
    i = lines.index("[cache_keys]\n") + 1
    lines[i] = lines[i].rstrip() + "zz\n"
    path.write_text("".join(lines))
    result = cli("--root", root, "check", "views")
    assert result.exit_code == 1
    assert "MALFORMED views" in result.output
    assert f"views.txt:{i + 1}: expected a key line" in result.output


def test_no_snapshot_set_exits_2_naming_the_sets_and_the_command(tmp_path):
    result = cli("--root", tmp_path, "check")
    assert result.exit_code == 2
    assert f"no snapshot set for torch {torch_version()}" in result.output
    assert "snapshot sets exist for torch: none" in result.output
    assert f"golden_graphs --root {tmp_path} accept" in result.output
    # versions outside the supported 2.11-2.13, so neither is the current one
    (tmp_path / "torch-1.10").mkdir()
    (tmp_path / "torch-1.9").mkdir()
    result = cli("--root", tmp_path, "check")
    assert result.exit_code == 2
    assert "snapshot sets exist for torch: 1.9, 1.10." in result.output


def test_unknown_scenario_is_a_usage_error(root):
    result = cli("--root", root, "check", "no_such_scenario")
    assert result.exit_code == 2
    assert "no_such_scenario" in result.output


def test_root_from_environment(tmp_path, accepted_root):
    from click.testing import CliRunner

    from golden_graphs.cli import main

    result = CliRunner().invoke(main, ["check", "broadcast"], env={ROOT_ENV: str(accepted_root)})
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["check"], env={ROOT_ENV: str(tmp_path)})
    assert result.exit_code == 2


def test_accept_into_empty_root_then_check_is_clean(tmp_path):
    names = ["broadcast", "views"]
    result = cli("--root", tmp_path, "accept", *names)
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in (tmp_path / f"torch-{torch_version()}").iterdir())
    assert written == ["broadcast.txt", "views.txt"]
    assert result.output.count("created ") >= 2
    result = cli("--root", tmp_path, "check", *names)
    assert result.exit_code == 0, result.output


def test_accept_rewrites_only_named_scenarios(root, version_dir):
    for name in ("broadcast", "views"):
        path = version_dir / f"{name}.txt"
        path.write_text(path.read_text().replace("[graph]\n", "[graph]\n%bogus = x\n"))
    untouched = (version_dir / "views.txt").read_bytes()

    result = cli("--root", root, "accept", "broadcast")
    assert result.exit_code == 0, result.output
    assert "updated" in result.output and "broadcast.txt (+0 -1 lines)" in result.output
    assert (version_dir / "views.txt").read_bytes() == untouched

    result = cli("--root", root, "check")
    assert result.exit_code == 1
    assert "CHANGED views" in result.output
    assert "broadcast" not in result.output.split("FAILED")[0]


def test_accept_reports_unchanged_and_replaces_malformed(root, version_dir):
    (version_dir / "softmax.txt").write_text("not a snapshot\n")
    result = cli("--root", root, "accept")
    assert result.exit_code == 0, result.output
    assert "replaced malformed" in result.output and "softmax.txt" in result.output
    assert "unchanged" in result.output
    assert cli("--root", root, "check").exit_code == 0


def test_accept_keeps_stale_files_unless_pruned(root, version_dir):
    stale = version_dir / "retired_scenario.txt"
    stale.write_text("old\n")
    result = cli("--root", root, "accept")
    assert result.exit_code == 0
    assert "stale" in result.output and stale.exists()
    assert cli("--root", root, "accept", "views", "--prune").exit_code == 2
    result = cli("--root", root, "accept", "--prune")
    assert result.exit_code == 0
    assert "pruned" in result.output and not stale.exists()
    assert cli("--root", root, "check").exit_code == 0


def test_review_shows_diffs_without_failing(root, version_dir):
    path = version_dir / "views.txt"
    path.write_text(path.read_text().replace("[graph]\n", "[graph]\n%bogus = x\n"))
    (version_dir / "mlp_step.txt").unlink()
    result = cli("--root", root, "review")
    assert result.exit_code == 0
    assert "-%bogus = x" in result.output
    assert "MISSING mlp_step" in result.output
    assert "changed" in result.output and "missing" in result.output


def test_list_names_every_scenario(root, version_dir):
    (version_dir / "views.txt").unlink()
    result = cli("--root", root, "list")
    assert result.exit_code == 0
    for name in scenarios.names():
        assert name in result.output
    assert "[no snapshot]" in result.output


def test_accept_is_idempotent_bytewise(root, version_dir):
    before = {p.name: p.read_bytes() for p in Path(version_dir).iterdir()}
    result = cli("--root", root, "accept")
    assert result.exit_code == 0
    assert "0 file(s) changed" in result.output
    assert {p.name: p.read_bytes() for p in Path(version_dir).iterdir()} == before


def test_a_scenario_that_fails_to_capture(root, version_dir, monkeypatch):
    """ERROR fails check, and accept keeps the old file and exits 1."""

    def hooked() -> scenarios.Backward:
        raise RuntimeError("broken on purpose")

    old = (version_dir / "views.txt").read_bytes()
    registry = dict(scenarios.REGISTRY)
    registry["views"] = scenarios.Scenario("views", "broken on purpose", hooked)
    monkeypatch.setattr(scenarios, "REGISTRY", registry)
    result = cli("--root", root, "check", "views")
    assert result.exit_code == 1
    assert "ERROR views" in result.output and "RuntimeError: broken on purpose" in result.output
    result = cli("--root", root, "accept", "views")
    assert result.exit_code == 1
    assert "failed (file kept)" in result.output
    assert (version_dir / "views.txt").read_bytes() == old


def test_accepted_files_are_world_readable(tmp_path):
    import os
    import stat

    assert cli("--root", tmp_path, "accept", "broadcast").exit_code == 0
    mode = stat.S_IMODE(os.stat(tmp_path / f"torch-{torch_version()}" / "broadcast.txt").st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


def test_new_version_makes_the_set_and_reviews_it_against_the_newest_older_one(tmp_path):
    """``new-version`` writes the running torch's set and reviews it against
    the newest older set: one graph line planted in the older set shows as
    that scenario changed, the other as ok; run again, it refuses (the set
    exists: exit 1)."""
    running = torch_version()
    major, minor = (int(x) for x in running.split("."))
    accepted_root = tmp_path / "captured"
    assert cli("--root", accepted_root, "accept", "two_losses", "views").exit_code == 0
    tmp_path = tmp_path / "root"
    older, oldest = tmp_path / f"torch-{major}.{minor - 1}", tmp_path / f"torch-{major}.{minor - 2}"
    for d in (older, oldest):
        d.mkdir(parents=True)
        for name in ("two_losses", "views"):
            (d / f"{name}.txt").write_text((accepted_root / f"torch-{running}" / f"{name}.txt").read_text())
    text = (older / "two_losses.txt").read_text()
    line = _graph_op_line(text)
    (older / "two_losses.txt").write_text(text.replace(line + "\n", line.replace("= aten.", "= aten.planted_", 1) + "\n", 1))

    result = cli("--root", tmp_path, "new-version", "two_losses", "views")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / f"torch-{running}").iterdir()) == ["two_losses.txt", "views.txt"]
    assert (tmp_path / f"torch-{running}" / "views.txt").read_text() == (accepted_root / f"torch-{running}" / "views.txt").read_text()
    out = result.output
    assert f"torch {major}.{minor - 1} snapshots vs" in out and "1 ok, 1 changed" in out, out
    assert "`two_losses` | changed" in out and "aten.planted_" in out

    again = cli("--root", tmp_path, "new-version", "views")
    assert again.exit_code == 1 and "exists already" in again.output
