"""What the tests run on the ranks of their process pools and what the GPU checks run as
`python -m harness.<module>` (scripts/gpu_check.sh puts tests/ on PYTHONPATH, pytest's
`pythonpath` does it for the tests): the emulated and process cases, faults, the soak, the
NVSHMEM self-tests, the host-synchronisation finder. The oracle and the cases the benchmarks
check too are the library's (hybrid_ep.verify)."""
