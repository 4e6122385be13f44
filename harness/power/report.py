"""The mutation report: score per module, every survivor with its diff.

Built from one run folder or the folders of several shards of one run
(:func:`load_rows`), as ``report.json`` and ``report.md`` (a jinja2
template, :file:`templates/report.md.j2`).

Survivors run again after new tests (``run --mutant ID ...``, one or more
folders given as ``reruns``) replace the sample's outcome of those mutants
(:func:`apply_reruns`): the report then scores the sample as the tests stand
now, and each such row keeps its first outcome.

Score of a module: ``(killed + timeout) / (killed + timeout + survived)``,
where ``survived`` excludes the survivors the equivalents file lists
(``equivalent``); incompetent, no-test and pending mutants are counted but
not scored. None when nothing is scored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from harness.power import session
from harness.power.equivalents import load as load_equivalents
from harness.power.mutants import MutantId
from harness.power.outcomes import OUTCOMES, classify
from harness.power.relocate import change


class ReportError(Exception):
    """Folders that do not make one report (says why)."""


def load_rows(folders: Sequence[Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per sampled mutant of the folders' sessions (shards of one
    run), and the run's description.

    A row: ``id, module, line, operator, occurrence, definition, outcome,
    killer, seconds, diff``.

    Raises:
        ReportError: a folder without a session, or sessions of different runs.
    """
    rows: dict[str, dict[str, Any]] = {}
    info: dict[str, Any] = {}
    for folder in folders:
        meta = session.load_meta(folder)
        if meta is None:
            raise ReportError(f"{folder}: no harness.power session (session.json) there")
        p = meta.params
        run_key = {"seed": p.seed, "sample": p.sample, "modules": p.modules, "killers": p.killers,
                   "programs": p.programs, "digest": p.digest, "shards": p.shard[1]}  # fmt: skip
        if info and info["run"] != run_key:
            raise ReportError(f"{folder}: a session of another run than {folders[0]} (seed, sample, sources...)")
        info.setdefault("run", run_key)
        info.setdefault("total_mutants", meta.total_mutants)
        info.setdefault("annotation_mutants", sum(meta.annotation_mutants.values()))
        info.setdefault("starts", []).extend(meta.runs)
        info.setdefault("shards_seen", []).append(p.shard[0])
        times = session.load_times(folder)
        db = session.open_db(folder)
        try:
            items = {item.job_id: item for item in db.work_items}
            results = dict(db.results)
        finally:
            db.close()
        for job_id in meta.ids:
            ident = MutantId.parse(job_id)
            spec = items[job_id].mutations[0]
            result = results.get(job_id)
            outcome, killer = ("pending", None) if result is None else classify(result)
            rows[job_id] = {
                "id": job_id, "module": ident.module, "line": ident.line, "operator": ident.operator,
                "occurrence": ident.occurrence, "definition": spec.definition_name, "outcome": outcome,
                "killer": killer, "seconds": times.get(job_id), "diff": _diff(result),
            }  # fmt: skip
    return [rows[k] for k in sorted(rows, key=MutantId.parse)], info


def apply_reruns(
    rows: list[dict[str, Any]], folders: Sequence[Path], modules: list[str], moved: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Replaces, in place, the outcome of each sampled mutant that a rerun
    folder (a ``run --mutant ...`` session) has a result for; a later folder
    wins over an earlier one. Each replaced row gains ``first_outcome`` (the
    sample's) and ``rerun`` (the folder). Returns one summary per folder:
    ``{"folder", "mutants", "killers", "killer_argv"}``.

    ``moved`` (``{current id: sample id}``, from ``harness.power relocate``)
    names the sample's mutant a rerun id stands for when the code moved
    between the runs; the two diffs must then make the same change
    (:func:`harness.power.relocate.change`), and the row keeps ``rerun_id``.

    Raises:
        ReportError: a folder without a session or not made with ``--mutant``,
            missing some of the sample's modules, naming a mutant the sample does
            not hold, or whose mutant is not the sample's (another diff: the
            code moved between the runs). A module added since the sample is
            no reason to refuse: its mutants are not the sample's.
    """
    by_id = {row["id"]: row for row in rows}
    summaries = []
    for folder in folders:
        meta = session.load_meta(folder)
        if meta is None:
            raise ReportError(f"{folder}: no harness.power session (session.json) there")
        p = meta.params
        if not p.only:
            raise ReportError(f"{folder}: a sampled run, not a rerun of named mutants (--mutant): merge it as a shard")
        if not set(modules) <= set(p.modules):
            raise ReportError(f"{folder}: mutates {sorted(set(modules) - set(p.modules))} of the sample's modules no more")
        db = session.open_db(folder)
        try:
            results = dict(db.results)
        finally:
            db.close()
        times = session.load_times(folder)
        replaced = 0
        for job_id in meta.ids:
            sample_id = (moved or {}).get(job_id, job_id)
            row = by_id.get(sample_id)
            if row is None:
                raise ReportError(f"{folder}: mutant {job_id} is not in the sample (relocate it: harness.power relocate)")
            result = results.get(job_id)
            if result is None:
                continue  # not run yet: the sample's outcome stands
            if row["diff"] and change(_diff(result)) != change(row["diff"]):
                raise ReportError(f"{folder}: mutant {job_id} is another change than the sample's {sample_id} (the code moved)")
            outcome, killer = classify(result)
            row.setdefault("first_outcome", row["outcome"])
            row.update(outcome=outcome, killer=killer, seconds=times.get(job_id), rerun=str(folder), diff=_diff(result))
            if job_id != sample_id:
                row["rerun_id"] = job_id
            replaced += 1
        summaries.append({"folder": str(folder), "mutants": replaced, "killers": p.killers,
                          "killer_argv": p.killer_argv})  # fmt: skip
    return summaries


def _diff(result) -> str:
    """The unified diff of a mutant, without cosmic-ray's header line."""
    text = (result.diff or "") if result is not None else ""
    return text.removeprefix("--- mutation diff ---\n")


def apply_equivalents(rows: Iterable[dict[str, Any]], equivalents: dict[MutantId, str]) -> list[str]:
    """Marks survivors listed in ``equivalents`` as ``equivalent`` (with
    ``equivalent_reason``), in place; returns the listed ids that match no
    survivor among the rows (stale or not sampled)."""
    used = set()
    for row in rows:
        reason = equivalents.get(MutantId.parse(row["id"]))
        row["equivalent_reason"] = None
        if reason is not None and row["outcome"] == "survived":
            row["outcome"] = "equivalent"
            row["equivalent_reason"] = reason
            used.add(row["id"])
    return sorted(str(i) for i in equivalents if str(i) not in used)


def score(counts: dict[str, int]) -> float | None:
    killed = counts["killed"] + counts["timeout"]
    scored = killed + counts["survived"]
    return None if scored == 0 else killed / scored


def aggregate(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``{"modules": {module: counts + score}, "total": counts + score,
    "killers": {name: kills}}``; counts are per outcome (:data:`OUTCOMES`)."""
    modules: dict[str, dict[str, Any]] = {}
    total = dict.fromkeys(OUTCOMES, 0)
    killers: dict[str, int] = {}
    for row in rows:
        counts = modules.setdefault(row["module"], dict.fromkeys(OUTCOMES, 0))
        counts[row["outcome"]] += 1
        total[row["outcome"]] += 1
        if row["outcome"] == "killed":
            killers[row["killer"]] = killers.get(row["killer"], 0) + 1
    for counts in [*modules.values(), total]:
        counts["mutants"] = sum(counts[o] for o in OUTCOMES)
        counts["score"] = score(counts)
    seconds = [r["seconds"] for r in rows if r["seconds"] is not None]
    return {
        "modules": dict(sorted(modules.items())),
        "total": total,
        "killers": dict(sorted(killers.items(), key=lambda kv: -kv[1])),
        "seconds_per_mutant": (sum(seconds) / len(seconds)) if seconds else None,
    }


def build(
    folders: Sequence[Path],
    equivalents_path: Path | None = None,
    reruns: Sequence[Path] = (),
    moved: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The report as a JSON-ready dict: the sample of ``folders`` (its
    shards), with the outcomes of ``reruns`` (:func:`apply_reruns`).

    Raises:
        ReportError, EquivalentsError.
    """
    rows, info = load_rows(folders)
    rerun_summaries = apply_reruns(rows, reruns, info["run"]["modules"], moved)
    equivalents = load_equivalents(equivalents_path)
    if moved:  # entries written against the current tree name the sample's rows by their moved ids
        equivalents = {MutantId.parse(moved.get(str(k), str(k))): v for k, v in equivalents.items()}
    stale = apply_equivalents(rows, equivalents)
    return {
        "tool": "cosmic-ray",
        "run": info["run"],
        "shards_seen": sorted(info["shards_seen"]),
        "total_mutants": info["total_mutants"],
        "annotation_mutants_left_out": info["annotation_mutants"],
        "starts": info["starts"],
        "reruns": rerun_summaries,
        **aggregate(rows),
        "stale_equivalents": stale,
        "mutants": rows,
    }


def render_markdown(report: dict[str, Any]) -> str:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined,
    )  # fmt: skip
    env.filters["pct"] = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
    return env.get_template("report.md.j2").render(r=report)


def write(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Writes ``report.json`` and ``report.md`` into ``out``; returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "report.json", out / "report.md"
    for path, text in zip(paths, (json.dumps(report, indent=1), render_markdown(report))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return paths
