"""The GPU microbenchmarks' results: `python -m tools.microbench LINES --out DIR`.

csrc/microbench/ (built by scripts/build_microbench.sh, run by `scripts/gpu_check.sh micro`)
prints one JSON object per line; this package turns them into micro.json (with the
project's metadata block), a text table of the hardware constants the kernel designs rest
on, and a plot of the bulk-copy sweeps. Modules, one job each: records (reading and checking
the lines), constants (which line gives which constant), report (micro.json and the table),
plot (the PNG).
"""
