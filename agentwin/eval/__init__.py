"""Evaluation: benchmarks' library logic (harnesses, baselines, datasets, trace replay).

Built on `KameraModel` and the public `Window`; the command-line drivers live in `tools/`.
"""
