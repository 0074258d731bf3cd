"""The benchmarks' library: harnesses, baselines, datasets, trace replay and the pages they write.

Built on `KameraModel` and the public `Window`; the command-line drivers are the `bench_*` modules
beside this package in `tools/`, and the research studies are in `tools/studies/`.
"""
