"""Development tools beside the library, never installed with it: the timing model of the kernels
(tools.timing) and the GPU microbenchmarks' driver (tools.microbench). Run them from the
repository root, `python -m tools.timing ...`; they import the installed (or checked-out)
hybrid_ep."""
