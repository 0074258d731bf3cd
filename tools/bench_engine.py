"""`agentwin bench engine`: the window's KV engine on the real SmolLM2-135M-Instruct: recall to the
first token, decoding over many segments, and the memory of a long loop under fixed budgets.

The parts and their figures are described in `tools.bench.engine_bench`.
"""

from __future__ import annotations

import argparse
import json
import sys

from tools.options import positive_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (a check of the command on the real model, not a measurement)")
    parser.add_argument("--threads", type=positive_arg, default=2, help="torch CPU threads on every side (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per path, at least 5 (default 5)")
    parser.add_argument("--window-tokens", type=int, default=8192, help="recall: tokens in the window (default 8192)")
    parser.add_argument("--segment-tokens", type=int, default=4096, help="recall: tokens of the segment (default 4096)")
    parser.add_argument("--decode-tokens", type=int, default=8192, help="decode: tokens in the window (default 8192)")
    parser.add_argument("--segments", default="4,16,64", help="decode: chunk counts (default 4,16,64)")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode: tokens generated per run (default 8)")
    parser.add_argument("--rss-chunk-tokens", type=int, default=96, help="rss: tokens per chunk (default 96)")
    parser.add_argument("--rss-budget-tokens", type=int, default=1024, help="rss: the window's budget (default 1024)")
    parser.add_argument("--rss-store-mb", type=int, default=64, help="rss: the store's RAM budget in MB (default 64)")
    parser.add_argument("--parts", default="recall,decode,rss", help="comma-separated parts to run (default all)")


def run(args: argparse.Namespace) -> int:
    from tools.bench import engine_bench

    problem = engine_bench.check(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    result = engine_bench.measure(args)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    print(json.dumps(engine_bench.summary(result), indent=2))
    return 0
