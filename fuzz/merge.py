"""``python -m fuzz merge OUT... --out M``: one report from several campaign
outputs (the shards of one campaign, run by a CI matrix or an array job, or
any campaigns).

Counts are added up; failures are deduplicated by signature (their counts
added; the files of the first shrunk one, else the first one, copied to
``M/failures/`` under a new id); known issues are added up by id and
signature; coverage counts are added up and what is (not) covered is
worked out again over the sum (:func:`fuzz.coverage.summary`). ``merged_from`` lists the inputs with their shards; ``shard`` is
null. The merged ``exit_status`` is 1 when any failure remains.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fuzz import coverage
from fuzz.campaign.config import atomic_write, slug
from fuzz.campaign.state import MAX_FALLBACK_SAMPLES, REPORT_SCHEMA


class MergeError(Exception):
    """An input that is not a campaign output (the message names the file)."""


def _read(out: Path) -> dict[str, Any]:
    path = out / "report.json"
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise MergeError(f"{path}: no report.json (is {out} a campaign output?)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise MergeError(f"{path}: cannot read: {e}") from None
    if not isinstance(report, dict) or report.get("schema") != REPORT_SCHEMA:
        got = report.get("schema") if isinstance(report, dict) else None
        raise MergeError(f"{path}: report schema {got!r}, expected {REPORT_SCHEMA}")
    for field in ("programs_run", "failures"):
        if field not in report:
            raise MergeError(f"{path}: missing field {field!r}")
    return report


def _add(into: dict[str, Any], more: dict[str, Any]) -> None:
    """Adds nested dicts of numbers."""
    for k, v in more.items():
        if isinstance(v, dict):
            _add(into.setdefault(k, {}), v)
        elif isinstance(v, (int, float)):
            into[k] = into.get(k, 0) + v


def merge_outputs(outs: Sequence[Path], dest: Path) -> dict[str, Any]:
    """Merges the campaign outputs ``outs`` into ``dest`` (created; an
    existing ``dest/failures`` is replaced). Returns the merged report (also
    written to ``dest/report.json``). Raises MergeError on an unreadable
    input or an unwritable ``dest``."""
    reports = [(Path(o), _read(Path(o))) for o in outs]
    try:
        dest.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest / "failures", ignore_errors=True)
    except OSError as e:
        raise MergeError(f"cannot create {dest}: {e}") from None
    seeds = {r.get("seed") for _, r in reports}
    merged: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "seed": seeds.pop() if len(seeds) == 1 else None,
        "budget_s": max(r.get("budget_s", 0) for _, r in reports),
        "elapsed_s": max(r.get("elapsed_s", 0) for _, r in reports),
        "programs_run": 0,
        "op_counts": {},
        "feature_counts": {},
        "coverage": {},
        "steered": all(r.get("steered", False) for _, r in reports),
        # one program in N ran the peers; None where the shards differed (reports before it: 1)
        "peer_every": every.pop() if len(every := {r.get("peer_every", 1) for _, r in reports}) == 1 else None,
        "subjects": [],
        "devices": [],
        "failures": [],
        "known": [],
        "build_errors": 0,
        "outcome_counts": {},
        "fallback_reasons": {},
        "fallback_samples": {},
        "sequence_captures": {},
        "engine_counts": {},
        "rounds": 0,
        "shard": None,
        "throughput": {"programs_per_s": 0.0, "workers": 0},
        "timeline": [],
        "merged_from": [{"out": str(o), "shard": r.get("shard"), "programs_run": r["programs_run"]} for o, r in reports],
        "sessions": [],
        "torch_version": reports[0][1].get("torch_version") if reports else None,
        "op_substitutions": reports[0][1].get("op_substitutions", {}) if reports else {},
    }
    chosen: dict[str, tuple[Path, dict[str, Any]]] = {}
    counts: dict[str, int] = {}
    order: list[str] = []
    for out, r in reports:
        merged["programs_run"] += r["programs_run"]
        merged["build_errors"] += r.get("build_errors", 0)
        merged["rounds"] += r.get("rounds", 0)
        for field in (
            "op_counts", "feature_counts", "outcome_counts", "fallback_reasons", "sequence_captures", "engine_counts",
        ):
            _add(merged[field], r.get(field, {}))
        for field in ("subjects", "devices"):
            merged[field] += [x for x in r.get(field, []) if x not in merged[field]]
        for where, reasons in r.get("fallback_samples", {}).items():
            for reason, paths in reasons.items():
                kept = merged["fallback_samples"].setdefault(where, {}).setdefault(reason, [])
                # paths into each shard's OUT (the files are not copied)
                kept += [str(out / p) for p in paths][: max(0, MAX_FALLBACK_SAMPLES - len(kept))]
        t = r.get("throughput") or {}
        merged["throughput"]["programs_per_s"] += t.get("programs_per_s", 0.0)
        merged["throughput"]["workers"] += t.get("workers", 0)
        merged["sessions"] += r.get("sessions", [])
        for k in r.get("known", []):
            same = next((m for m in merged["known"] if (m["id"], m["signature"]) == (k["id"], k["signature"])), None)
            if same is None:
                merged["known"].append(dict(k))
            else:
                same["count"] += k["count"]
        for f in r["failures"]:
            sig = f["signature"]
            if sig not in chosen:
                order.append(sig)
                chosen[sig] = (out, f)
            elif f.get("shrunk", True) and not chosen[sig][1].get("shrunk", True):
                chosen[sig] = (out, f)
            counts[sig] = counts.get(sig, 0) + f["count"]
    merged["throughput"]["programs_per_s"] = round(merged["throughput"]["programs_per_s"], 3)
    # coverage: counts added up, what is (not) covered worked out again over the sum
    feats: dict[str, int] = {}
    prs: dict[str, int] = {}
    for _, r in reports:
        _add(feats, (r.get("coverage") or {}).get("features", {}))
        _add(prs, (r.get("coverage") or {}).get("pairs", {}))
    merged["coverage"] = coverage.summary(feats, prs)
    for i, sig in enumerate(order, 1):
        out, f = chosen[sig]
        fid = f"F{i:03d}"
        src = (out / f["reproducer"]).parent
        d = dest / "failures" / f"{fid}-{slug(sig.split(':')[0])}"
        try:
            shutil.copytree(src, d)
        except OSError as e:
            raise MergeError(f"cannot copy {src} to {d}: {e}") from None
        merged["failures"].append(
            {
                **f,
                "id": fid,
                "count": counts[sig],
                "reproducer": str((d / Path(f["reproducer"]).name).relative_to(dest)),
                "program_json": str((d / Path(f["program_json"]).name).relative_to(dest)),
                "merged_from": str(out),
            }
        )
    merged["exit_status"] = 1 if merged["failures"] else 0
    try:
        atomic_write(dest / "report.json", json.dumps(merged, indent=1))
    except OSError as e:
        raise MergeError(f"cannot write {dest / 'report.json'}: {e}") from None
    return merged
