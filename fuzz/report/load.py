"""Reading and checking a campaign's ``report.json`` (schema 1 or 2).

The shape is checked with a JSON Schema (:data:`REPORT_SCHEMA`, by the
``jsonschema`` library): the fields that schema 1 always had are required,
the fields schema 2 added (``known``, ``throughput``, ``timeline``,
``shard``, ``exit_status``, crash/timeout failures, later ``coverage``,
``steered`` and ``peer_every``) are optional, so that an older report still loads and its
missing sections say so.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema

#: The report.json schemas this reader understands.
SCHEMAS = (1, 2)

_COUNTS = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_NUMBER = {"type": "number", "minimum": 0}
_GROUPS = {  # fuzz.coverage.summary: per axis or pair of axes
    "type": "object",
    "additionalProperties": {
        "type": "object",
        "required": ["total", "covered", "uncovered"],
        "properties": {
            "total": {"type": "integer", "minimum": 0},
            "covered": {"type": "integer", "minimum": 0},
            "uncovered": _STRINGS,
        },
    },
}

REPORT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema", "seed", "programs_run", "failures"],
    "properties": {
        "schema": {"type": "integer"},
        "seed": {"type": "integer"},
        "budget_s": _NUMBER,
        "elapsed_s": _NUMBER,
        "programs_run": {"type": "integer", "minimum": 0},
        "op_counts": _COUNTS,
        "feature_counts": _COUNTS,
        # programs per feature and pair of fuzz.coverage, and what is (not) covered
        "coverage": {
            "type": "object",
            "required": ["features", "pairs", "feature_groups", "pair_groups"],
            "properties": {"features": _COUNTS, "pairs": _COUNTS, "feature_groups": _GROUPS, "pair_groups": _GROUPS},
        },
        "steered": {"type": "boolean"},
        # peers ran on one program in this many (null: merged shards that differed)
        "peer_every": {"type": ["integer", "null"], "minimum": 1},
        "subjects": _STRINGS,
        "devices": _STRINGS,
        "failures": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["signature", "subject", "status", "kind", "count"],
                "properties": {
                    "id": {"type": "string"},
                    "signature": {"type": "string"},
                    "count": {"type": "integer", "minimum": 0},
                    "subject": {"type": "string"},
                    "device": {"type": "string"},
                    "status": {"type": "string"},
                    "kind": {"type": "string"},
                    "ops": _STRINGS,
                    "hooks": _STRINGS,
                    "original_ops": {"type": "integer", "minimum": 0},
                    "shrunk_ops": {"type": "integer", "minimum": 0},
                    "shrunk": {"type": "boolean"},
                    "reproducer": {"type": ["string", "null"]},
                    "first_outcome": {"type": ["object", "null"]},
                },
            },
        },
        "build_errors": {"type": "integer", "minimum": 0},
        "outcome_counts": {"type": "object", "additionalProperties": _COUNTS},
        "fallback_reasons": {"type": "object", "additionalProperties": _COUNTS},
        # per subject@device and reason: paths of programs that fell back (up to 3)
        "fallback_samples": {
            "type": "object",
            "additionalProperties": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "string"}}},
        },
        "sequence_captures": {"type": "object", "additionalProperties": _COUNTS},
        "engine_counts": {"type": "object", "additionalProperties": _COUNTS},
        "torch_version": {"type": "string"},
        "op_substitutions": {"type": "object", "additionalProperties": {"type": "string"}},
        "rounds": {"type": "integer", "minimum": 0},
        "sessions": {"type": "array", "items": {"type": "object"}},
        "known": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["signature", "count"],
                "properties": {
                    "id": {"type": "string"},
                    "signature": {"type": "string"},
                    "count": {"type": "integer", "minimum": 0},
                    "note": {"type": ["string", "null"]},
                    "link": {"type": ["string", "null"]},
                },
            },
        },
        "throughput": {
            "type": "object",
            "properties": {"programs_per_s": _NUMBER, "workers": {"type": "integer", "minimum": 1}},
        },
        "timeline": {
            "type": "array",
            "items": {"type": "array", "minItems": 3, "items": {"type": "number"}},  # [elapsed_s, programs_run, failures]
        },
        "shard": {"type": ["string", "null"]},
        "exit_status": {"type": "integer"},
    },
}


class ReportError(Exception):
    """report.json is missing, unreadable, not JSON, or not shaped as a campaign report.

    The message names the file and, where possible, the line or field and
    what was expected.
    """


@dataclasses.dataclass(frozen=True)
class CampaignReport:
    """A checked ``report.json`` and the campaign directory it belongs to.

    Attributes:
        data: the report document as read (missing optional fields stay missing).
        out: the campaign directory (``OUT``); reproducer paths are relative to it.
        path: the ``report.json`` file that was read.
    """

    data: dict[str, Any]
    out: Path
    path: Path

    @property
    def schema(self) -> int:
        """The report's schema number (1 or 2)."""
        return int(self.data["schema"])

    def programs_per_s(self) -> float | None:
        """Programs per second: the recorded ``throughput`` or, for schema 1,
        ``programs_run / elapsed_s``; None when neither can be had."""
        throughput = self.data.get("throughput") or {}
        if "programs_per_s" in throughput:
            return float(throughput["programs_per_s"])
        elapsed = self.data.get("elapsed_s")
        if elapsed:
            return self.data["programs_run"] / elapsed
        return None

    def reproducer_text(self, failure: dict[str, Any], limit: int = 200_000) -> str | None:
        """The text of ``failure``'s reproducer file (at most ``limit`` characters).

        Returns None when the failure names no reproducer. A reproducer that
        is missing, unreadable or outside ``OUT`` gives a one-line note
        instead of its text (never an exception: the report is still written).
        """
        rel = failure.get("reproducer")
        if not rel:
            return None
        path = (self.out / rel).resolve()
        if not path.is_relative_to(self.out.resolve()):
            return f"(reproducer {rel} is outside {self.out}; not read)"
        try:
            text = path.read_text(errors="replace")
        except OSError as e:
            return f"(reproducer {rel} could not be read: {e.strerror or e})"
        if len(text) > limit:
            text = text[:limit] + f"\n# ... cut at {limit} characters; see {rel}\n"
        return text


def load_report(where: str | Path) -> CampaignReport:
    """Reads and checks a campaign report.

    Args:
        where: the campaign directory ``OUT`` (its ``report.json`` is read) or
            the path of a ``report.json`` file.

    Raises:
        ReportError: the file is missing or unreadable, is not JSON (line
            and column named), has a schema other than 1 or 2, or a field
            of the wrong shape (the field's JSON path named).
    """
    where = Path(where)
    path = where / "report.json" if where.is_dir() else where
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file; expected a campaign's report.json (run `python -m fuzz campaign --out DIR` first)") from None
    except OSError as e:
        raise ReportError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ReportError(f"{path}: byte {e.start} is not UTF-8; expected a campaign's report.json (JSON text)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); expected a campaign report") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object (a campaign report), got {type(data).__name__}")
    if data.get("schema") not in SCHEMAS:
        raise ReportError(f"{path}: field 'schema' is {data.get('schema')!r}; expected one of {list(SCHEMAS)}")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(REPORT_SCHEMA).iter_errors(data))
    if error is not None:
        raise ReportError(f"{path}: field {error.json_path}: {error.message}")
    return CampaignReport(data=data, out=path.parent, path=path)
