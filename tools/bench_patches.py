"""`agentwin bench patches`: conditioning patches against blind reuse on the real SmolLM2.

For each seed, a generated case (A ~200 tokens defining entities, B ~400 tokens referring to them
indirectly, questions naming the entities) is measured against a full re-prefill of
[A, B, question] by next-token KL. Reported per seed and in aggregate:
- per layer: relative ‖Δ‖ of K and V and the deficit energy in the top 8/16/32/64 directions;
- blind reuse; the oracle token-recompute curve (top x% tokens by ‖Δ‖ take their exact KV);
- KL against patch bytes (fraction of B's KV bytes) for each fitting method, uniform ranks and the
  byte-budget allocator; a full-rank patch's exactness;
- the orbit patch for the set {B, E1, E2} read after A in all 6 orders;
- patch build cost in units of one re-prefill of B, and the reuses after which it has paid off.
Writes a table to stdout, JSON (`--json`) and a PNG plot of KL versus bytes (`--plot`). The
measurements are `tools.bench.harness`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from agents.console import torch_threads
from tools.options import positive_arg
from tools.bench.harness import measure_case, measure_orbit, print_report, summarise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=5, help="number of generated cases (default 5)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--orbit-seeds", type=int, default=2,
                        help="cases on which the 3-chunk orbit experiment runs (6 orders each; default 2)")
    parser.add_argument("--storage", choices=("fp16", "bf16", "int8"), default="fp16",
                        help="patch factor storage (default fp16)")
    parser.add_argument("--json", metavar="FILE", help="write all figures to FILE")
    parser.add_argument("--plot", metavar="PNG", help="write the KL-versus-bytes plot to PNG")
    parser.add_argument("--page", metavar="FILE", help="the results page (default: PATCHES.md next to the --json file)")
    parser.add_argument("--threads", type=positive_arg, default=1, help="torch CPU threads (default 1, as the demo's)")


def run(args: argparse.Namespace) -> int:
    with torch_threads(args.threads):
        return _measure(args)


def _measure(args: argparse.Namespace) -> int:
    from tools.bench import patches_page, runs
    from tools.bench.plots import plot_kl_vs_bytes
    from agentwin.models.zoo import load_smollm2

    if args.seeds < 1 or args.orbit_seeds < 0:
        print("error: --seeds must be >= 1 and --orbit-seeds >= 0", file=sys.stderr)
        return 2
    started, load_start = time.perf_counter(), runs.load_average()
    print("loading SmolLM2-135M-Instruct ...", flush=True)
    model, tokenizer = load_smollm2(torch.float32)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    cases = []
    for seed in seeds:
        t0 = time.perf_counter()
        cases.append(measure_case(model, tokenizer, seed, args.storage))
        print(f"  seed {seed} measured in {time.perf_counter() - t0:.0f} s", flush=True)
    orbits = [measure_orbit(model, tokenizer, seed, args.storage) for seed in seeds[: args.orbit_seeds]]
    summary = summarise(cases, orbits)
    print_report(summary)
    if args.plot:
        rows = [{"method": m, "bytes_frac": v["bytes_frac"], "kl": v["kl"]}
                for m, per in summary["table"].items() for v in per.values()]
        rows.append({"method": "blind", "bytes_frac": 0.0, "kl": summary["blind_kl"]})
        plot_kl_vs_bytes(rows, args.plot, f"SmolLM2-135M: KL vs patch bytes ({len(seeds)} seeds)")
        print(f"plot written to {args.plot}")
    data = {**summary, "cases": cases, "orbit": orbits, "storage": args.storage,
            "command": runs.command_of("agentwin bench patches", args, add_arguments),
            "plot": os.path.basename(args.plot) if args.plot else None, "threads": torch.get_num_threads(),
            "machine": runs.machine(), "load_average_start": load_start, "load_average_end": runs.load_average(),
            "seconds_total": time.perf_counter() - started}
    if args.json or args.page:
        runs.write_results(data, patches_page.render, args.json, args.page, "PATCHES.md",
                           log=lambda line: None if line.startswith("\n") else print(line))
    return 0
