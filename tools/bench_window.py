"""`agentwin bench window`: next-token KL against re-prefill after window operations, and the work
each patch policy forwards.

Four chunks of a generated case are appended ([A, B, E1, E2]); then one of append (nothing),
recall, evict, reorder, slide runs, under blind reuse, rank-16 origin and orbit patches and exact
patches (`tools.bench.window_ops` has the details). `--json FILE` writes the figures and the
results page (`--page`, default WINDOW.md next to FILE) from them.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=3, help="generated cases (default 3)")
    parser.add_argument("--rank", type=int, default=16, help="rank of the origin and orbit patches (default 16)")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (default) or a built-in tiny-* text model (a check of the command)")
    parser.add_argument("--quick", action="store_true", help="chunks cut short and two questions (a check of the command)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE and the results page beside it")
    parser.add_argument("--page", metavar="FILE", help="the results page (default: WINDOW.md next to the --json file)")


def run(args: argparse.Namespace) -> int:
    from tools.bench import runs, window_ops
    from agentwin.models.adapter import KameraModel

    if args.seeds < 1 or args.rank < 1 or args.threads < 1:
        print("error: --seeds, --rank and --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    load_start = runs.load_average()
    started = time.perf_counter()
    print(f"loading {args.model} ...", flush=True)
    try:
        km = KameraModel.from_pretrained(args.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if km.is_vlm:
        print("error: the window benchmark uses text chunks: choose a text model", file=sys.stderr)
        return 2
    model = "SmolLM2-135M-Instruct" if args.model == "smollm2" else args.model
    figures = window_ops.run_all(km, args.seeds, args.rank, args.quick, lambda m: print(m, flush=True))
    data = {
        "command": runs.command_of("agentwin bench window", args, add_arguments),
        "model": model, "rank": args.rank, "seeds": list(range(args.seeds)), "quick": args.quick,
        "threads": args.threads, "machine": runs.machine(), **figures,
        "load_average_start": load_start, "load_average_end": runs.load_average(),
        "seconds_total": time.perf_counter() - started,
    }
    runs.write_results(data, window_ops.render, args.json, args.page, "WINDOW.md")
    return 0
