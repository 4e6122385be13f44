"""Reports people read, made from a campaign's ``report.json``.

``python -m fuzz report OUT [--html [PATH]] [--junit [PATH]]`` writes a
self-contained HTML page (:mod:`fuzz.report.html`, plots by plotly, inlined)
and a JUnit XML file for CI dashboards (:mod:`fuzz.report.junit`) from
``OUT/report.json``, read and checked by :mod:`fuzz.report.load`. The
command itself is :mod:`fuzz.report.cli`; nothing is imported here, so
that ``python -m fuzz`` starts without plotly or jinja2.
"""
