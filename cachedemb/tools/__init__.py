"""Offline tools, outside the library's import graph: nothing in `cachedemb` imports them.

`traces` (id traces: Zipf, Criteo-like, files), `cache_sim` (the policy simulators' old name: they live in
`cachedemb.sizing.simulators` now) and `aot` (records the kernel variants a workload launches and compiles them
for GPU targets without a GPU; `python scripts/bench_kernels.py --aot`, tests/test_aot_compile.py). Used by
benchmarks, scripts and tests.

May import: anything in `cachedemb`.
"""
