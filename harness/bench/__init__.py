"""``python -m harness.bench``: steady-state backward time, side by side.

One run measures every subject on every workload in the same process, so
ratios to eager are comparable: eager autograd, ``torch.compile(model)``
alone, torch's compiled autograd and cagrad with the eager and inductor
backends. See :mod:`harness.bench.cli`.
"""
