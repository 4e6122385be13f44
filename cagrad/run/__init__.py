"""Running a compiled backward: the runtime wrapper (call, accumulate,
release), the interpreter that finishes a deopted run, and torch's GraphTask
around a graph for callbacks queued from C++."""
