"""One mutation run: sample, copy, baseline, then each pending mutant.

Order of a run (a new one or a resumed one):

1. enumerate the modules' mutants (cosmic-ray), sample ``sample`` of them
   with ``seed``, keep this shard's share; a folder with a session is checked
   against these parameters and resumed;
2. copy the tree (:mod:`harness.power.tree`), build cagrad's extension once
   in it (the seed of each mutant's own extensions folder);
3. the baseline: the killers on the unmutated copy, timed; they must all
   pass. The per-mutant timeout is ``timeout_factor`` times that time
   (measured at every start, so a resumed run on a busier machine gets a
   longer one);
4. each pending mutant, in sampled order: cosmic-ray's ``mutate_and_test``
   writes the mutant into the copy, runs :mod:`harness.power.kill` with the
   timeout, restores the file; the result goes into the session database at
   once (an interrupted run loses at most the mutant it was on).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.power import kill, session, tree
from harness.power.mutants import CORE_PACKAGES, MutantId, enumerate_mutants, module_paths, sample, shard


class BaselineError(Exception):
    """The killers fail on the unmutated tree: a score would mean nothing."""


@dataclass
class RunConfig:
    out: Path
    sample: int | None = 300
    seed: int = 0
    shard: tuple[int, int] = (1, 1)
    targets: tuple[str, ...] = CORE_PACKAGES
    killers: tuple[str, ...] = ("tests", "golden", "fuzz")
    programs: int = 30
    timeout_factor: float = 5.0
    max_mutants: int | None = None  # stop after this many mutants in this invocation (resume later)
    scratch: Path | None = None
    only: tuple[str, ...] = ()  # these mutant ids (their text form) instead of a sample
    #: what the copy holds and the package it must import from itself (other trees: the tool's own tests)
    copied: tuple[str, ...] = tree.COPIED
    package: str = "cagrad"


@contextlib.contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _stop_children() -> None:
    """Kills the process group of each child of this process: cosmic-ray
    starts the killers in a session of their own, which an interrupt of this
    process does not reach (Linux; elsewhere a no-op)."""
    try:
        pids = Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children").read_text().split()
    except OSError:
        return
    for pid in pids:
        with contextlib.suppress(OSError):  # not a group leader, or gone
            os.killpg(int(pid), signal.SIGKILL)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def kill_command(cfg: RunConfig, ext_seed: Path, scratch: Path) -> str:
    """The test command cosmic-ray runs in the copy (a string: cosmic-ray
    splits it with shlex): a snapshot of this package's kill.py in
    ``scratch`` (never mutated; editing the checkout's during a run changes
    nothing)."""
    runner_path = scratch / "kill.py"
    shutil.copy2(Path(__file__).with_name("kill.py"), runner_path)
    argv = [
        sys.executable, str(runner_path), "--killers", ",".join(cfg.killers),
        "--programs", str(cfg.programs), "--ext-seed", str(ext_seed), "--scratch", str(scratch),
    ]  # fmt: skip
    return shlex.join(argv)


def prepare(cfg: RunConfig, root: Path, log: Callable[[str], None]) -> tuple[session.Meta, object]:
    """Step 1: the session's parameters and database (new or resumed)."""
    modules = module_paths(root, cfg.targets)
    params = session.Params(
        seed=cfg.seed, sample=cfg.sample, shard=cfg.shard, modules=modules, killers=list(cfg.killers),
        programs=cfg.programs, digest=tree.digest(root, modules), only=list(cfg.only) or None,
        killer_argv=[["python", *kill.command(k, cfg.programs, "SCRATCH")[1:]] for k in cfg.killers],
    )  # fmt: skip
    cfg.out.mkdir(parents=True, exist_ok=True)
    meta = session.load_meta(cfg.out)
    if meta is not None:
        session.check_resume(meta, params, cfg.out)
        db = session.open_db(cfg.out)
        log(f"resuming {cfg.out}: {len(session.done_ids(db))} of {len(meta.ids)} mutants done")
        return meta, db
    skipped: dict[str, int] = {}
    items = enumerate_mutants(root, modules, skipped)
    if cfg.only:
        chosen = [MutantId.parse(text) for text in cfg.only]
        unknown = [str(i) for i in chosen if i not in items]
        if unknown:
            raise session.SessionError(f"no such mutant in {', '.join(modules)}: {', '.join(unknown)}")
        chosen = shard(chosen, *cfg.shard)
    else:
        chosen = shard(sample(items, cfg.sample, cfg.seed), *cfg.shard)
    meta = session.Meta(
        params=params, total_mutants=len(items), annotation_mutants=skipped, ids=[str(i) for i in chosen]
    )
    db = session.open_db(cfg.out, {i: items[i] for i in chosen})
    session.save_meta(cfg.out, meta)
    log(
        f"{len(items)} mutants in {len(modules)} modules ({sum(skipped.values())} more in annotations, left out); "
        f"sampled {len(chosen)} (seed {cfg.seed}, shard {cfg.shard[0]}/{cfg.shard[1]})"
    )
    return meta, db


def baseline(copy: Path, command: str, ext_seed: Path, log: Callable[[str], None], package: str = "cagrad") -> float:
    """Steps 2 and 3: builds the extension into ``ext_seed``, then runs the
    killers on the unmutated copy; returns their wall time in seconds.

    Raises:
        BaselineError: a killer fails on the unmutated tree, or the copy
            does not import its own cagrad.
    """
    env = dict(os.environ, PYTHONPATH=str(copy), TORCH_EXTENSIONS_DIR=str(ext_seed), PYTHONDONTWRITEBYTECODE="1")
    probe = f"import os, {package}; print(os.path.dirname({package}.__file__))\n"
    if package == "cagrad":
        probe += (
            "from cagrad.native.build import build_cagrad_ext\n"
            "try:\n build_cagrad_ext()\nexcept Exception as e:\n print('extension not built:', e)\n"
        )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=env, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or not lines or Path(lines[0]).resolve() != (copy / package).resolve():
        raise BaselineError(f"the copy {copy} does not import its own {package}:\n{proc.stdout}{proc.stderr[-2000:]}")
    start = time.perf_counter()
    proc = subprocess.run(
        shlex.split(command), cwd=copy, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"),
        capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise BaselineError(f"the killers fail on the unmutated tree (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    log(f"baseline: the killers pass on the unmutated tree in {seconds:.1f} s")
    return seconds


def run(cfg: RunConfig, log: Callable[[str], None] = print, root: Path | None = None) -> Path:
    """Runs (or resumes) the session in ``cfg.out``; returns ``cfg.out``.

    Raises:
        SessionError, BaselineError, ImportError (cosmic-ray missing).
    """
    import parso  # noqa: F401  (before cosmic-ray's plugins: see mutants.enumerate_mutants)
    from cosmic_ray.mutating import mutate_and_test

    root = root or tree.repo_root()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # cleaned up as after Ctrl-C
    meta, db = prepare(cfg, root, log)
    try:
        done = session.done_ids(db)
        pending = [i for i in meta.ids if i not in done]
        if cfg.max_mutants is not None:
            pending = pending[: cfg.max_mutants]
        if not pending:
            log("nothing pending")
            return cfg.out
        items = {item.job_id: item for item in db.work_items}
        copy = tree.make_copy(root, cfg.scratch, cfg.copied)
        try:
            ext_seed = copy.parent / (copy.name + "-ext")
            scratch = copy.parent / (copy.name + "-scratch")
            scratch.mkdir()
            command = kill_command(cfg, ext_seed, scratch)
            base = baseline(copy, command, ext_seed, log, cfg.package)
            timeout = cfg.timeout_factor * base
            meta.runs.append({"started": time.time(), "baseline_seconds": round(base, 2), "timeout_seconds": round(timeout, 2)})
            session.save_meta(cfg.out, meta)
            for n, job_id in enumerate(pending, 1):
                item = items[job_id]
                module = copy / item.mutations[0].module_path
                original = module.read_bytes()
                start = time.perf_counter()
                try:
                    with _cwd(copy):
                        result = mutate_and_test(item.mutations, command, timeout)
                except BaseException:  # an interrupt: the mutant's killers must not run on
                    _stop_children()
                    raise
                seconds = time.perf_counter() - start
                if module.read_bytes() != original:  # cosmic-ray restores it; make sure
                    module.write_bytes(original)
                db.set_result(job_id, result)
                session.append_time(cfg.out, job_id, seconds)
                log(f"[{n}/{len(pending)}] {job_id}: {describe(result)} ({seconds:.1f} s)")
        finally:
            tree.remove_copy(copy)
            tree.remove_copy(copy.parent / (copy.name + "-ext"))
            tree.remove_copy(copy.parent / (copy.name + "-scratch"))
    finally:
        db.close()
    return cfg.out


def describe(result) -> str:
    """One word for a cosmic-ray WorkResult, the killer's name for a kill
    (``killed:tests``), ``timeout`` for one killed by the timeout."""
    from harness.power.outcomes import classify

    outcome, killer = classify(result)
    return f"{outcome}:{killer}" if killer else outcome
