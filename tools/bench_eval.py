"""`agentwin bench eval`: Kamera against blind reuse, CacheBlend-, EPIC- and VLCache-style recompute and a byte-matched token-sparse store, settings chosen on validation and scored on test; written to docs/RESULTS.md.

The suite is `tools.bench.suite`; this module parses the options and picks where the page goes.
`--quick` runs the whole suite on a few items, for checking it end to end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tools.bench.suite import Options, run_suite

POSITIVE = ("binding_val_items", "binding_test_items", "binding_test_sets", "smollm2_val_cases", "smollm2_test_cases",
            "smollm2_queries", "vl_seeds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Options()
    parser.add_argument("--quick", action="store_true",
                        help="a few items per workload: checks the suite end to end")
    parser.add_argument("--results", metavar="DIR", default=None,
                        help="where RESULTS.md and results/eval_*.{json,png} go (default: docs/; "
                             "with --quick a temporary directory)")
    parser.add_argument("--binding-val-items", type=int, default=d.binding_val_items,
                        help=f"validation items per reuse condition (default {d.binding_val_items})")
    parser.add_argument("--binding-test-items", type=int, default=d.binding_test_items,
                        help=f"test items per set and condition (default {d.binding_test_items})")
    parser.add_argument("--binding-test-sets", type=int, default=d.binding_test_sets,
                        help=f"test item sets per condition (default {d.binding_test_sets})")
    parser.add_argument("--smollm2-val-cases", type=int, default=d.smollm2_val_cases,
                        help=f"generated SmolLM2 validation cases (default {d.smollm2_val_cases})")
    parser.add_argument("--smollm2-test-cases", type=int, default=d.smollm2_test_cases,
                        help=f"generated SmolLM2 test cases (default {d.smollm2_test_cases})")
    parser.add_argument("--smollm2-queries", type=int, default=d.smollm2_queries,
                        help=f"questions per SmolLM2 case (default {d.smollm2_queries})")
    parser.add_argument("--vl-seeds", type=int, default=d.vl_seeds, help=f"multimodal layouts per model (default {d.vl_seeds})")
    parser.add_argument("--binding-checkpoint", metavar="DIR", default=None,
                        help="binding checkpoint directory (default: the shipped tools/bench/binding/data)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("binding", "smollm2", "multimodal"),
                        help="workloads not to run; their figures from an earlier run in the same results "
                             "directory (results/eval_<name>.json) stay on the page, marked as such")


def run(args: argparse.Namespace) -> int:
    for name in POSITIVE + (("threads",) if args.threads is not None else ()):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    root = Path(args.results) if args.results else (Path(tempfile.mkdtemp(prefix="agentwin-eval-")) if args.quick
                                                   else Path(__file__).resolve().parent.parent / "docs")
    run_suite(Options.from_args(args), root, log=lambda s: print(s, flush=True))
    return 0
