"""Eager autograd's semantics, in Python: what torch's engine does per node.

The rest of cagrad builds on these: GraphTask and the ready queue (eager's
run order), the per-node steps of the engine's walk, validate_outputs,
AccumulateGrad, SavedVariable access and release, custom Functions as PyNode
runs them, the running backward's context (``queue_callback``, grad mode),
and Python formulas for nodes whose C++ formula keeps a size as an int.
"""
