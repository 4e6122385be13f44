"""Finding every hook a backward would run (Python, C++ and DDP's), and the
tensor hooks pure enough to be traced into the graph."""
