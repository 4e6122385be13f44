"""The fuzz campaign: generate programs, run the oracle, shrink, record.

A campaign runs in *rounds*. Round ``r`` is one Hypothesis run of
``@given(programs(...))`` seeded from ``(--seed, r)``, drawing ops by a
per-round plan that steers toward what earlier rounds covered least
(:mod:`fuzz.campaign.steer`, :mod:`fuzz.coverage`): it generates the same
programs in every run, whatever the worker count or shard. Rounds are the
unit of parallelism and of sharding:

* ``--workers N`` worker processes (:mod:`fuzz.workers`) each run whole
  rounds (generate, run the oracle, shrink with Hypothesis, reduce on the IR
  with :mod:`fuzz.reduce`) and stream events to the parent
  (:mod:`fuzz.campaign.engine`), which owns ``state.json``, ``report.json``
  and the progress display. A worker that dies (a signal, an abort, out of
  memory) or runs one program past ``--timeout`` is killed and replaced; the
  program is recorded as a ``crash``/``timeout`` failure of the subject that
  was running, shrunk by re-running reduced programs in fresh interpreters
  (:mod:`fuzz.campaign.crash`), and its round goes on after it.
* ``--shard K/N`` runs only rounds ``r`` with ``r % N == K - 1``;
  ``python -m fuzz merge`` (:mod:`fuzz.merge`) joins the shards' outputs.

Failures are grouped by root-cause signature
(:func:`fuzz.signature.make_signature`): one signature is one failure,
recorded (unshrunk) at once, then shrunk once; later hits are counted.
Divergences matched by the known-issues file (:mod:`fuzz.known`) are counted
under ``known`` and do not fail the campaign.

The budget bounds generation; a shrink that started may run up to
``--shrink-seconds`` longer. ``OUT/state.json`` records which rounds are done
and how far cut-short ones got: run the same command again (same ``--seed``
and ``--shard``) and it resumes. Ctrl-C and SIGTERM stop it resumably.

Files under ``OUT``: ``report.json`` (see
:meth:`fuzz.campaign.state.CampaignState.report`), ``state.json``,
``failures/F001-.../{reproducer.py, program.json, original.json,
report.json}`` and ``build_errors/`` (programs that failed under plain
eager: fuzz catalog bugs).
"""

from fuzz.campaign.config import CampaignConfig, CampaignError, parse_shard
from fuzz.campaign.engine import Campaign
from fuzz.campaign.state import REPORT_SCHEMA, STATE_SCHEMA

__all__ = ["Campaign", "CampaignConfig", "CampaignError", "REPORT_SCHEMA", "STATE_SCHEMA", "parse_shard"]
