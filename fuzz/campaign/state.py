"""A campaign's state (``OUT/state.json``), its failure records and its
``report.json``; owned by the parent process.

The state records which rounds are done and how far cut-short ones got, so
that running the same command again resumes the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fuzz import coverage
from fuzz.campaign.config import CampaignConfig, CampaignError, atomic_write, slug
from fuzz.ir import Program
from fuzz.ops_graph import SUBSTITUTIONS
from fuzz.reproducer import write_reproducer

REPORT_SCHEMA = 2
STATE_SCHEMA = 2
MAX_BUILD_ERROR_SAMPLES = 20
MAX_FALLBACK_SAMPLES = 3  # programs kept per subject@device and fallback reason


def new_state(cfg: CampaignConfig) -> dict[str, Any]:
    return {
        "schema": STATE_SCHEMA,
        "seed": cfg.seed,
        "shard": cfg.shard_text(),
        "rounds_done": [],
        "partial": {},
        "programs_run": 0,
        "op_counts": {},
        "feature_counts": {},
        "coverage_features": {},
        "coverage_pairs": {},
        "steering": None,
        "build_errors": 0,
        "outcome_counts": {},
        "fallback_reasons": {},
        "fallback_samples": {},
        "sequence_captures": {},
        "engine_counts": {},
        "elapsed_s": 0.0,
        "failures": [],
        "known": [],
        "sessions": [],
        "timeline": [],
    }


class CampaignState:
    """The state of the campaign under ``cfg.out``; :meth:`load` it first."""

    def __init__(self, cfg: CampaignConfig):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.s: dict[str, Any] = new_state(cfg)

    @property
    def state_path(self) -> Path:
        return self.out / "state.json"

    @property
    def report_path(self) -> Path:
        return self.out / "report.json"

    def load(self) -> None:
        """Reads ``state.json`` when there is one; raises CampaignError on an
        unreadable one or one of another seed or shard."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CampaignError(f"cannot create output directory {self.out}: {e}") from None
        if not self.state_path.exists():
            return
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CampaignError(f"cannot read {self.state_path}: {e}") from None
        if not isinstance(state, dict) or state.get("schema") != STATE_SCHEMA:
            raise CampaignError(
                f"{self.state_path}: unsupported state schema {state.get('schema') if isinstance(state, dict) else None!r}"
                f" (expected {STATE_SCHEMA}); use another --out"
            )
        if state.get("seed") != self.cfg.seed:
            raise CampaignError(
                f"{self.out} holds a campaign with seed {state.get('seed')}; "
                f"resume it with --seed {state.get('seed')} or use another --out"
            )
        if state.get("shard") != self.cfg.shard_text():
            raise CampaignError(
                f"{self.out} holds shard {state.get('shard')} of its campaign, not {self.cfg.shard_text()}; "
                "resume it with the same --shard or use another --out"
            )
        self.s = state

    def save(self) -> None:
        try:
            atomic_write(self.state_path, json.dumps(self.s, indent=1, sort_keys=True))
        except OSError as e:
            raise CampaignError(f"cannot write {self.state_path}: {e}") from None

    # --------------------------------------------------------- rounds
    def pending_rounds(self) -> list[tuple[int, int]]:
        """Cut-short rounds to finish first: ``(round, skip)``, in order."""
        return sorted((int(r), k) for r, k in self.s["partial"].items())

    def next_new_round(self, after: int) -> int:
        """The first round of this shard above ``after`` not done or partial."""
        done = set(self.s["rounds_done"]) | {int(r) for r in self.s["partial"]}
        r = after + 1
        while not self.cfg.owns(r) or r in done:
            r += 1
        return r

    def round_ended(self, r: int, done: bool, index: int) -> None:
        self.s["partial"].pop(str(r), None)
        if done:
            if r not in self.s["rounds_done"]:
                self.s["rounds_done"].append(r)
                self.s["rounds_done"].sort()
        else:
            self.s["partial"][str(r)] = index

    # ---------------------------------------------------------- counts
    def count_program(self, stats: dict[str, Any]) -> None:
        """Adds one generated program's stats (a worker's ``ran`` event)."""
        s = self.s
        s["programs_run"] += 1
        for name in stats["ops"]:
            s["op_counts"][name] = s["op_counts"].get(name, 0) + 1
        for name in stats["features"]:
            s["feature_counts"][name] = s["feature_counts"].get(name, 0) + 1
        cov = stats.get("coverage") or {}
        coverage.add_counts(s.setdefault("coverage_features", {}), cov.get("features", ()))
        coverage.add_counts(s.setdefault("coverage_pairs", {}), cov.get("pairs", ()))
        for o in stats["outcomes"]:
            where = o["where"]
            per = s["outcome_counts"].setdefault(where, {})
            per[o["status"]] = per.get(o["status"], 0) + 1
            for reason, n in o["fallback_reasons"].items():
                r = s["fallback_reasons"].setdefault(where, {})
                r[reason] = r.get(reason, 0) + n
                if stats.get("program"):
                    self._record_fallback_sample(where, reason, stats["program"])
            if o.get("counts", {}).get("segment_compile_failures") and stats.get("program"):
                # compiled gradients, but a segment ran uncompiled: slower, and a
                # capture the backend disagreed with (the log has its error)
                self._record_fallback_sample(where, "segment_compile_failures", stats["program"])
            totals = s.setdefault("engine_counts", {}).setdefault(where, {})
            for k, n in o.get("counts", {}).items():
                totals[k] = totals.get(k, 0) + n
            caps = o["captures"]
            if caps is not None:
                seq = s["sequence_captures"].setdefault(
                    where, {"sequences": 0, "variants": 0, "captures": 0, "over_first": 0, "rule_failures": 0}
                )
                seq["sequences"] += 1
                seq["variants"] += len(caps)
                seq["captures"] += sum(caps)
                seq["over_first"] += sum(caps[1:])  # recaptures at new sizes
                seq["rule_failures"] += int(o["rule_failure"])
        for sig in stats["hits"]:
            f = self.failure(sig)
            if f is not None:
                f["count"] += 1
        for k in stats["known"]:
            self.count_known(k)
        if stats["build_error"]:
            self._record_build_error(stats["program"], stats["build_error"])

    def count_known(self, k: dict[str, Any]) -> None:
        for entry in self.s["known"]:
            if entry["signature"] == k["signature"] and entry["id"] == k["id"]:
                entry["count"] += 1
                return
        self.s["known"].append({"id": k["id"], "signature": k["signature"], "count": 1, "note": k["note"], "link": k["link"]})

    def _record_fallback_sample(self, where: str, reason: str, program_json: str) -> None:
        """Keeps the first programs a subject ran in eager for ``reason``
        (``OUT/fallbacks/``), listed in the report by path, for triage with
        ``python -m fuzz replay PATH``."""
        paths = self.s.setdefault("fallback_samples", {}).setdefault(where, {}).setdefault(reason, [])
        if len(paths) >= MAX_FALLBACK_SAMPLES:
            return
        d = self.out / "fallbacks"
        d.mkdir(exist_ok=True)
        name = f"{slug(where + ' ' + reason)}-{len(paths) + 1}.json"
        atomic_write(d / name, program_json)
        paths.append(f"fallbacks/{name}")

    def _record_build_error(self, program_json: str, error: str) -> None:
        s = self.s
        s["build_errors"] += 1
        if s["build_errors"] <= MAX_BUILD_ERROR_SAMPLES:
            d = self.out / "build_errors"
            d.mkdir(exist_ok=True)
            atomic_write(d / f"B{s['build_errors']:03d}.json", program_json)
            atomic_write(d / f"B{s['build_errors']:03d}.txt", error)

    # -------------------------------------------------------- failures
    def failure(self, signature: str) -> dict[str, Any] | None:
        for f in self.s["failures"]:
            if f["signature"] == signature:
                return f
        return None

    def record(self, rec: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Records a failure (a worker's ``novel``/``failure`` payload, or a
        crash or timeout from the parent). A new signature gets ``F00N``, its
        directory and reproducer; a shrunk record replaces an unshrunk one;
        another unshrunk hit of a recorded signature is counted. Returns the
        record and whether it is new."""
        f = self.failure(rec["signature"])
        if f is not None:
            if rec["shrunk"] and not f["shrunk"]:
                self._write_files(f, rec)
            elif not rec["shrunk"]:
                f["count"] += 1
            return f, False
        fid = f"F{len(self.s['failures']) + 1:03d}"
        key = rec["key"]
        d = self.out / "failures" / f"{fid}-{slug(rec['signature'].split(':')[0])}"
        f = {
            "id": fid,
            "signature": rec["signature"],
            "key": key,
            "count": 1,
            "reproducer": str((d / "reproducer.py").relative_to(self.out)),
            "program_json": str((d / "program.json").relative_to(self.out)),
        }
        self.s["failures"].append(f)
        self._write_files(f, rec)
        return f, True

    def _write_files(self, f: dict[str, Any], rec: dict[str, Any]) -> None:
        d = self.out / f["program_json"]
        d = d.parent
        d.mkdir(parents=True, exist_ok=True)
        fid, key = f["id"], rec["key"]
        best = Program.from_json(rec["program"]).with_name(fid)
        original = Program.from_json(rec["original"]).with_name(f"{fid}-original")
        atomic_write(d / "program.json", best.to_json())
        atomic_write(d / "original.json", original.to_json())
        if rec.get("report") is not None:
            atomic_write(d / "report.json", json.dumps(rec["report"], indent=1))
        plugin = rec.get("plugin")
        expect = {
            "crash": f"the process dies with {rec['first_outcome'].get('signal')}",
            "timeout": f"it runs past {rec['first_outcome'].get('seconds')} s"
            + (" of CPU time" if rec["first_outcome"].get("clock") == "cpu" else ""),
        }.get(key["status"])
        header = (
            f"Signature: {rec['signature']}\n"
            f"Found by cagrad-fuzz campaign --seed {self.cfg.seed} (torch {torch.__version__});\n"
            f"shrunk from {rec['original_ops']} ops to {rec['shrunk_ops']}"
            + ("" if rec["shrunk"] else " (not shrunk yet)")
            + "."
            + (f"\nExpected when run: {expect}." if expect else "")
        )
        write_reproducer(
            d / "reproducer.py",
            best,
            subjects=[] if plugin or key["subject"] == "harness" else [key["subject"]],
            plugins=[plugin] if plugin else [],
            devices=[key["device"]],
            header=header,
            neighbours=self.cfg.neighbours,
        )
        f.update(
            ops=rec["ops"],
            hooks=rec["hooks"],
            original_ops=rec["original_ops"],
            shrunk_ops=rec["shrunk_ops"],
            shrink_calls=rec["shrink_calls"],
            first_outcome=rec["first_outcome"],
            shrunk=rec["shrunk"],
        )

    # ---------------------------------------------------------- report
    def report(self, subjects: list[str], devices: list[str], throughput: dict[str, Any], exit_status: int) -> dict[str, Any]:
        """The ``report.json`` document (schema 2).

        ``schema``, ``seed``, ``budget_s`` (this run's), ``elapsed_s`` and
        ``programs_run`` (the whole campaign, resumed runs added up),
        ``op_counts``, ``feature_counts``, ``coverage`` (programs per
        feature and feature pair of :mod:`fuzz.coverage`, and per axis and
        pair what is covered and what not: :func:`fuzz.coverage.summary`),
        ``steered`` (whether rounds were steered), ``subjects``, ``peer_every``
        (the peer subjects ran on one program in this many: their
        ``outcome_counts`` say how many), ``devices``,
        ``failures`` (one per signature: ``id``, ``signature``, ``count``,
        ``subject``, ``device``, ``status``, ``kind`` (``crash`` and
        ``timeout`` for a worker that died or hung), ``ops``, ``hooks``,
        ``original_ops``, ``shrunk_ops``, ``shrunk``, ``reproducer`` and
        ``program_json`` relative to OUT, ``first_outcome``), ``known``
        (divergences the known-issues file matched: ``id``, ``signature``,
        ``count``, ``note``, ``link``), ``build_errors``,
        ``outcome_counts``, ``fallback_reasons``, ``sequence_captures``,
        ``engine_counts`` (per ``subject@device``: the engine's integer
        counters summed over every run, e.g. cagrad's ``cache_hits``,
        ``cudagraph_replays``: what a campaign exercised),
        ``rounds`` (rounds done), ``shard`` (``"K/N"`` or null),
        ``throughput`` (``programs_per_s``, ``workers``: this run's),
        ``timeline`` (``[elapsed_s, programs_run, failures]`` about every
        5 s), ``exit_status``, ``sessions``, ``torch_version``,
        ``op_substitutions`` (catalog ops this torch runs as an equivalent
        substitute, name -> what runs: :data:`fuzz.ops_graph.SUBSTITUTIONS`).
        """
        s = self.s
        failures = [
            {
                "id": f["id"],
                "signature": f["signature"],
                "count": f["count"],
                "subject": f["key"]["subject"],
                "device": f["key"]["device"],
                "status": f["key"]["status"],
                "kind": f["key"]["kind"],
                "ops": f["ops"],
                "hooks": f.get("hooks", []),
                "original_ops": f["original_ops"],
                "shrunk_ops": f["shrunk_ops"],
                "shrunk": f["shrunk"],
                "reproducer": f["reproducer"],
                "program_json": f["program_json"],
                "first_outcome": f["first_outcome"],
            }
            for f in s["failures"]
        ]
        return {
            "schema": REPORT_SCHEMA,
            "seed": self.cfg.seed,
            "budget_s": self.cfg.budget_s,
            "elapsed_s": round(s["elapsed_s"], 3),
            "programs_run": s["programs_run"],
            "op_counts": dict(sorted(s["op_counts"].items())),
            "feature_counts": dict(sorted(s["feature_counts"].items())),
            "coverage": coverage.summary(s.get("coverage_features", {}), s.get("coverage_pairs", {})),
            "steered": self.cfg.steer,
            "subjects": subjects,
            "peer_every": self.cfg.peer_every,
            "devices": devices,
            "failures": failures,
            "known": s["known"],
            "build_errors": s["build_errors"],
            "outcome_counts": s["outcome_counts"],
            "fallback_reasons": s["fallback_reasons"],
            "fallback_samples": s.get("fallback_samples", {}),
            "sequence_captures": s["sequence_captures"],
            "engine_counts": s.get("engine_counts", {}),
            "rounds": len(s["rounds_done"]),
            "shard": s["shard"],
            "throughput": throughput,
            "timeline": s["timeline"],
            "exit_status": exit_status,
            "sessions": s["sessions"],
            "torch_version": torch.__version__,
            "op_substitutions": dict(SUBSTITUTIONS),
        }
