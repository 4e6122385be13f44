"""Campaign settings and the small file helpers the campaign modules share."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from fuzz.strategies import GenConfig


class CampaignError(Exception):
    """A usage or I/O problem (exit status 2): the message names the file or
    flag and what was expected."""


@dataclasses.dataclass
class CampaignConfig:
    """What one ``python -m fuzz campaign`` run does.

    Attributes:
        budget_s: seconds of generation (a shrink that started may run up to
            ``shrink_s`` longer).
        seed: the campaign seed; round ``r`` is a Hypothesis run seeded from
            ``(seed, r)``.
        out: the output directory (resumed when it holds a campaign).
        subjects, plugins, devices: as for :class:`fuzz.oracle.Oracle`.
        gen: the program strategy's settings.
        shrink_s: seconds to shrink one new failure.
        round_size: programs per round (the unit of parallelism and shards).
        progress: show a live progress bar.
        max_programs: stop after this many programs (this session).
        workers: worker processes running rounds (each program runs in one).
        timeout_s: seconds (wall clock) one program may run before its
            worker is killed and a ``timeout`` failure is recorded.
        cpu_timeout_s: CPU seconds (user + system, every thread of the
            worker, as ``/proc/PID/stat`` counts them) one program may use
            before the same happens; None for no such limit. Unlike
            ``timeout_s`` it does not fire sooner on a busy machine, but a
            hang that sleeps or waits uses no CPU: only ``timeout_s``
            catches that. Linux only.
        shard: ``(K, N)``: run only rounds ``r`` with ``r % N == K - 1``.
        rounds: run only rounds ``0 .. rounds - 1`` (of the whole campaign,
            before sharding); None for as many as the budget allows.
        known: the known-issues file (``"default"`` for the shipped one,
            None for none).
        neighbours: neighbour programs per agreeing program (see
            :class:`fuzz.oracle.Oracle`).
        steer: steer each round's op weights toward what earlier rounds
            covered least (:mod:`fuzz.campaign.steer`); False: the base
            weights in every round.
        peer_every: the peer subjects (:attr:`fuzz.oracle.Oracle.peers`:
            torch's compiled autograd) run on the programs of a round whose
            index is a multiple of this, cagrad's on every program; 1 runs
            the peers on every program. A failure found is shrunk and
            replayed with its own subject whatever the sample.
    """

    budget_s: float
    seed: int
    out: Path
    subjects: list[str] | None = None
    plugins: list[str] = dataclasses.field(default_factory=list)
    devices: list[str] | None = None
    gen: GenConfig = dataclasses.field(default_factory=GenConfig)
    shrink_s: float = 120.0
    round_size: int = 100
    progress: bool = True
    max_programs: int | None = None
    workers: int = 1
    timeout_s: float = 60.0
    cpu_timeout_s: float | None = None
    shard: tuple[int, int] | None = None
    rounds: int | None = None
    known: str | None = None
    neighbours: int = 0
    steer: bool = True
    peer_every: int = 4

    def shard_text(self) -> str | None:
        return f"{self.shard[0]}/{self.shard[1]}" if self.shard else None

    def owns(self, r: int) -> bool:
        """Whether round ``r`` belongs to this run's shard."""
        return self.shard is None or r % self.shard[1] == self.shard[0] - 1


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``1 <= K <= N``; raises ValueError naming
    what was expected."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"bad shard {text!r}: expected K/N with 1 <= K <= N, e.g. 1/4")
    return int(m.group(1)), int(m.group(2))


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:60]


def atomic_write(path: Path, text: str) -> None:
    """Writes ``text`` to a temporary file beside ``path``, then renames it
    over ``path``: readers see the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
