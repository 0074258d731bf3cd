"""`agentwin bench fleet`: a pool of agent workers with one shared store vs a private store each.

The workload, the two runs and the figures are described in `tools.bench.fleet_bench`.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    parser.add_argument("--quick", action="store_true", help="tiny-llama-gqa and 6 tasks (a smoke run)")
    parser.add_argument("--model", help="model of every worker (default smollm2; tiny-llama-gqa with --quick)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes, 2 to 4 (default 2)")
    parser.add_argument("--threads", type=int, help="torch threads per worker, both runs (default: CPUs / workers)")
    parser.add_argument("--tasks", type=int, help="document tasks (default 12; 6 with --quick)")
    parser.add_argument("--docs", type=int, default=3, help="distinct PDFs the tasks share (default 3)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each side, alternating which goes first; wall times are the median (default 3)")
    parser.add_argument("--store", metavar="URL", help="shared tier: a redis:// URL (default: a shared directory)")
    parser.add_argument("--get-entries", type=int, default=16, help="entries timed for remote_get_mb_s (default 16)")
    parser.add_argument("--get-entry-mb", type=float, default=2.0, help="MiB per timed entry (default 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from tools.bench import fleet_bench

    problem = fleet_bench.check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        results = fleet_bench.measure(args)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(fleet_bench.format_table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
        print(f"wrote {args.json}")
    return 0
