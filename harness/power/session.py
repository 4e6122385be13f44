"""A run's output folder: cosmic-ray's session database and what it was made with.

``OUT/session.sqlite`` is a cosmic-ray WorkDB (one work item per sampled
mutant of this shard, job id the mutant's :class:`~harness.power.mutants.MutantId`
text; a result once the mutant has been run), ``OUT/session.json`` the run's
parameters (seed, sample size, shard, modules, killers, the digest of the
modules' sources, the sampled ids in running order) and one entry per start of
the run (its baseline time and per-mutant timeout), ``OUT/times.jsonl`` the
seconds each mutant took. A folder that already holds a session is resumed:
only mutants without a result run, and only if the parameters and the sources
are those it was made with.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.power.mutants import MutantId


class SessionError(Exception):
    """The output folder cannot be used for this run (says why)."""


@dataclass
class Params:
    """What makes two runs the same run (resuming checks every field)."""

    seed: int
    sample: int | None
    shard: tuple[int, int]
    modules: list[str]
    killers: list[str]
    programs: int
    digest: str
    only: list[str] | None = None  # named mutants instead of a sample (--mutant)
    killer_argv: list[list[str]] | None = None  # what each killer runs (a changed test subset is another run)

    def __post_init__(self) -> None:
        self.shard = tuple(self.shard)  # JSON gives a list


@dataclass
class Meta:
    params: Params
    total_mutants: int
    annotation_mutants: dict[str, int]
    ids: list[str]
    runs: list[dict[str, Any]] = field(default_factory=list)
    tool: str = "cosmic-ray"


def _meta_path(out: Path) -> Path:
    return out / "session.json"


def db_path(out: Path) -> Path:
    return out / "session.sqlite"


def load_meta(out: Path) -> Meta | None:
    """The folder's session parameters, or None when it holds no session.

    Raises:
        SessionError: a session.json that does not parse.
    """
    path = _meta_path(out)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        data["params"] = Params(**data["params"])
        return Meta(**data)
    except (ValueError, TypeError, KeyError) as e:
        raise SessionError(f"{path}: not a harness.power session file ({e})") from None


def save_meta(out: Path, meta: Meta) -> None:
    path = _meta_path(out)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(meta), indent=1))
    os.replace(tmp, path)


def check_resume(meta: Meta, params: Params, out: Path) -> None:
    """Raises SessionError naming the first parameter that differs from the
    session's in ``out``."""
    old = asdict(meta.params)
    for key, value in asdict(params).items():
        if old[key] != value:
            what = "the mutated modules' sources changed" if key == "digest" else f"{key} {old[key]!r} != {value!r}"
            raise SessionError(
                f"{out} holds a run made differently ({what}): resume it with the same arguments "
                "and sources, or use another --out"
            )


def open_db(out: Path, items: dict[MutantId, Any] | None = None):
    """The session's WorkDB; ``items`` (a new session's work items) are
    added to it first."""
    from cosmic_ray.work_db import WorkDB

    db = WorkDB(str(db_path(out)), WorkDB.Mode.create)
    if items is not None:
        db.clear()
        db.add_work_items(items.values())
    return db


def done_ids(db) -> set[str]:
    """Job ids that have a result."""
    return {job_id for job_id, _ in db.results}


def append_time(out: Path, job_id: str, seconds: float) -> None:
    with open(out / "times.jsonl", "a") as f:
        f.write(json.dumps({"id": job_id, "seconds": round(seconds, 3)}) + "\n")


def load_times(out: Path) -> dict[str, float]:
    """``{job id: seconds}`` (the last entry wins)."""
    path = out / "times.jsonl"
    if not path.exists():
        return {}
    out_times = {}
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut by an interruption
            out_times[entry["id"]] = entry["seconds"]
    return out_times
