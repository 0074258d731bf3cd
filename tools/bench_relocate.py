"""`agentwin bench relocate`: CPU relocation throughput as a ratio to a plain copy of the same bytes.

What is timed and compared: `tools.bench.relocate_bench`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from tools.bench.relocate_bench import dtype_name, even_positive_int, failure, format_table, measure, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `agentwin bench relocate`."""
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--tokens", type=positive_int, default=4096, help="tokens in the chunk (default 4096)")
    parser.add_argument("--layers", type=positive_int, default=28, help="decoder layers (default 28)")
    parser.add_argument("--kv-heads", type=positive_int, default=4, help="KV heads per layer (default 4)")
    parser.add_argument("--head-dim", type=even_positive_int, default=128, help="head dim, even (default 128)")
    parser.add_argument("--dtype", type=dtype_name, default="bf16", help="bf16 (default), fp16 or fp32")
    parser.add_argument("--pairing", choices=("half", "interleaved"), default="half",
                        help="pairs of rotated dims (default half, as in Qwen)")
    parser.add_argument("--delta", type=int, default=1000, help="position shift δ (default 1000)")
    parser.add_argument("--repeats", type=positive_int, default=15, help="timed repeats (default 15)")
    parser.add_argument("--warmup", type=positive_int, default=2, help="untimed passes first (default 2)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help=f"torch threads (default torch's, here {torch.get_num_threads()})")
    parser.add_argument("--min-ratio", type=float, default=None,
                        help="exit 1 when ratio_vs_copy falls below this (default: report only)")


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write --json; exit status 1 when numerics or --min-ratio fail."""
    results = measure(args)
    print(format_table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
        print(f"wrote {args.json}")
    problem = failure(results, args.min_ratio)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0
